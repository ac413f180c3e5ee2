"""Several checkpoints in one `score` call (scoring/score/passes.py): each sample is decoded once
per pass and replayed through every drafter of the pass, and every checkpoint's results are
byte for byte those of scoring it alone; failures, skips, memory-budget passes and torchrun
behave per checkpoint as they do alone."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import polars as pl
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.common import timing
from pipeline.shards import ShardSet
from proposers.checkpoints.files import CheckpointError
from scoring.config import ScoreConfig
from scoring.fit import save_drafter
from scoring.replay.packing import prepare_target_head
from scoring.score.passes import weight_bytes
from scoring.score.run import run_score, score_checkpoint
from tests.helpers.drafters import random_drafter
from tests.helpers.processes import REPO
from tests.helpers.shards import tiny_shards

BUDGETS = [4, 8]


class StageLog:
    """A pipeline.common.timing recorder that keeps every stage entered, with its facts."""

    def __init__(self):
        self.entered = []

    def start(self, name: str, info: dict) -> None:
        self.entered.append((name, info))

    def stop(self, name: str, info: dict, seconds: float) -> None:
        pass

    def passes(self) -> list[dict]:
        return [info for name, info in self.entered if name == "shard pass"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_qwen3_dir):
    """Real shards of a tiny target (5 greedy responses, some ending at a stop token) and four
    random drafters, runs/step_1 .. runs/step_4."""
    tmp = tmp_path_factory.mktemp("score_many")
    records = [{"id": f"q{i}", "prompt": f"Question {i}: what is {i} + {i}?"} for i in range(5)]
    shards = tiny_shards(tmp, tiny_qwen3_dir, records, max_new_tokens=24)
    ckpts = [
        save_drafter(random_drafter(layer_ids=(1, 3), seed=seed), str(tmp / "runs" / f"step_{seed}"))
        for seed in range(1, 5)
    ]
    return tmp, shards, ckpts


def _config(shards: str, ckpts: list[str], out, **options) -> ScoreConfig:
    return ScoreConfig(ckpts=list(ckpts), shards=shards, out=str(out), tree_nodes=BUDGETS, **options)


def _score(shards: str, ckpts: list[str], out, **options) -> tuple[list, list[dict]]:
    """run_score over `ckpts` in one call: (outcomes as reported by on_outcome, its shard passes)."""
    reported, log = [], StageLog()
    with timing.recording(log):
        outcomes = run_score(_config(shards, ckpts, out, **options), on_outcome=reported.append)
    assert [o.ckpt for o in reported] == [o.ckpt for o in outcomes]
    return outcomes, log.passes()


def _alone(shards: str, ckpts: list[str], out, **options) -> list[dict]:
    """Each checkpoint scored by its own run_score call; the shard passes of all the calls."""
    passes = []
    for ckpt in ckpts:
        [outcome], found = _score(shards, [ckpt], out, **options)
        assert outcome.status == "scored", outcome.error
        passes += found
    return passes


def _contents(directory: str) -> dict:
    """Every results file: parquet tables as bytes, run.json without its timing."""
    found = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            found[name] = f.read()
    record = json.loads(found.pop("run.json"))
    record.pop("wall_time_s")
    return {**found, "run.json": record}


def _same_results(one, alone, names: list[str]) -> None:
    for name in names:
        a, b = _contents(os.path.join(one, name)), _contents(os.path.join(alone, name))
        assert a.keys() == b.keys() and {"anchors.parquet", "walk.parquet", "summary.parquet"} <= a.keys(), name
        for file in a:
            assert a[file] == b[file], (name, file)


NAMES = [f"runs_step_{i}" for i in range(1, 5)]


@pytest.mark.parametrize("anchors", ["all", "walk"])
def test_one_call_equals_separate_calls_and_decodes_once(setup, tmp_path, monkeypatch, anchors):
    tmp, shards, ckpts = setup
    separate = _alone(shards, ckpts, tmp_path / "alone", anchors=anchors)
    assert [p["checkpoints"] for p in separate] == [1, 1, 1, 1]  # four calls: four decodings

    real, calls = ShardSet.samples, []  # the product's stage event, checked against the reader itself

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("keep"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ShardSet, "samples", counted)
    outcomes, passes = _score(shards, ckpts, tmp_path / "one", anchors=anchors)
    assert [o.status for o in outcomes] == ["scored"] * 4
    assert passes == [{"samples": 5, "checkpoints": 4}] and len(calls) == 1
    _same_results(tmp_path / "one", tmp_path / "alone", NAMES)


def test_small_memory_budget_splits_the_checkpoints_into_two_passes(setup, tmp_path):
    tmp, shards, ckpts = setup
    budget = 2 * weight_bytes(ckpts[0], torch.float32)  # two of the four drafters' weights
    _alone(shards, ckpts, tmp_path / "alone", memory_bytes=budget)
    descs = []

    class Bar:  # the CLI's progress interface (specreplay/progress.py), kept in a list
        def __init__(self, total: int, desc: str):
            descs.append((total, desc))

        def update(self, n: int = 1, **postfix) -> None:
            pass

        def close(self) -> None:
            pass

    log = StageLog()
    with timing.recording(log):
        outcomes = run_score(_config(shards, ckpts, tmp_path / "one", memory_bytes=budget), progress=Bar)
    assert [o.status for o in outcomes] == ["scored"] * 4
    assert [p["checkpoints"] for p in log.passes()] == [2, 2]
    assert descs == [(5, "score runs/step_1 + 1 more"), (5, "score runs/step_3 + 1 more")]
    _same_results(tmp_path / "one", tmp_path / "alone", NAMES)


def _copy(source: str, target) -> str:
    shutil.copytree(source, target)
    return str(target)


def _broken_checkpoints(ckpts: list[str], runs) -> dict[str, str]:
    """Beside copies of step_1 and step_2: weights cut short (a checkpoint still being written),
    logits that overflow on every sample, and feature layers the shards do not store."""
    truncated = _copy(ckpts[0], runs / "truncated")
    weights = os.path.join(truncated, "model.safetensors")
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[: len(data) // 2])
    overflow = _copy(ckpts[1], runs / "overflow")
    tensors = load_file(os.path.join(overflow, "model.safetensors"))
    tensors["fc.weight"][0] = torch.finfo(torch.float32).max  # any non-zero feature overflows
    save_file(tensors, os.path.join(overflow, "model.safetensors"))
    incompatible = _copy(ckpts[0], runs / "incompatible")
    config = json.load(open(os.path.join(incompatible, "config.json")))
    config["dflash_config"]["target_layer_ids"] = [1, 4]
    json.dump(config, open(os.path.join(incompatible, "config.json"), "w"))
    return {"truncated": truncated, "overflow": overflow, "incompatible": incompatible}


def test_failing_checkpoints_fail_alone_in_a_shared_pass(setup, tmp_path):
    tmp, shards, ckpts = setup
    good = [_copy(c, tmp_path / "runs" / os.path.basename(c)) for c in ckpts[:2]]
    broken = _broken_checkpoints(ckpts, tmp_path / "runs")
    order = [broken["truncated"], good[0], broken["overflow"], broken["incompatible"], good[1]]
    _alone(shards, good, tmp_path / "alone")
    outcomes, passes = _score(shards, order, tmp_path / "one")
    assert [o.status for o in outcomes] == ["failed", "scored", "failed", "failed", "scored"]
    errors = {o.ckpt: o.error for o in outcomes if o.status == "failed"}
    assert "model.safetensors" in errors[broken["truncated"]]
    assert errors[broken["overflow"]].startswith("no sample left to score: 5 samples excluded")
    assert "target_layer_ids [1, 4]" in errors[broken["incompatible"]]
    # the overflowing drafter was replayed beside the good ones; the others never loaded
    assert passes == [{"samples": 5, "checkpoints": 3}]
    assert sorted(os.listdir(tmp_path / "one")) == ["runs_step_1", "runs_step_2"]
    _same_results(tmp_path / "one", tmp_path / "alone", ["runs_step_1", "runs_step_2"])
    # every checkpoint of a pass failing: no results directory, lock or empty --out left behind
    outcomes, _ = _score(shards, [broken["overflow"], broken["truncated"]], tmp_path / "none")
    assert [o.status for o in outcomes] == ["failed", "failed"] and not (tmp_path / "none").exists()


def test_already_scored_checkpoint_is_skipped_while_the_others_are_scored(setup, tmp_path):
    tmp, shards, ckpts = setup
    _alone(shards, ckpts, tmp_path / "alone")
    [first], _ = _score(shards, [ckpts[1]], tmp_path / "one")
    before = _contents(first.out_dir)
    outcomes, passes = _score(shards, ckpts, tmp_path / "one")
    assert [o.status for o in outcomes] == ["scored", "skipped", "scored", "scored"]
    assert outcomes[1].out_dir == first.out_dir and _contents(first.out_dir) == before  # left as it was
    assert passes == [{"samples": 5, "checkpoints": 3}]
    _same_results(tmp_path / "one", tmp_path / "alone", NAMES)
    assert not [p for p in os.listdir(tmp_path / "one") if p.startswith(".")]  # no lock or staging left


def test_score_checkpoint_alone_is_a_pass_of_one_and_raises_what_failed(setup, tmp_path):
    """The single-checkpoint entry (watch, diagnose) scores like run_score and raises errors."""
    tmp, shards, ckpts = setup
    shardset = ShardSet(shards)
    head = prepare_target_head(shardset.target_head(), "cpu", torch.float32)  # as run_score on CPU
    config = _config(shards, ckpts[:1], tmp_path / "alone")
    outcome = score_checkpoint(ckpts[0], shardset, head, str(tmp_path / "alone" / "runs_step_1"), config)
    assert outcome.status == "scored"
    _score(shards, ckpts[:1], tmp_path / "cli")
    _same_results(tmp_path / "alone", tmp_path / "cli", NAMES[:1])
    broken = _broken_checkpoints(ckpts, tmp_path / "runs")["truncated"]
    with pytest.raises(CheckpointError, match="model.safetensors"):
        score_checkpoint(broken, shardset, head, str(tmp_path / "alone" / "runs_truncated"), config)
    assert not os.path.exists(tmp_path / "alone" / ".runs_truncated.lock")


@pytest.mark.slow
def test_torchrun_two_ranks_score_several_checkpoints_like_one_process(setup, tmp_path):
    """Two ranks, two passes (a budget of one drafter each) and a failing checkpoint between
    them: the same results as one process, the failure reported once."""
    tmp, shards, ckpts = setup
    broken = _broken_checkpoints(ckpts, tmp_path / "runs")["truncated"]
    order = [ckpts[0], broken, ckpts[1]]
    budget = weight_bytes(ckpts[0], torch.float32)
    _alone(shards, [ckpts[0], ckpts[1]], tmp_path / "alone", memory_bytes=budget)
    command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node", "2"]
    command += ["-m", "specreplay", "score", "--shards", shards, "--out", str(tmp_path / "two"), "--quiet"]
    command += ["--ddtree-budgets", ",".join(map(str, BUDGETS)), "--memory-budget", str(budget)]
    for ckpt in order:
        command += ["--ckpt", ckpt]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and broken in errors[0], run.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "two")) == ["runs_step_1", "runs_step_2"]
    for name in ("runs_step_1", "runs_step_2"):
        one, two = _contents(os.path.join(tmp_path / "alone", name)), _contents(os.path.join(tmp_path / "two", name))
        assert two["run.json"]["world_size"] == 2
        for kind in ("anchors", "walk", "samples", "summary"):  # rank 0 merges: same rows, same values
            a = pl.read_parquet(io.BytesIO(one[f"{kind}.parquet"]))
            b = pl.read_parquet(io.BytesIO(two[f"{kind}.parquet"]))
            assert a.equals(b, null_equal=True), (name, kind)
