"""The all-anchor streak of two results: each side's anchors.parquet, summed per paired sample,
for compare's second interval (the streak is what a training metric would show)."""

from __future__ import annotations

import os
import warnings

import polars as pl

from scoring import results
from scoring.compare.inputs import KEYS, CompareError, Side, StreakWarning
from scoring.methods.registry import accepted_column


def load_anchors(side: Side, methods: list[str]) -> pl.DataFrame | None:
    """(dataset, sample_id, anchor, the methods' accepted-length columns present) of a side's
    anchors.parquet; None when the file is absent."""
    path = os.path.join(side.path, results.FILES["anchors"])
    if not os.path.isfile(path):
        return None
    try:
        schema = pl.read_parquet_schema(path)
        missing = [c for c in (*KEYS, "anchor") if c not in schema]
        if missing:
            raise CompareError(
                f"{side.label}: {path} lacks column(s) {missing}; rescore that checkpoint with `specreplay score --force`"
            )
        # named by the greedy column whatever the shards, so both sides line up method by method
        sampled = results.is_sampled(side.record)
        columns = {accepted_column(m): accepted_column(m, sampled) for m in methods}
        wanted = [pl.col(source).alias(name) for name, source in columns.items() if source in schema]
        return pl.scan_parquet(path).select(*KEYS, "anchor", *wanted).collect()
    except CompareError:
        raise
    except Exception as error:  # noqa: BLE001 - polars raises several types for a bad file
        raise CompareError(
            f"{side.label}: cannot read {path} ({error}); rescore that checkpoint with `specreplay score --force`"
        ) from error


def streak_sums(
    anchors_a: pl.DataFrame, anchors_b: pl.DataFrame, pairs: pl.DataFrame, methods: list[str]
) -> tuple[pl.DataFrame, list[str], dict[str, tuple[int, int, int]]]:
    """Per paired sample and method over the anchors both runs scored (non-null in both):
    (dataset, sample_id, method, sum_a, sum_b, anchors). Also the methods whose column a side
    lacks, and per method (anchors of A, of B, common) on the paired samples."""
    anchors_a = anchors_a.join(pairs, on=KEYS, how="semi")
    anchors_b = anchors_b.join(pairs, on=KEYS, how="semi")
    frames, lacking, tally = [], [], {}
    for method in methods:
        column = accepted_column(method)
        if column not in anchors_a.columns or column not in anchors_b.columns:
            lacking.append(method)
            continue
        a = anchors_a.select(*KEYS, "anchor", x_a=pl.col(column).cast(pl.Float64)).drop_nulls("x_a")
        b = anchors_b.select(*KEYS, "anchor", x_b=pl.col(column).cast(pl.Float64)).drop_nulls("x_b")
        common = a.join(b, on=[*KEYS, "anchor"], how="inner")
        tally[method] = (a.height, b.height, common.height)
        frames.append(
            common.group_by(KEYS)
            .agg(sum_a=pl.col("x_a").sum(), sum_b=pl.col("x_b").sum(), anchors=pl.len().cast(pl.Int64))
            .with_columns(method=pl.lit(method))
        )
    schema = {"dataset": pl.String, "sample_id": pl.String, "sum_a": pl.Float64, "sum_b": pl.Float64}
    empty = pl.DataFrame(schema={**schema, "anchors": pl.Int64, "method": pl.String})
    sums = pl.concat([f.cast({**schema, "anchors": pl.Int64}) for f in frames]) if frames else empty
    return sums.sort(["method", *KEYS]), lacking, tally


def streak_inputs(a: Side, b: Side, pairs: pl.DataFrame, methods: list[str]) -> tuple[pl.DataFrame | None, str]:
    """(streak_sums for the pairs, '') or (None, why) with a warning when the streak cannot be compared."""
    anchors_a, anchors_b = load_anchors(a, methods), load_anchors(b, methods)
    absent = [os.path.join(s.path, results.FILES["anchors"]) for s, f in ((a, anchors_a), (b, anchors_b)) if f is None]
    if absent:
        why = f"{' and '.join(absent)} not found"
        warnings.warn(
            f"the all-anchor streak is not compared: {why} (rescore with `specreplay score --force` to "
            f"write it); tau is compared",
            StreakWarning,
            stacklevel=3,
        )
        return None, why
    sums, lacking, tally = streak_sums(anchors_a, anchors_b, pairs, methods)
    if lacking:
        columns = [accepted_column(m) for m in lacking]
        warnings.warn(
            f"the all-anchor streak of {lacking} is not compared: anchors.parquet of A or B lacks {columns} "
            f"(scored with other --ddtree-budgets; rescore both with the same budgets)",
            StreakWarning,
            stacklevel=3,
        )
    partial = {m: t for m, t in tally.items() if t[2] < max(t[0], t[1])}
    if partial:
        method, (n_a, n_b, common) = next(iter(partial.items()))
        warnings.warn(
            f"the all-anchor streak is compared on the anchors both runs scored only ({method}: {common} "
            f"common of {n_a} in A's and {n_b} in B's anchors.parquet on the paired samples; a run scored "
            f"with `--anchors walk` holds the walk-visited anchors only), so it differs from summary.parquet's "
            f"`anchor_accepted_len_mean`; rescore with `--anchors all` for the full streak",
            StreakWarning,
            stacklevel=3,
        )
    return sums, ""
