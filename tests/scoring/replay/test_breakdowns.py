"""Acceptance by context length (scoring/breakdowns.py): the chain's walk steps and every anchor
bucketed by the anchor's absolute position, on results written through the declared schemas."""

from __future__ import annotations

import pytest

from scoring import results
from scoring.breakdowns import by_context
from scoring.score.console import context_lines
from tests.helpers.fake_results import write_fake_results

IDENTITY = {"checkpoint": "c", "checkpoint_hash": "h", "checkpoint_step": 1}
# (anchor position, tokens the walk step produced, the anchor's accepted drafts): both sides of
# each bucket edge (511 | 512, 1023 | 1024) and a bucket far off
ROWS = [(100, 1, 0), (511, 2, 1), (512, 3, 2), (1023, 4, 3), (1024, 5, 4), (5000, 6, 5)]


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("breakdowns")
    walk = [
        {"dataset": "a", "sample_id": "s", "method": "chain", "anchor": t, "produced": p, "step": i}
        for i, (t, p, _) in enumerate(ROWS)
    ]
    walk += [{"dataset": "a", "sample_id": "s", "method": "ddtree-8", "anchor": 100, "produced": 9, "step": 0}]
    walk += [{"dataset": "b", "sample_id": "r", "method": "chain", "anchor": 40, "produced": 7, "step": 0}]
    write_fake_results(directory, IDENTITY, samples=[], summary=[], walk=walk)
    anchors = [{"dataset": "a", "sample_id": "s", "anchor": t, "accepted_len": a} for t, _, a in ROWS]
    anchors += [{"dataset": "b", "sample_id": "r", "anchor": 40, "accepted_len": 3}]
    rows = [{**IDENTITY, **row} for row in anchors]
    results.write_table(results.rows_table(rows, results.anchors_schema({})), str(directory), "anchors")
    return str(directory)


def test_steps_and_anchors_fall_in_the_bucket_their_position_names(scored):
    """[0, 512), [512, 1024), [1024, 2048), ... : a tree method's steps and other datasets left out
    when one is asked for."""
    buckets = by_context(scored, "a")
    assert [b.label for b in buckets] == ["0-512", "512-1k", "1k-2k", "4k-8k"]
    assert [(b.steps, b.tau) for b in buckets] == [(2, 1.5), (2, 3.5), (1, 5.0), (1, 6.0)]
    assert [(b.anchors, b.streak) for b in buckets] == [(2, 0.5), (2, 2.5), (1, 4.0), (1, 5.0)]
    pooled = by_context(scored)  # every dataset: b's step at 40 joins the first bucket
    assert (pooled[0].steps, pooled[0].tau, pooled[0].anchors) == (3, (1 + 2 + 7) / 3, 3)
    assert "512-1k: tau 3.50 (2 steps), streak 2.50 (2 anchors)" in context_lines(scored)[1]


# --------------------------------------------------------------------------- thinking and answer

THINK, UNTHINK = 400, 401  # added to the tiny tokenizer as <think>, </think>


@pytest.fixture(scope="module")
def thinking(tmp_path_factory) -> tuple[str, dict]:
    """A tiny target whose stored tokenizer knows <think> / </think>, teacher-forced responses:
    one thinking for 9 tokens then answering, one cut inside its thinking, one that never thinks;
    scored with an n-gram baseline (no drafter to fit: the split is what is tested)."""
    from transformers import AutoTokenizer

    from scoring.config import ScoreConfig
    from scoring.score.run import run_score
    from tests.helpers.models import build_tiny_qwen3
    from tests.helpers.shards import tiny_shards

    tmp = tmp_path_factory.mktemp("thinking")
    model_dir = build_tiny_qwen3(tmp / "target")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [THINK, UNTHINK]
    tokenizer.save_pretrained(model_dir)
    loop = [10, 11, 12, 13]
    responses = {
        "thinks": [THINK, *loop, *loop, UNTHINK, *loop * 3],  # thinking: its first 10 tokens
        "cut": [THINK, *loop * 4],  # every token thinking
        "plain": [*loop * 4],  # none
    }
    records = [{"id": rid, "prompt": "Count.", "response": ids} for rid, ids in responses.items()]
    shards = tiny_shards(tmp, model_dir, records, max_new_tokens=16)
    config = ScoreConfig(ckpts=["ngram:vllm:k=4"], shards=shards, out=str(tmp / "results"), tree_nodes=[])
    [outcome] = run_score(config)
    assert outcome.error is None, outcome.error
    return outcome.out_dir, {"thinks": 10, "cut": len(responses["cut"]), "plain": 0}


def test_steps_and_anchors_are_split_at_the_end_of_the_thinking(thinking):
    """A step or anchor at t drafts from t + 1: thinking when t + 1 lies in the response's first
    `thinking` tokens (</think> included), else the answer."""
    import polars as pl

    from scoring.breakdowns import by_segment

    directory, thinking_tokens = thinking
    samples = pl.read_parquet(f"{directory}/samples.parquet").filter(pl.col("method") == "chain")
    prompt = dict(zip(samples["sample_id"], samples["prompt_len"]))

    def expected(name: str, value: str) -> tuple[int, float]:
        frame = pl.read_parquet(f"{directory}/{name}.parquet")
        if "method" in frame.columns:
            frame = frame.filter(pl.col("method") == "chain")
        inside = [
            row["anchor"] + 1 - prompt[row["sample_id"]] < thinking_tokens[row["sample_id"]]
            for row in frame.iter_rows(named=True)
        ]
        mine = frame.filter(pl.Series(inside))
        return mine.height, mine[value].cast(pl.Float64).mean()

    found = {g.label: g for g in by_segment(directory)}
    assert set(found) == {"thinking", "answer"}
    steps, tau = expected("walk", "produced")
    anchors, streak = expected("anchors", "accepted_len")
    assert (found["thinking"].steps, found["thinking"].anchors) == (steps, anchors) and steps > 0
    assert found["thinking"].tau == pytest.approx(tau) and found["thinking"].streak == pytest.approx(streak)
    walk_steps = pl.read_parquet(f"{directory}/walk.parquet").filter(pl.col("method") == "chain").height
    assert found["thinking"].steps + found["answer"].steps == walk_steps


def test_a_template_that_opens_the_thinking_starts_it_at_the_response():
    from scoring.breakdowns import thinking_span

    ids = (THINK, UNTHINK)
    assert thinking_span([1, 2, THINK, 5, 6, UNTHINK, 7], 3, ids) == (3, 5)  # the prompt left it open
    assert thinking_span([1, THINK, UNTHINK, 5, 6, 7], 4, ids) is None  # closed in the prompt: no thinking
    assert thinking_span([1, 2, THINK, 6, 7], 2, ids) == (2, 4)  # opened by the response, never closed
