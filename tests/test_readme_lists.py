"""The README's lists name everything there is: every diagnose variant and every column of
samples.parquet (a new one added to the code and not to the README fails here)."""

from __future__ import annotations

import os

from scoring.diagnose.variants import VARIANTS
from scoring.results import SAMPLES

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_every_diagnose_variant_is_in_the_variants_list():
    text = open(README).read()
    listed = text[text.index("- Variants: ") :].split("\n- ", 1)[0]
    assert [name for name in VARIANTS if name != "as-configured" and f"`{name}`" not in listed] == []


def test_every_samples_column_is_in_the_results_table():
    """In the samples.parquet row, or among the columns every file shares (the paragraph and walk row above it)."""
    text = open(README).read()
    end = text.index("\n", text.index("| `samples.parquet` |"))
    table = text[text.index("| file | one row per | columns |") - 600 : end]
    assert [field.name for field in SAMPLES if f"`{field.name}`" not in table] == []
