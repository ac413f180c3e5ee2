"""`specreplay compare A B`: is checkpoint B better than checkpoint A, by how much, and is it real?

This module computes the comparison table and its headline. scoring/compare/inputs.py loads and
pairs the two results directories; scoring/compare/bootstrap.py holds the intervals and verdicts (and
defines them).

Definitions (A and B are two results directories written by `specreplay score`):

- Inputs. A directory that is not itself a results directory but holds results directories
  (`score --out` holds `<parent>_<name>/` per checkpoint) is resolved to the one it holds; when
  it holds several of the same checkpoint content (same `checkpoint_hash`, same shards) one is
  kept and a warning says which; several different checkpoints are an error listing them.
- Shards. A and B must have been scored on the same shards (equal `shards.identity` in
  run.json); different or uncheckable (run.json or the field missing) is a CompareError unless
  `allow_different_shards` (`--allow-different-shards`), which warns instead.
- Pairing. Samples are paired by (dataset, sample_id) and only when they hold the same tokens:
  equal `tokens_hash` (samples.parquet), or, when a side lacks it (results of older versions),
  equal `prompt_len`, `response_len` and `prompt_text` (with different shards, `prompt_len`
  and `response_len` must also be present). Samples in both runs whose tokens differ are left
  out and counted in `differing`; samples present in only one run in `unmatched`. A pair
  where either tau is null (no walk step) is dropped from the tau comparison and counted in
  `dropped_null`.
- tau. A sample's tau is its `tau` in samples.parquet: mean tokens produced per walk step
  (accepted draft tokens + the target's bonus token). `tau_a`, `tau_b`: mean over the n paired
  samples of per-sample tau (the README's tau restricted to the pairs). `delta` = tau_b - tau_a.
  `ci_low`, `ci_high`: the paired percentile bootstrap interval of delta over the n pairs
  (scoring/compare/bootstrap.py: paired_bootstrap).
- All-anchor streak (extra `streak_*` columns of the same rows; printed as a second table).
  From anchors.parquet, per paired sample and method: S = sum of the method's accepted length
  (`accepted_len` for the chain, `ddtree_N_accepted_len`, bonus-exclusive) and C = anchors,
  over the anchors both runs scored. `streak_a` = sum S_a / sum C over the paired samples (the
  summary's anchor-weighted `anchor_accepted_len_mean`, restricted to the pairs: with
  `--anchors all` results it equals the summary's pooled streak when every sample pairs),
  `streak_delta` = streak_b - streak_a, and the interval is the same bootstrap over resampled
  samples of sum(S_b - S_a) / sum(C) (paired_ratio_bootstrap). `streak_n` samples and
  `streak_anchors` anchors enter. When a side has no anchors.parquet the streak columns are
  null and a warning says so.
- Dataset `(all)` pools every pair of every dataset (as summary.parquet's `(all)` does).
- Verdict: as scoring/compare/bootstrap.py defines it (B or A is better when the whole interval lies
  above or below zero); n < 2 supports none. n < FEW_SAMPLES (20) gets a warning (the interval
  is unreliable there), and the report counts the intervals computed and how many would
  exclude zero by chance alone at this confidence.
- Headline: the pooled chain row (dataset `(all)`, method chain; else the first row kept by
  the filters) as one sentence, printed first.
- Same checkpoint: when A and B hold the same checkpoint content (`checkpoint_hash`) a warning
  says so (the difference is then expected to be zero).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from scoring.compare.bootstrap import (
    FEW_SAMPLES,
    chance_note,
    digits,
    paired_bootstrap,
    paired_ratio_bootstrap,
    verdict,
)
from scoring.compare.inputs import (
    CompareError,
    CompareWarning,
    DifferingSamplesWarning,
    Pairing,
    SameCheckpointWarning,
    ShardsDifferWarning,
    ShardsMatch,
    Side,
    StreakWarning,
    check_same_checkpoint,
    check_shards,
    load_side,
    pair_samples,
    select_requested,
)
from scoring.compare.streak import streak_inputs
from scoring.methods.chain import CHAIN
from scoring.results import ALL_DATASETS

# The public API: this module's comparison, and what its callers catch or print re-exported.
__all__ = [
    "OUTPUT_SCHEMA",
    "Comparison",
    "FewSamplesWarning",
    "compare_pairs",
    "compare_streak",
    "headline",
    "headline_row",
    "run_comparison",
    "FEW_SAMPLES",
    "CompareError",
    "CompareWarning",
    "DifferingSamplesWarning",
    "SameCheckpointWarning",
    "ShardsDifferWarning",
    "StreakWarning",
    "chance_note",
    "paired_bootstrap",
    "paired_ratio_bootstrap",
    "verdict",
]

OUTPUT_SCHEMA = {
    "dataset": pl.String,
    "method": pl.String,
    "n": pl.Int64,
    "tau_a": pl.Float64,
    "tau_b": pl.Float64,
    "delta": pl.Float64,
    "ci_low": pl.Float64,
    "ci_high": pl.Float64,
    "verdict": pl.String,
    "dropped_null": pl.Int64,
    "unmatched": pl.Int64,
    "differing": pl.Int64,
    "streak_n": pl.Int64,
    "streak_anchors": pl.Int64,
    "streak_a": pl.Float64,
    "streak_b": pl.Float64,
    "streak_delta": pl.Float64,
    "streak_ci_low": pl.Float64,
    "streak_ci_high": pl.Float64,
    "streak_verdict": pl.String,
    "checkpoint_a": pl.String,
    "checkpoint_b": pl.String,
}


class FewSamplesWarning(CompareWarning):
    """Some intervals rest on fewer than FEW_SAMPLES paired samples."""


# --------------------------------------------------------------------------- one (dataset, method)


_NO_STREAK = {
    "streak_n": None,
    "streak_anchors": None,
    "streak_a": None,
    "streak_b": None,
    "streak_delta": None,
    "streak_ci_low": None,
    "streak_ci_high": None,
    "streak_verdict": None,
}


def compare_pairs(rows: pl.DataFrame, resamples: int, seed: int, confidence: float) -> dict:
    """n, tau_a, tau_b, delta, ci_low, ci_high, verdict, dropped_null, unmatched, differing for one
    (dataset, method), from its rows of the full join of A and B (tau_a, tau_b, in_a, in_b, differs)."""
    if "differs" not in rows.columns:
        rows = rows.with_columns(differs=pl.lit(False))
    both = rows.filter(pl.col("in_a") & pl.col("in_b"))
    present = both.filter(~pl.col("differs"))
    paired = present.filter(pl.col("tau_a").is_not_null() & pl.col("tau_b").is_not_null())
    counts = {
        "dropped_null": present.height - paired.height,
        "unmatched": rows.height - both.height,
        "differing": both.height - present.height,
    }
    n = paired.height
    if n == 0:
        return {
            "n": 0,
            "tau_a": None,
            "tau_b": None,
            "delta": None,
            "ci_low": None,
            "ci_high": None,
            "verdict": "no paired samples with a tau in both runs",
            **counts,
        }
    tau_a, tau_b = paired["tau_a"].to_numpy(), paired["tau_b"].to_numpy()
    delta, low, high = paired_bootstrap(tau_a, tau_b, resamples=resamples, seed=seed, confidence=confidence)
    return {
        "n": n,
        "tau_a": float(tau_a.mean()),
        "tau_b": float(tau_b.mean()),
        "delta": delta,
        "ci_low": low,
        "ci_high": high,
        "verdict": verdict(delta, low, high, confidence, n),
        **counts,
    }


def compare_streak(sums: pl.DataFrame, resamples: int, seed: int, confidence: float) -> dict:
    """The streak_* columns of one (dataset, method) from its rows of streak_sums."""
    sums = sums.filter(pl.col("anchors") > 0)
    if sums.height == 0:
        return {**_NO_STREAK, "streak_n": 0, "streak_anchors": 0, "streak_verdict": "no anchor scored in both runs"}
    sum_a, sum_b, counts = (sums[c].to_numpy().astype(np.float64) for c in ("sum_a", "sum_b", "anchors"))
    delta, low, high = paired_ratio_bootstrap(
        sum_a, sum_b, counts, resamples=resamples, seed=seed, confidence=confidence
    )
    total = counts.sum()
    return {
        "streak_n": sums.height,
        "streak_anchors": int(total),
        "streak_a": float(sum_a.sum() / total),
        "streak_b": float(sum_b.sum() / total),
        "streak_delta": delta,
        "streak_ci_low": low,
        "streak_ci_high": high,
        "streak_verdict": verdict(delta, low, high, confidence, sums.height, unit="streak"),
    }


# --------------------------------------------------------------------------- the comparison


@dataclass
class Comparison:
    """A comparison: the table (OUTPUT_SCHEMA, one row per dataset and method) and what the
    report says around it."""

    table: pl.DataFrame
    dir_a: str
    dir_b: str
    checkpoint_a: str
    checkpoint_b: str
    checkpoint_hash_a: str | None
    checkpoint_hash_b: str | None
    same_checkpoint: bool
    shards_identity_a: str | None
    shards_identity_b: str | None
    shards: ShardsMatch
    differing_samples: int
    streak_compared: bool
    streak_missing: str  # why the streak is not compared ('' when it is)
    confidence: float
    few_samples: list[str] = field(default_factory=list)  # 'gsm8k (n = 6)': datasets with n < FEW_SAMPLES

    @property
    def intervals(self) -> int:
        """Intervals computed (tau and streak; groups of at least 2 pairs)."""
        t = self.table
        return int((t["n"] >= 2).sum()) + int((t["streak_n"].fill_null(0) >= 2).sum())

    @property
    def expected_by_chance(self) -> float:
        """Intervals expected to exclude zero by chance alone: intervals * (1 - confidence)."""
        return self.intervals * (1.0 - self.confidence)

    @property
    def headline(self) -> str:
        """headline() of the table, noting when A and B are the same checkpoint content."""
        line = headline(self.table.to_dicts(), self.confidence)
        if self.same_checkpoint:
            line += f"; A and B are the same checkpoint content ({self.checkpoint_hash_a}), so zero is expected"
        return line

    def payload(self) -> dict:
        """The JSON-able fields besides the rows."""
        return {
            "headline": self.headline,
            "dir_a": self.dir_a,
            "dir_b": self.dir_b,
            "checkpoint_a": self.checkpoint_a,
            "checkpoint_b": self.checkpoint_b,
            "checkpoint_hash_a": self.checkpoint_hash_a,
            "checkpoint_hash_b": self.checkpoint_hash_b,
            "same_checkpoint": self.same_checkpoint,
            "shards_identity_a": self.shards_identity_a,
            "shards_identity_b": self.shards_identity_b,
            "shards": self.shards.value,
            "differing_samples": self.differing_samples,
            "streak_compared": self.streak_compared,
            "streak_missing": self.streak_missing or None,
            "intervals": self.intervals,
            "expected_by_chance": self.expected_by_chance,
            "few_samples": self.few_samples,
        }


def headline_row(rows: list[dict]) -> dict | None:
    """The pooled chain row, else the pooled row of the first method, else the first row."""
    for test in (
        lambda r: r["dataset"] == ALL_DATASETS and r["method"] == CHAIN,
        lambda r: r["dataset"] == ALL_DATASETS,
        lambda r: True,
    ):
        found = [r for r in rows if test(r)]
        if found:
            return found[0]
    return None


def headline(rows: list[dict], confidence: float = 0.95) -> str:
    """One sentence: 'B (x) vs A (y): tau chain 1.34 -> 1.52, +0.18 (95% CI 0.09 to 0.27), B is
    better; all 16 samples paired'."""
    row = headline_row(rows)
    if row is None:
        return "nothing to compare"
    where = "" if row["dataset"] == ALL_DATASETS else f" on {row['dataset']}"
    who = f"B ({row['checkpoint_b']}) vs A ({row['checkpoint_a']}): tau {row['method']}{where}"
    n = row["n"]
    extra = {
        "differ in prompt or response": row["differing"],
        "in only one run": row["unmatched"],
        "without a tau": row["dropped_null"],
    }
    total = n + sum(extra.values())
    left_out = ", ".join(f"{v} {k}" for k, v in extra.items() if v)
    pairing = f"all {n} samples paired" if not left_out else f"{n} of {total} samples paired ({left_out})"
    if 0 < n < FEW_SAMPLES:
        pairing += f"; fewer than {FEW_SAMPLES}, so the interval is unreliable"
    if n == 0:
        return f"{who}: no paired samples with a tau in both runs ({left_out or 'none'})"
    delta, low, high = row["delta"], row["ci_low"], row["ci_high"]
    d = digits(delta, low, high)
    if n < 2:
        judgement = "too few paired samples to judge"
    elif low > 0:
        judgement = "B is better"
    elif high < 0:
        judgement = "A is better"
    else:
        judgement = "no significant difference"
    return (
        f"{who} {row['tau_a']:.{d}f} -> {row['tau_b']:.{d}f}, {delta:+.{d}f} "
        f"({confidence * 100:g}% CI {low:.{d}f} to {high:.{d}f}), {judgement}; {pairing}"
    )


