"""An import killed mid-way resumes to exactly the shards of an uninterrupted one: finished shards
untouched, no sample twice, every sample the same bits."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest
import torch

from pipeline.imports.config import ImportConfig
from pipeline.imports.run import run_import
from pipeline.shards import finished_shard_entries, read_manifest
from tests.helpers import captures as C
from tests.helpers.faults import assert_same_extract
from tests.helpers.processes import REPO, kill_after_first_shard, stopped_after_two_samples

NUM = 48
BEFORE = "1,3,5,6"


@pytest.fixture(scope="module")
def capture(tiny_qwen3_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("resume")
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    lens = {}
    for i in range(NUM):
        ids = [1, *range(30 + i % 9, 36 + i % 9), *[(5 * j + 3 * i) % 380 + 10 for j in range(40 + i % 17)]]
        state = C.states(model, ids, 7)
        C.write_vllm(root / "cap" / f"r{i:03d}.safetensors", state, [1, 3, 5, 6])
        lens[f"r{i:03d}"] = 7
    C.write_prompt_lens(root / "lens.jsonl", lens)
    return root


def args(capture, model_dir, out) -> list[str]:
    return [
        "import",
        str(capture / "cap"),
        "--format",
        "vllm",
        "--model",
        model_dir,
        "--out",
        str(out),
        "--captured-layer-ids",
        BEFORE,
        "--prompt-lens",
        str(capture / "lens.jsonl"),
        "--layer-ids",
        "0,4,5",
        "--shard-bytes",
        "1",  # one sample per shard: the kill lands between finished shards
        "--quiet",
    ]


def crcs(out) -> dict:
    return {entry["file"]: entry["crc32"] for entry in finished_shard_entries(str(out))}


@pytest.mark.slow
def test_interrupted_import_resumes_to_identical_shards(tiny_qwen3_dir, capture, tmp_path):
    reference = tmp_path / "reference"
    run_import(
        ImportConfig(
            source=str(capture / "cap"),
            format="vllm",
            model=tiny_qwen3_dir,
            out=str(reference),
            captured_layer_ids=BEFORE,
            prompt_lens=str(capture / "lens.jsonl"),
            layer_ids=[0, 4, 5],
            shard_bytes=1,
        )
    )
    out = tmp_path / "out"
    kill_after_first_shard([sys.executable, "-m", "specreplay", *args(capture, tiny_qwen3_dir, out)], out, REPO)
    assert not read_manifest(str(out))["complete"]
    before = crcs(out)
    assert 1 <= len(before) < NUM, "the kill must land mid-way"
    (out / "shards" / "r000-99998.arrow.tmp").write_bytes(b"half")  # what a crash can leave

    from click.testing import CliRunner

    from specreplay.cli import main

    result = CliRunner().invoke(main, args(capture, tiny_qwen3_dir, out))
    assert result.exit_code == 0, result.output
    assert f"{NUM} samples" in result.output and "next:" in result.output
    after = crcs(out)
    assert {name: after[name] for name in before} == before  # finished shards untouched
    assert not list((out / "shards").glob("*.tmp"))
    manifest = read_manifest(str(out))
    assert manifest["complete"] and manifest["totals"]["samples"] == NUM
    assert_same_extract(out, reference)  # every sample, same bits
    assert manifest["settings"] == read_manifest(str(reference))["settings"]


@pytest.mark.slow
def test_ctrl_c_keeps_the_samples_imported_so_far_however_short_the_chunk(tiny_qwen3_dir, capture, tmp_path):
    """One shard for all (the default --shard-bytes): the samples imported before Ctrl-C are
    buffered in a chunk, landed as a short shard at the stop, counted in the message; the rerun
    imports the others."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "specreplay", *args(capture, tiny_qwen3_dir, out)]
    command = [a for a in command if a != "--quiet"]
    at = command.index("--shard-bytes")
    del command[at : at + 2]
    code, stderr = stopped_after_two_samples(command, signal.SIGINT)
    assert code == 130, stderr
    said = re.search(r"; (\d+) of (\d+) samples kept in ", stderr)
    kept = sum(entry["rows"] for entry in finished_shard_entries(str(out)))
    assert said and int(said.group(1)) == kept >= 2 and int(said.group(2)) == NUM, stderr
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert read_manifest(str(out))["totals"]["samples"] == NUM
