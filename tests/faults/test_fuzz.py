"""Damaged inputs (issue: reliability under faults, item 5): a fixed-seed subset of the fuzzing in
tools/fuzz_inputs.py (`make fuzz` runs 1,000 trials and prints the tally). Every flipped byte,
truncation or appended garbage in a shard, sidecar, the manifest or the target head ends in a
clear error naming the file, or in results identical to the undamaged run. Plus the checksum
that every JSON file carries since format 3, and format 2 extracts (no checksums) still read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline import shards
from pipeline.shards import ShardError, ShardSet
from tools import fuzz_inputs

CI_TRIALS = 80
CI_SEED = 0


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return fuzz_inputs.build_pristine(tmp_path_factory.mktemp("fuzz") / "pristine")


def test_fixed_seed_subset_ends_in_clear_errors_or_identical_results(pristine, tmp_path):
    outcomes = fuzz_inputs.run_trials(pristine, CI_SEED, range(CI_TRIALS), tmp_path)
    tally = fuzz_inputs.tally(outcomes)
    failures = [fuzz_inputs.describe(o, CI_SEED) + "\n" + o.message + o.listing_message for o in outcomes if not o.ok]
    assert not failures, tally + "\n\n" + "\n\n".join(failures)
    kinds = {o.damage.kind for o in outcomes}
    assert kinds == set(fuzz_inputs.KINDS), tally  # every region was hit
    verdicts = {o.verdict for o in outcomes}
    assert verdicts == {"error", "identical"}, tally  # both endings occur: the check is not vacuous
    print(tally)


def copy_extract(pristine, tmp_path):
    out = tmp_path / "shards"
    shutil.copytree(pristine.shards, out)
    return out


def test_json_checksum_covers_content_not_layout(pristine, tmp_path):
    out = copy_extract(pristine, tmp_path)
    manifest_path = out / shards.MANIFEST_NAME
    raw = json.loads(manifest_path.read_text())
    assert raw["checksum"].startswith("xxh3_64:") and raw["format_version"] == shards.FORMAT_VERSION
    manifest_path.write_text(json.dumps(raw, indent=4))  # other whitespace, same content: read as before
    assert ShardSet(str(out)).entries == pristine.listing
    entry = raw["shards"][0]
    entry["rows"] -= 1  # still valid JSON, another extract: refused, naming the file
    manifest_path.write_text(json.dumps(raw, indent=1, sort_keys=True))
    with pytest.raises(ShardError, match=r"manifest\.json is damaged \(checksum mismatch\).*restore it"):
        ShardSet(str(out))
    entry["rows"] += 1
    raw["checksuM"] = raw.pop("checksum")  # a damaged key name does not pass for a format 2 file
    manifest_path.write_text(json.dumps(raw, indent=1, sort_keys=True))
    with pytest.raises(ShardError, match=r"manifest\.json is damaged \(its checksum is missing\)"):
        ShardSet(str(out))

    shutil.copy(Path(pristine.shards) / shards.MANIFEST_NAME, manifest_path)
    sidecar = out / pristine.files["sidecar"][1]
    text = sidecar.read_text()
    sidecar.write_text(text.replace('"q', '"Q', 1))  # a sample id, as resume reads it
    with pytest.raises(ShardError, match=rf"{sidecar.name} is damaged \(checksum mismatch\).*re-run the same"):
        shards.finished_shard_entries(str(out))


def test_format_2_extract_without_checksums_still_scores(pristine, tmp_path):
    """An extract written before JSON checksums (format 2) reads and scores as it did."""
    out = copy_extract(pristine, tmp_path)
    for relative in [shards.MANIFEST_NAME, *pristine.files["sidecar"]]:
        path = out / relative
        obj = json.loads(path.read_text())
        del obj["checksum"]
        if relative == shards.MANIFEST_NAME:
            obj["format_version"] = obj["settings"]["format_version"] = 2
        path.write_text(json.dumps(obj, indent=1, sort_keys=True))
    assert shards.read_manifest(str(out))["format_version"] == 2
    assert shards.finished_shard_entries(str(out)) == pristine.listing
    result = fuzz_inputs.run_score(str(out), pristine.ckpt, str(tmp_path / "results"))
    assert result.exit_code == 0, result.output
    tables, _ = fuzz_inputs.read_results(tmp_path / "results")
    for name, table in pristine.reference.items():
        assert fuzz_inputs.same(tables[name].to_pylist(), table.to_pylist()), name

    # a format 2 entry is still checked for consistency: a row count that disagrees is refused
    manifest_path = out / shards.MANIFEST_NAME
    obj = json.loads(manifest_path.read_text())
    obj["shards"][0]["rows"] += 1
    manifest_path.write_text(json.dumps(obj, indent=1, sort_keys=True))
    with pytest.raises(ShardError, match=r"manifest\.json is damaged: field .shards\[0\]. does not add up"):
        ShardSet(str(out))