def _few_samples(table: pl.DataFrame) -> list[str]:
    """Groups with fewer than FEW_SAMPLES pairs (tau or streak), one entry per dataset:
    'gsm8k (n = 6)' when every method of it is short, else 'gsm8k chain, ddtree-8 (n = 6)';
    warned about once."""
    methods = table["method"].unique(maintain_order=True).to_list()
    short: dict[str, tuple[list[str], int]] = {}
    for row in table.iter_rows(named=True):
        small = sorted(n for n in {row["n"], row["streak_n"]} - {None, 0} if n < FEW_SAMPLES)
        if small:
            names, least = short.get(row["dataset"], ([], small[0]))
            short[row["dataset"]] = ([*names, row["method"]], min(least, small[0]))
    groups = [
        f"{dataset}{'' if names == methods else ' ' + ', '.join(names)} (n = {least})"
        for dataset, (names, least) in short.items()
    ]
    if groups:
        warnings.warn(
            f"fewer than {FEW_SAMPLES} paired samples in {', '.join(groups)}: the intervals there are unreliable "
            f"(a bootstrap over so few samples is too narrow) and their verdicts weak; score more samples "
            f"for a firm answer",
            FewSamplesWarning,
            stacklevel=3,
        )
    return groups


def run_comparison(
    dir_a: str,
    dir_b: str,
    methods: list[str] | None = None,
    datasets: list[str] | None = None,
    resamples: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
    allow_different_shards: bool = False,
) -> Comparison:
    """Compare two results directories (definitions in the module docstring). Warnings
    (CompareWarning subclasses) say what the reader must know; CompareError when A and B cannot
    be compared (different or uncheckable shards without allow_different_shards, nothing pairs)."""
    # each step called here warns with stacklevel 3 (pair_samples' helpers 4): a warning names our caller
    _check_settings(resamples, confidence)
    a, b = load_side(dir_a, "A"), load_side(dir_b, "B")
    shards = check_shards(a, b, allow_different_shards)
    same_checkpoint = check_same_checkpoint(a, b)
    pairing = pair_samples(a, b, methods, strict=shards != ShardsMatch.SAME)
    chosen_datasets = _datasets(pairing.joined, datasets)
    sums, streak_missing = streak_inputs(a, b, pairing.pairs, pairing.methods)
    settings = {"resamples": resamples, "seed": seed, "confidence": confidence}
    table = _table(pairing, sums, chosen_datasets, {"checkpoint_a": a.name, "checkpoint_b": b.name}, settings)
    return Comparison(
        table=table,
        **_sides(a, b),
        same_checkpoint=same_checkpoint,
        shards=shards,
        differing_samples=pairing.differing,
        streak_compared=sums is not None,
        streak_missing=streak_missing,
        confidence=confidence,
        few_samples=_few_samples(table),
    )


