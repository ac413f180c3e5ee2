"""Acceptance broken down where drafters lose it (docs/breakdowns.md): by the anchor's context
length (acceptance falls as the context grows, and a pooled tau hides where) and, for a
reasoning model's responses, inside its thinking span against the answer after it. Each group
with its counts, so a thin group reads as thin.

From a results directory: the chain's walk steps (walk.parquet: tau = mean `produced` of the
steps in the group) and every anchor (anchors.parquet: streak = mean `accepted_len`; on sampled
shards, which have no walk, `expected_accepted_len`). A step or anchor at position t drafts the
tokens from t + 1: it is grouped by t (context length) or by where t + 1 lies (segment).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import polars as pl
import torch

from scoring import results
from scoring.methods.chain import CHAIN

# bucket edges in tokens: doubling from 512, the last bucket open
EDGES = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # Qwen3's, DeepSeek-R1's and most reasoning templates'


@dataclass(frozen=True)
class Group:
    label: str
    steps: int
    tau: float | None
    anchors: int
    streak: float | None


def short(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def bucket_label(i: int) -> str:
    return f"{short(EDGES[i])}+" if i + 1 == len(EDGES) else f"{short(EDGES[i])}-{short(EDGES[i + 1])}"


def bucket_of(position: pl.Expr) -> pl.Expr:
    """The index of the bucket holding `position` (EDGES[i] <= position < EDGES[i + 1])."""
    index = pl.lit(0)
    for i, edge in enumerate(EDGES[1:], start=1):
        index = pl.when(position >= edge).then(pl.lit(i)).otherwise(index)
    return index


def read(directory: str, name: str, columns: list[str], dataset: str | None) -> pl.DataFrame | None:
    path = os.path.join(directory, results.FILES[name])
    if not os.path.isfile(path):
        return None
    frame = pl.read_parquet(path, columns=columns)
    if dataset is not None and dataset != results.ALL_DATASETS:
        frame = frame.filter(pl.col("dataset") == dataset)
    return frame


@dataclass(frozen=True)
class Rows:
    """What the breakdowns group, read once per results directory: the chain's walk steps (None on
    sampled shards) and the anchors (None without anchors.parquet)."""

    steps: pl.DataFrame | None
    anchors: pl.DataFrame | None


def read_rows(directory: str, dataset: str | None = None) -> Rows:
    walk = read(directory, "walk", ["dataset", "sample_id", "method", "anchor", "produced"], dataset)
    columns = ["dataset", "sample_id", "anchor", "accepted_len", "expected_accepted_len"]
    steps = None if walk is None else walk.filter(pl.col("method") == CHAIN)
    return Rows(steps, read(directory, "anchors", columns, dataset))


def grouped(rows: Rows, key, spans: pl.DataFrame | None = None) -> list[tuple]:
    """(key, steps, tau, anchors, streak) of the walk's chain steps and the anchors grouped by `key`
    (an expression over `anchor`, and over `start` / `end` when `spans` are joined on)."""
    streak = "accepted_len" if rows.steps is not None else "expected_accepted_len"  # sampled: the expected one

    def by_key(frame: pl.DataFrame | None, value: str) -> dict:
        if frame is None:
            return {}
        if spans is not None:
            frame = frame.join(spans, on=["dataset", "sample_id"], how="left")
        stats = frame.with_columns(key=key()).group_by("key").agg(pl.len(), pl.col(value).cast(pl.Float64).mean())
        return {row[0]: (row[1], row[2]) for row in stats.rows()}

    steps, streaks = by_key(rows.steps, "produced"), by_key(rows.anchors, streak)
    return [(k, *steps.get(k, (0, None)), *streaks.get(k, (0, None))) for k in sorted(set(steps) | set(streaks))]


def by_context(directory: str, dataset: str | None = None, rows: Rows | None = None) -> list[Group]:
    """The chain's tau (walk) and streak (every anchor) per context-length bucket that holds any
    (`rows`: read_rows's, when the caller has them)."""
    found = grouped(rows or read_rows(directory, dataset), lambda: bucket_of(pl.col("anchor")))
    return [Group(bucket_label(k), *rest) for k, *rest in found]


# --------------------------------------------------------------------------- thinking and answer


@functools.lru_cache(maxsize=4)  # score prints every checkpoint of one shards: read them once
def think_ids(uri: str) -> tuple[int, int] | None:
    """The ids of <think> and </think> in the tokenizer the shards stored, or None without them."""
    from pipeline.shards import TOKENIZER_DIR

    directory = os.path.join(uri, TOKENIZER_DIR)
    if "://" in uri or not os.path.isdir(directory):
        return None
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(directory).get_vocab()
    ids = vocab.get(THINK_OPEN), vocab.get(THINK_CLOSE)
    return None if None in ids else ids


def thinking_span(tokens: torch.Tensor, prompt_len: int, ids: tuple[int, int]) -> tuple[int, int] | None:
    """(first, last) position of the response's thinking span, </think> included: from the
    response's start when the prompt leaves a <think> open (a template that opens it), else from
    the response's own <think>; to its </think>, else to the end (cut inside the thinking)."""
    opened, closed = ids
    tokens = torch.as_tensor(tokens)
    opens, closes = (tokens == opened).nonzero().flatten(), (tokens == closed).nonzero().flatten()
    last_open = int(opens[opens < prompt_len].max()) if (opens < prompt_len).any() else -1
    last_close = int(closes[closes < prompt_len].max()) if (closes < prompt_len).any() else -1
    if last_open > last_close:
        start = prompt_len
    elif (opens >= prompt_len).any():
        start = int(opens[opens >= prompt_len].min())
    else:
        return None
    after = closes[closes >= start]
    return start, int(after.min()) if after.numel() else len(tokens) - 1


@functools.lru_cache(maxsize=4)
def thinking_spans(uri: str, ids: tuple[int, int]) -> pl.DataFrame:
    """(dataset, sample_id, start, end) of every stored response with a thinking span."""
    from pipeline.shards import ShardSet

    rows = []
    for sample in ShardSet(uri).samples(tensors=[]):
        span = thinking_span(sample.input_ids, int(sample.prompt_len), ids)
        if span is not None:
            rows.append({"dataset": sample.dataset, "sample_id": sample.sample_id, "start": span[0], "end": span[1]})
    schema = {"dataset": pl.String, "sample_id": pl.String, "start": pl.Int64, "end": pl.Int64}
    return pl.DataFrame(rows, schema=schema)


def by_segment(directory: str, dataset: str | None = None, rows: Rows | None = None) -> list[Group] | None:
    """The chain's tau and streak inside the thinking spans and in the answers (None: the shards'
    tokenizer has no <think> / </think>, or no response thinks)."""
    record = results.read_run_record(directory) or {}
    uri = (record.get("shards") or {}).get("uri")
    ids = think_ids(uri) if uri else None
    spans = thinking_spans(uri, ids) if ids else None
    if spans is None or spans.height == 0:
        return None
    position = pl.col("anchor") + 1  # the first token the step drafts

    def inside():
        thinking = pl.col("start").is_not_null() & (position >= pl.col("start")) & (position <= pl.col("end"))
        return pl.when(thinking).then(pl.lit("thinking")).otherwise(pl.lit("answer"))

    found = {k: rest for k, *rest in grouped(rows or read_rows(directory, dataset), inside, spans)}
    return [Group(label, *found[label]) for label in ("thinking", "answer") if label in found]
