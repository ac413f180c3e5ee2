"""Acceptance broken down by the anchor's context length (docs/breakdowns.md): drafters lose
acceptance as the context grows, and a pooled tau hides where. Buckets of the anchor's absolute
position (prompt and response tokens before it), each with its counts, so a thin bucket reads as
thin.

From a results directory: the chain's walk steps (walk.parquet: tau = mean `produced` of the
steps whose anchor falls in the bucket) and every anchor (anchors.parquet: streak = mean
`accepted_len`; on sampled shards `expected_accepted_len`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import polars as pl

from scoring import results
from scoring.methods.chain import CHAIN

# bucket edges in tokens: doubling from 512, the last bucket open
EDGES = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True)
class Bucket:
    low: int
    high: int | None  # None: open-ended
    steps: int
    tau: float | None
    anchors: int
    streak: float | None

    @property
    def label(self) -> str:
        return f"{short(self.low)}+" if self.high is None else f"{short(self.low)}-{short(self.high)}"


def short(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


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


def by_context(directory: str, dataset: str | None = None) -> list[Bucket]:
    """The chain's tau (walk) and streak (every anchor) per context-length bucket that holds any."""
    walk = read(directory, "walk", ["dataset", "method", "anchor", "produced"], dataset)
    steps = {}
    if walk is not None:
        chain = walk.filter(pl.col("method") == CHAIN).with_columns(bucket=bucket_of(pl.col("anchor")))
        for row in chain.group_by("bucket").agg(pl.len().alias("n"), pl.col("produced").mean().alias("tau")).rows():
            steps[row[0]] = (row[1], row[2])
    anchors = read(directory, "anchors", ["dataset", "anchor", "accepted_len", "expected_accepted_len"], dataset)
    streaks = {}
    if anchors is not None:
        sampled = walk is None  # sampled shards have no walk: their streak is the expected one
        column = "expected_accepted_len" if sampled else "accepted_len"
        grouped = anchors.with_columns(bucket=bucket_of(pl.col("anchor"))).group_by("bucket")
        for row in grouped.agg(pl.len().alias("n"), pl.col(column).cast(pl.Float64).mean().alias("s")).rows():
            streaks[row[0]] = (row[1], row[2])
    return [
        Bucket(
            EDGES[i], EDGES[i + 1] if i + 1 < len(EDGES) else None, *steps.get(i, (0, None)), *streaks.get(i, (0, None))
        )
        for i in sorted(set(steps) | set(streaks))
    ]
