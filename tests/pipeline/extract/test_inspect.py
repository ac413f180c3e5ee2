"""`specreplay inspect` on a real extract: the bytes line says what its ratio is against and the
dtype the features are stored in, so a float32 extract's 1.5 is not read against the README's
~0.6 for bf16 features."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner

from specreplay.cli import main
from tests.helpers.shards import tiny_shards


def test_bytes_ratio_names_its_reference_and_the_stored_dtype(tmp_path, tiny_qwen3_dir):
    shards = tiny_shards(tmp_path, tiny_qwen3_dir, [{"id": f"q{i}", "prompt": f"Name {i} colours."} for i in range(2)])
    report = json.loads(CliRunner().invoke(main, ["inspect", shards, "--json", "--no-verify"]).output)
    assert report["tensors"]["features"] == "float32"  # tiny_shards extracts in fp32
    text = CliRunner().invoke(main, ["inspect", shards, "--no-verify"]).output
    line = next(line for line in text.splitlines() if line.strip().startswith("bytes"))
    match = re.search(
        r"stored bytes = (\d+\.\d+) x the features as raw bf16 \((\d+) B/token; features stored as (\w+)\)", line
    )
    assert match, line
    ratio, raw, stored = match.groups()
    assert float(ratio) == round(report["bytes_vs_raw_bf16_features"], 3) and float(ratio) > 1  # fp32: over 1
    assert int(raw) == report["raw_bf16_feature_bytes_per_token"] and stored == "float32"


def test_exact_walks_line_names_the_samples_with_mismatches():
    from pipeline.extract.inspect import greedy_lines

    report = {"greedy_consistency": 0.99, "argmax_mismatches": 4, "greedy_samples": 5}
    named = greedy_lines({**report, "exact_samples": 3, "mismatched_samples": {"q1": 3, "q4": 1}})
    assert named[1] == (
        "  exact walks     3 of 5 greedy samples; not exact (teacher-forced along the stored tokens; "
        "positions): q1 (3), q4 (1)"
    )
    older = greedy_lines({**report, "exact_samples": None, "mismatched_samples": {}})  # entries without the ids
    assert older[1] == "  exact walks     not recorded (extracted by an older specreplay) of 5 greedy samples"


def test_an_unfinished_extract_exits_1_saying_to_resume(tmp_path, tiny_qwen3_dir):
    shards = tiny_shards(tmp_path, tiny_qwen3_dir, [{"id": "q0", "prompt": "Hi"}], max_new_tokens=4)
    manifest = json.load(open(f"{shards}/manifest.json"))
    json.dump({**manifest, "complete": False}, open(f"{shards}/manifest.json", "w"))
    result = CliRunner().invoke(main, ["inspect", shards, "--no-verify"])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "not complete" in errors[0] and "run the same extract command" in errors[0], errors