def _check_settings(resamples: int, confidence: float) -> None:
    """CompareError naming the option for a confidence outside (0, 1) or fewer than 1 resample."""
    if not 0.0 < confidence < 1.0:
        raise CompareError(f"--confidence must be between 0 and 1 (e.g. 0.95); got {confidence}")
    if resamples < 1:
        raise CompareError(f"--resamples must be >= 1 (e.g. 2000); got {resamples}")


def _datasets(joined: pl.DataFrame, requested: list[str] | None) -> list[str]:
    """The requested datasets among those with a sample in both runs, then (all)."""
    shared = joined.filter(pl.col("in_a") & pl.col("in_b"))
    available = sorted(shared["dataset"].unique().to_list()) + [ALL_DATASETS]
    return select_requested(requested, available, "dataset", "--dataset")


def _table(
    pairing: Pairing, sums: pl.DataFrame | None, datasets: list[str], names: dict, settings: dict
) -> pl.DataFrame:
    """One OUTPUT_SCHEMA row per (dataset, method): compare_pairs' and compare_streak's columns
    (bootstrap `settings`: resamples, seed, confidence) and the checkpoints' `names`."""
    rows = []
    for dataset in datasets:
        pooled = dataset == ALL_DATASETS
        subset = pairing.joined if pooled else pairing.joined.filter(pl.col("dataset") == dataset)
        for method in pairing.methods:
            row = compare_pairs(subset.filter(pl.col("method") == method), **settings)
            streak = _streak_row(sums, dataset, method, settings)
            rows.append({"dataset": dataset, "method": method, **row, **streak, **names})
    return pl.DataFrame(rows, schema=OUTPUT_SCHEMA)


def _streak_row(sums: pl.DataFrame | None, dataset: str, method: str, settings: dict) -> dict:
    """compare_streak of (dataset, method) over streak_sums' rows ((all): every dataset's);
    _NO_STREAK when the streak is not compared or the method has no sums."""
    if sums is None or not (sums["method"] == method).any():
        return _NO_STREAK
    pooled = dataset == ALL_DATASETS
    mine = sums.filter((pl.col("method") == method) & (pl.lit(pooled) | (pl.col("dataset") == dataset)))
    return compare_streak(mine, **settings)


def _sides(a: Side, b: Side) -> dict:
    """The fields of Comparison that describe A and B."""
    return {
        "dir_a": a.path,
        "dir_b": b.path,
        "checkpoint_a": a.name,
        "checkpoint_b": b.name,
        "checkpoint_hash_a": a.content_hash,
        "checkpoint_hash_b": b.content_hash,
        "shards_identity_a": a.shards_identity,
        "shards_identity_b": b.shards_identity,
    }
