"""Resume after a kill, and torchrun with 2 ranks: both end with exactly the samples of one
uninterrupted single-process run (ids, tokens, tensors), none duplicated, none rewritten."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.extract.inspect import inspect_extract
from pipeline.extract.run import ExtractConfig, run_extract
from pipeline.shards import ShardSet, finished_shard_entries, read_manifest
from tests.helpers.processes import REPO, kill_after_first_shard
from tests.helpers.prompts import write_prompts

NUM_PROMPTS = 24
MAX_NEW = 10
LAYERS = "0,2,5"
WORDS = "ducks eggs breakfast reason step answer numbers threshold travel blog Hawaii quick brown fox".split()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    records = [{"id": f"q{i:02d}", "prompt": " ".join(WORDS[i % 7 : i % 7 + 2 + i % 5])} for i in range(NUM_PROMPTS)]
    return write_prompts(tmp_path_factory.mktemp("resume") / "many.jsonl", records)


@pytest.fixture(scope="module")
def reference(tiny_qwen3_dir, prompts_file, tmp_path_factory):
    """One uninterrupted single-process run."""
    out = tmp_path_factory.mktemp("reference") / "out"
    run_extract(
        ExtractConfig(
            model=tiny_qwen3_dir,
            prompts=prompts_file,
            out=str(out),
            max_new_tokens=MAX_NEW,
            layer_ids=[0, 2, 5],
            batch_size=2,
            quiet=True,
        )
    )
    return by_id(out)


def by_id(out) -> dict:
    samples = {}
    for sample in ShardSet(str(out)).samples():
        assert sample.sample_id not in samples, f"{sample.sample_id} stored twice"
        samples[sample.sample_id] = sample
    return samples


def assert_same_samples(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for sample_id, sample in want.items():
        other = got[sample_id]
        assert torch.equal(other.input_ids, sample.input_ids), sample_id
        assert (other.prompt_len, other.finish_reason, other.greedy) == (
            sample.prompt_len,
            sample.finish_reason,
            sample.greedy,
        )
        for name, tensor in sample.tensors.items():
            assert torch.equal(other.tensors[name], tensor), f"{sample_id}: {name}"


def cli_args(model_dir, prompts, out, *extra):
    return [
        "extract",
        "--model",
        model_dir,
        "--prompts",
        prompts,
        "--out",
        str(out),
        "--max-new-tokens",
        str(MAX_NEW),
        "--layer-ids",
        LAYERS,
        "--quiet",
        *extra,
    ]


def crcs(out) -> dict:
    return {entry["file"]: entry["crc32"] for entry in finished_shard_entries(str(out))}


@pytest.mark.slow
def test_resume_after_kill(tiny_qwen3_dir, prompts_file, reference, tmp_path):
    out = tmp_path / "out"
    # One sample per shard (--shard-bytes 1), so the kill lands between finished shards.
    command = [
        sys.executable,
        "-m",
        "specreplay",
        *cli_args(tiny_qwen3_dir, prompts_file, out, "--shard-bytes", "1", "--batch-size", "1"),
    ]
    kill_after_first_shard(command, out, REPO)

    manifest = read_manifest(str(out))
    assert not manifest["complete"]
    before = crcs(out)
    assert 1 <= len(before) < NUM_PROMPTS, "the kill must land mid-way"
    # What a crash can leave behind: a half-written shard and a sidecar without its shard.
    (out / "shards" / "r000-99998.arrow.tmp").write_bytes(b"half")
    (out / "shards" / "r000-99999.json").write_text("{}")
    with pytest.raises(Exception, match="has not finished"):
        ShardSet(str(out))
    report = inspect_extract(str(out))
    assert not report["complete"] and report["samples"] == len(before) and not report["checksums"]["bad"]
    tokenizer = {p.name: p.stat().st_mtime_ns for p in (out / "tokenizer").iterdir()}
    assert set(tokenizer) == set(manifest["tokenizer"]["files"])

    run_extract(
        ExtractConfig(
            model=tiny_qwen3_dir,
            prompts=prompts_file,
            out=str(out),
            max_new_tokens=MAX_NEW,
            layer_ids=[0, 2, 5],
            shard_bytes=1,
            batch_size=3,
            quiet=True,
        )
    )
    after = crcs(out)
    assert {name: after[name] for name in before} == before  # finished shards untouched
    assert not list((out / "shards").glob("*.tmp")) and not (out / "shards" / "r000-99999.json").exists()
    manifest = read_manifest(str(out))
    assert manifest["complete"] and manifest["totals"]["samples"] == NUM_PROMPTS
    assert [e["file"] for e in manifest["shards"]] == sorted(after)
    assert {p.name: p.stat().st_mtime_ns for p in (out / "tokenizer").iterdir()} == tokenizer  # kept, not rewritten
    assert_same_samples(by_id(out), reference)


@pytest.mark.slow
def test_torchrun_two_ranks_match_one(tiny_qwen3_dir, prompts_file, reference, tmp_path):
    out = tmp_path / "out"
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [
        str(torchrun),
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "specreplay",
        *cli_args(tiny_qwen3_dir, prompts_file, out, "--batch-size", "2", "--device", "cpu"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("specreplay inspect") == 1  # only rank 0 prints what to run next
    manifest = read_manifest(str(out))
    assert manifest["complete"] and manifest["run"]["world_size"] == 2
    assert {entry["rank"] for entry in manifest["shards"]} == {0, 1}
    assert manifest["totals"]["samples"] == NUM_PROMPTS
    assert sorted(p.name for p in (out / "tokenizer").iterdir()) == sorted(manifest["tokenizer"]["files"])
    assert_same_samples(by_id(out), reference)
