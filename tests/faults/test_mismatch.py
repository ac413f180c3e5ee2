"""Mismatched inputs (issue: reliability under faults, item 6), through the CLI: a shard deleted
or renamed, a manifest from another extract, shards of two extracts mixed in one directory, a
drafter whose config and weights disagree, results of different shards given to `compare`.
Each is one clear error naming both sides, exit 2 (1 for a per-checkpoint failure), no traceback."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from specreplay.cli import main
from tests.helpers.drafters import random_drafter
from tests.helpers.prompts import write_prompts

ARGS: dict[str, list[str]] = {}  # extract directory name -> the extract arguments that wrote it


def extract_args(shards: str) -> list[str]:
    return ARGS[os.path.basename(shards)]


@pytest.fixture(scope="module")
def two_extracts(tiny_qwen3_dir, tmp_path_factory):
    """Two extracts of the same target with different prompts, each in several shards, and the
    first one's score results."""
    from scoring.fit import save_drafter

    tmp = tmp_path_factory.mktemp("mismatch")
    outs = []
    for name, offset in (("a", 0), ("b", 100)):
        records = [{"id": f"q{i}", "prompt": f"Item {i + offset}."} for i in range(6)]
        prompts = write_prompts(tmp / f"{name}.jsonl", records)
        ARGS[name] = ["--model", tiny_qwen3_dir, "--prompts", prompts, "--max-new-tokens", "12", "--layer-ids", "1,3"]
        ARGS[name] += ["--shard-bytes", "12000"]
        out = str(tmp / name)
        assert CliRunner().invoke(main, ["extract", *ARGS[name], "--out", out, "--quiet"]).exit_code == 0
        outs.append(out)
    ckpt = save_drafter(random_drafter(seed=1), str(tmp / "runs" / "step_1"))
    assert score(ckpt, outs[0], tmp / "reference")[0] == 0
    return tmp, outs, ckpt


def summary(results) -> str:
    return repr(pq.read_table(os.path.join(str(results), "runs_step_1", "summary.parquet")).to_pylist())


def summary_of_original(two_extracts, _tmp_path) -> str:
    return summary(two_extracts[0] / "reference")


def copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def score(ckpt: str, shards: str, out) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--quiet"])
    assert "Traceback" not in result.output and not isinstance(result.exception, (AttributeError, KeyError, TypeError))
    return result.exit_code, result.output


def error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    assert lines, output
    return lines[0]


def test_deleted_shard(two_extracts, tmp_path):
    _, (a, _), ckpt = two_extracts
    shards = copy(a, tmp_path / "a")
    os.remove(os.path.join(shards, "shards", "r000-00001.arrow"))
    code, output = score(ckpt, shards, tmp_path / "r")
    line = error_line(output)
    assert code == 1 and "r000-00001.arrow" in line and "manifest.json" in line and "missing" in line
    # as the message says: the same extract command writes those samples again
    redo = CliRunner().invoke(main, ["extract", *extract_args(shards), "--out", shards, "--quiet"])
    assert redo.exit_code == 0, redo.output
    assert score(ckpt, shards, tmp_path / "again")[0] == 0
    assert summary(tmp_path / "again") == summary_of_original(two_extracts, tmp_path)


def test_renamed_shard(two_extracts, tmp_path):
    _, (a, _), ckpt = two_extracts
    shards = copy(a, tmp_path / "a")
    os.rename(os.path.join(shards, "shards", "r000-00001.arrow"), os.path.join(shards, "shards", "r000-00009.arrow"))
    code, output = score(ckpt, shards, tmp_path / "r")
    line = error_line(output)
    assert code == 1 and "r000-00001.arrow" in line and "r000-00009.arrow" in line and "does not list" in line


def test_manifest_from_another_extract(two_extracts, tmp_path):
    _, (a, b), ckpt = two_extracts
    shards = copy(a, tmp_path / "a")
    shutil.copy(os.path.join(b, "manifest.json"), os.path.join(shards, "manifest.json"))
    code, output = score(ckpt, shards, tmp_path / "r")
    line = error_line(output)
    assert code == 1 and "manifest.json" in line and ".arrow" in line and "different extracts" in line


def test_shards_of_two_extracts_mixed(two_extracts, tmp_path):
    _, (a, b), ckpt = two_extracts
    shards = copy(a, tmp_path / "a")
    for suffix in (".arrow", ".json"):
        shutil.copy(
            os.path.join(b, "shards", f"r000-00000{suffix}"), os.path.join(shards, "shards", f"r000-00000{suffix}")
        )
    code, output = score(ckpt, shards, tmp_path / "r")
    line = error_line(output)
    assert code == 1 and "r000-00000.arrow" in line and "manifest.json" in line and "different extracts" in line


def test_drafter_config_and_weights_disagree(two_extracts, tmp_path):
    _, (a, _), ckpt = two_extracts
    broken = copy(ckpt, tmp_path / "runs" / "broken")
    config_path = os.path.join(broken, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["num_hidden_layers"] = 3  # the weights hold two layers
    with open(config_path, "w") as f:
        json.dump(config, f)
    code, output = score(broken, a, tmp_path / "r")
    line = error_line(output)
    assert code == 1 and "config.json" in line and "model.safetensors" in line and "layers.2" in line


def test_compare_results_of_different_shards(two_extracts, tmp_path):
    _, (a, b), ckpt = two_extracts
    assert score(ckpt, a, tmp_path / "ra")[0] == 0 and score(ckpt, b, tmp_path / "rb")[0] == 0
    result = CliRunner().invoke(
        main, ["compare", str(tmp_path / "ra" / "runs_step_1"), str(tmp_path / "rb" / "runs_step_1")]
    )
    line = error_line(result.output)
    assert result.exit_code == 2 and "ra" in line and "rb" in line and "different shards" in line
