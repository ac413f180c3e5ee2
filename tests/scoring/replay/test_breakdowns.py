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
