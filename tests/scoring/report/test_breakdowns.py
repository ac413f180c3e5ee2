"""Issue 37 item 8 in the report: per-position acceptance with its 95% Wilson interval and anchor
count, and the chain's tau and streak by context length and inside / after the thinking, each
checked against the parquet files the page is made from, independently of the report's code."""

from __future__ import annotations

import re

import polars as pl
import pytest
from click.testing import CliRunner

from scoring import breakdowns
from scoring.results import ALL_DATASETS, FILES
from specreplay.cli import main
from tests.scoring.report.test_page import CHECKPOINTS, position_rows, write_results

LONG_CONTEXT = 600  # added to the anchors of some samples: they fall in the 512-1k bucket


def _shift(directory, name: str, samples: set[str]) -> None:
    """Move the anchors (and walk steps) of `samples` LONG_CONTEXT tokens further into the context."""
    path = directory / FILES[name]
    frame = pl.read_parquet(path)
    moved = pl.when(pl.col("sample_id").is_in(list(samples))).then(pl.col("anchor") + LONG_CONTEXT)
    frame.with_columns(anchor=moved.otherwise(pl.col("anchor"))).write_parquet(path)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """Two checkpoints; the anchors of gsm8k-3..5 sit past 512 tokens of context."""
    root = tmp_path_factory.mktemp("breakdowns")
    for seed, (name, step, p) in enumerate(CHECKPOINTS[1:]):
        directory = root / "results" / f"run_step_{step}"
        write_results(directory, name, step, p, seed)
        for kind in ("anchors", "walk"):
            _shift(directory, kind, {"gsm8k-3", "gsm8k-4", "gsm8k-5"})
    return root


def _render(root, monkeypatch, spans: pl.DataFrame | None = None) -> str:
    if spans is not None:  # a reasoning model's shards: a tokenizer with <think> and these spans
        monkeypatch.setattr(breakdowns, "think_ids", lambda uri: (7, 8))
        monkeypatch.setattr(breakdowns, "thinking_spans", lambda uri, ids: spans)
    out = root / "report.html"
    result = CliRunner().invoke(main, ["report", str(root / "results"), "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out.read_text(encoding="utf-8")


def _group_rows(text: str, heading: str) -> dict[tuple[str, str], list[str]]:
    """(checkpoint, group) -> [steps, tau, anchors, streak] of the table under `heading`."""
    table = text.split(f"<h3>{heading}", 1)[1].split("</table>", 1)[0]
    found, label = {}, None
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table.split("<tbody>", 1)[1]):
        cells = _cells(row)
        if 'rowspan="' in row:
            label, cells = cells[0], cells[1:]
        found[(label, cells[0])] = cells[1:]
    return found


def _cells(row: str) -> list[str]:
    return [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]


def _expected(frame: pl.DataFrame, key: pl.Expr, value: str) -> dict[str, tuple[int, float]]:
    stats = frame.with_columns(key=key).group_by("key").agg(pl.len(), pl.col(value).mean())
    return {k: (n, mean) for k, n, mean in stats.rows()}


def test_context_length_groups_agree_with_the_files(page, monkeypatch):
    rows = _group_rows(_render(page, monkeypatch), "By context length")
    bucket = pl.when(pl.col("anchor") >= 512).then(pl.lit("512-1k")).otherwise(pl.lit("0-512"))
    for name, step, _ in CHECKPOINTS[1:]:
        directory = page / "results" / f"run_step_{step}"
        steps = _expected(pl.read_parquet(directory / FILES["walk"]), bucket, "produced")
        anchors = _expected(pl.read_parquet(directory / FILES["anchors"]), bucket, "accepted_len")
        for group in ("0-512", "512-1k"):
            (n_steps, tau), (n_anchors, streak) = steps[group], anchors[group]
            assert rows[(name, group)] == [str(n_steps), f"{tau:.3f}", str(n_anchors), f"{streak:.3f}"]


def test_thinking_and_answer_groups_agree_with_the_spans(page, monkeypatch):
    # each response thinks over its first 10 tokens (anchor offsets 30..39 hold the drafted t + 1)
    ids = pl.read_parquet(page / "results" / "run_step_300" / FILES["samples"]).select("dataset", "sample_id")
    spans = ids.unique().with_columns(start=pl.lit(30, pl.Int64), end=pl.lit(39, pl.Int64))
    spans = spans.with_columns(  # the shifted samples' spans move with them
        pl.when(pl.col("sample_id").is_in(["gsm8k-3", "gsm8k-4", "gsm8k-5"]))
        .then(pl.col(c) + LONG_CONTEXT)
        .otherwise(pl.col(c))
        .alias(c)
        for c in ("start", "end")
    )
    rows = _group_rows(_render(page, monkeypatch, spans), "Inside the thinking")
    directory = page / "results" / "run_step_300"
    joined = pl.read_parquet(directory / FILES["anchors"]).join(spans, on=["dataset", "sample_id"])
    inside = ((pl.col("anchor") + 1 >= pl.col("start")) & (pl.col("anchor") + 1 <= pl.col("end"))).replace_strict(
        {True: "thinking", False: "answer"}
    )
    anchors = _expected(joined, inside, "accepted_len")
    for group in ("thinking", "answer"):
        n_anchors, streak = anchors[group]
        assert rows[("run/step_300", group)][2:] == [str(n_anchors), f"{streak:.3f}"]


def test_positions_show_rate_wilson_interval_and_anchors(page, monkeypatch):
    text = _render(page, monkeypatch)
    rates, intervals = dict(position_rows(text, "rate")), dict(position_rows(text, "interval"))
    for name, step, _ in CHECKPOINTS[1:]:
        summary = pl.read_parquet(page / "results" / f"run_step_{step}" / FILES["summary"])
        chain = summary.filter((pl.col("dataset") == ALL_DATASETS) & (pl.col("method") == "chain")).row(0, named=True)
        shown = [r for r in chain["accept_rate_by_position"] if r == r]  # reached positions (not NaN)
        assert _cells(rates[name])[: len(shown)] == [f"{100 * r:.0f}" for r in shown]
        lows, highs = chain["accept_rate_low_by_position"], chain["accept_rate_high_by_position"]
        assert (
            _cells(intervals[name])[: len(shown)]
            == [f"{100 * lo:.0f}–{100 * hi:.0f}" for lo, hi in zip(lows, highs)][: len(shown)]
        )
    assert "95% Wilson" in text
