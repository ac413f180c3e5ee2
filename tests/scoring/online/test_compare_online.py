"""`specreplay compare-online` against an engine that answers as vLLM does with
--per-request-spec-decode-metrics detailed (its fields: tests/pipeline/engines/test_acceptance.py).
The fake engine answers each stored prompt with a response and per-step counts a test chooses,
so every verdict is reached on purpose: equal, differs (at which step, and why), not comparable.
The same command against a running llama-server is in tests/parity/test_engine_parity.py."""

from __future__ import annotations

import json

import polars as pl
import pytest
from click.testing import CliRunner

from pipeline.shards import ShardSet
from specreplay.cli import main
from tests.helpers.drafters import fitted_drafters
from tests.helpers.serving import FakeServer
from tests.helpers.shards import tiny_shards

MAX_NEW = 20


@pytest.fixture(scope="module")
def scored(tmp_path_factory, tiny_qwen3_dir):
    """(results scored under the vllm rule, under the dflash rule, the shards' samples by prompt)."""
    tmp = tmp_path_factory.mktemp("online")
    records = [{"id": f"q{i}", "prompt": f"Question {i}: what is {i} + {i}?"} for i in range(4)]
    shards = tiny_shards(tmp, tiny_qwen3_dir, records, max_new_tokens=MAX_NEW)
    ckpt = fitted_drafters(shards, tmp / "runs", block_size=4, layer_ids=[1, 3], steps=40, anchors_per_step=32)[-1]
    out = {}
    for rule in ("vllm", "dflash"):
        args = ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(tmp / rule), "--walk-rule", rule]
        assert CliRunner().invoke(main, [*args, "--ddtree-budgets", "", "--quiet"]).exit_code == 0
        out[rule] = str(tmp / rule / "runs_step_40")
    samples = {tuple(s.input_ids[: s.prompt_len].tolist()): s for s in ShardSet(shards).samples(tensors=[])}
    return out, samples


def vllm_engine(samples, walk: pl.DataFrame, change) -> FakeServer:
    """A vLLM-like server answering each stored prompt with its stored response and the walk's
    per-step counts, as `change(sample_id, tokens, accepted, drafted)` edits them."""

    def completion(raw: bytes):
        body = json.loads(raw)
        sample = samples[tuple(body["prompt"])]
        steps = walk.filter((pl.col("sample_id") == sample.sample_id) & (pl.col("drafted") > 0)).sort("step")
        tokens = sample.input_ids[sample.prompt_len :].tolist()
        accepted, drafted = steps["counted_accepted"].to_list(), steps["drafted"].to_list()
        tokens, accepted, drafted = change(sample.sample_id, tokens, accepted, drafted)
        spec = {"num_spec_steps": len(accepted), "num_accepted_draft_tokens": sum(accepted)}
        spec.update(num_draft_tokens=sum(drafted), per_step_accepted=accepted, per_step_drafted=drafted)
        choice = {"token_ids": tokens, "finish_reason": "length"}
        return 200, json.dumps({"choices": [choice], "metrics": {"speculative_decoding": spec}}).encode()

    models = {"data": [{"id": "tiny", "owned_by": "vllm"}]}
    routes = {
        ("GET", "/v1/models"): lambda _: (200, json.dumps(models).encode()),
        ("POST", "/v1/completions"): completion,
    }
    return FakeServer(routes)


def run(results_dir: str, server: FakeServer) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["compare-online", results_dir, "--server", server.url, "--json"])
    return result.exit_code, json.loads(result.output)


def walk_of(results_dir: str) -> pl.DataFrame:
    return pl.read_parquet(f"{results_dir}/walk.parquet").filter(pl.col("method") == "chain")


def test_equal_differs_and_not_comparable(scored):
    out, samples = scored
    walk = walk_of(out["vllm"])
    ids = sorted(walk["sample_id"].unique().to_list())

    def change(sample_id, tokens, accepted, drafted):
        if sample_id == ids[1]:  # one step accepted one draft fewer online
            accepted = [accepted[0] - 1 if accepted[0] else 1, *accepted[1:]]
        if sample_id == ids[2]:  # another response from the fourth token on
            tokens = tokens[:3] + [t + 1 for t in tokens[3:]]
        return tokens, accepted, drafted

    server = vllm_engine(samples, walk, change)
    try:
        code, report = run(out["vllm"], server)
    finally:
        server.close()
    verdicts = {row["sample_id"]: row for row in report["samples"]}
    assert code == 1 and report["engine"] == "vllm" and report["walk_rule"] == "vllm"
    assert [verdicts[i]["verdict"] for i in ids] == ["equal", "differs", "not comparable", "equal"]
    assert (
        verdicts[ids[1]]["first_difference"] == 0
        and "drafts differ from the first step" in verdicts[ids[1]]["points_at"]
    )
    assert verdicts[ids[2]]["response"] == "differs at 3" and "not the stored" in verdicts[ids[2]]["points_at"]
    assert report["equal"] == 2 and report["differs"] == 1 and report["not_comparable"] == 1


def test_results_under_another_walk_rule_point_at_it(scored):
    """The engine's counts are the vllm walk's; results scored under the reference rule differ
    where the tail block or the count differs, and the verdict names the rule to re-score with."""
    out, samples = scored
    server = vllm_engine(samples, walk_of(out["vllm"]), lambda _, *rest: rest)
    try:
        code, report = run(out["dflash"], server)
    finally:
        server.close()
    differing = [row for row in report["samples"] if row["verdict"] == "differs"]
    assert code == 1 and differing, report
    assert all("--walk-rule vllm" in row["points_at"] for row in differing)
