"""What the reference builds of `make setup` share (tools/arctic_suffix.py, tools/sglang_ngram.py):
build once, skipped while the built reference loads, one error line when it does not."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def ensure_built(loads: Callable[[], bool], build: Callable[[], None], what: str, share: Path) -> int:
    """Exit status of `make setup`'s step: 0 once `what` loads from `share` (built now if it did not)."""
    if not loads():
        build()
        if not loads():
            print(f"error: {what} built in {share} does not load", file=sys.stderr)
            return 1
    print(f"{what}: built in {share}")
    return 0
