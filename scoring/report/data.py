"""What `specreplay report` reads: results directories found, de-duplicated and loaded into one
`Results`, plus the small helpers every part of the page shares (datasets, budgets, formatting).

De-duplication: a results tree can hold the same checkpoint scored twice (an older `score` that
wrote to --out itself, then the per-checkpoint directory it writes now). Directories with the same
checkpoint content hash on the same shards are one result: the one scored on the most samples is
kept (a `--limit` run is a subset of a full one), ties go to the most recently written run.json,
and the others are listed as skipped so the page and the console can say so.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import polars as pl

from pipeline.common.errors import UserError
from scoring.methods.chain import CHAIN
from scoring.methods.ddtree import DDTREE
from scoring.methods.eagle_tree import EAGLE_TREES
from scoring.results import (
    ALL_DATASETS as ALL,
    FILES,
    read_run_record,
    results_dirs_below,
    sampling_of_row,
)

TAU_UNIT = "tokens per step, bonus-inclusive"
SAMPLE_COLUMNS = [
    "dataset",
    "sample_id",
    "tau",
    "steps",
    "prompt_len",
    "response_len",
    "finish_reason",
    "exact",
    "argmax_mismatches",
    "prompt_text",
    "tokens_hash",
]


class ReportError(UserError):
    """Results that cannot make a report (none found, unreadable file, unknown sample); the message
    names the path or the value."""


@dataclass
class Duplicate:
    """A results directory left out because `kept` holds the same checkpoint on the same shards."""

    skipped: str
    kept: str
    checkpoint_hash: str
    reason: str  # why `kept` won: "more samples" or "more recent"


@dataclass
class Results:
    """Everything the report shows, with a `label` column naming each checkpoint uniquely."""

    dirs: list[str]
    summary: pl.DataFrame
    samples: pl.DataFrame | None  # method chain only; `sample_index` = the sample's index in its shards
    walk: pl.DataFrame | None  # method chain only: label, produced
    runs: dict[str, dict] = field(default_factory=dict)  # dir -> run.json (or {})
    order: list[str] = field(default_factory=list)  # labels by training step, then name
    steps: dict[str, int | None] = field(default_factory=dict)
    dir_of: dict[str, str] = field(default_factory=dict)  # label -> results directory
    reach: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)  # label -> (reached, accepted)
    duplicates: list[Duplicate] = field(default_factory=list)
    fitted_here: set[str] = field(default_factory=set)  # labels fitted on the samples they are scored on
    # label -> "greedy" or "sampled T=0.6": sampled and greedy runs are different experiments, so
    # curves, the worst-prompts table and the header keep them apart by this
    kind: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- finding and de-duplicating


def find_results_dirs(paths: list[str]) -> list[str]:
    """Every directory at or below `paths` that holds a summary.parquet, sorted, without duplicates."""
    found: list[str] = []
    for path in paths:
        if not os.path.isdir(path):
            raise ReportError(f"{path}: not a directory (pass results directories written by `specreplay score`)")
        found += results_dirs_below(path, ("summary",))
    unique = sorted(set(found))
    if not unique:
        raise ReportError(f"no summary.parquet at or below {', '.join(paths)}; run `specreplay score` first")
    return unique


def _identity(directory: str, summary: pl.DataFrame, run: dict) -> tuple | None:
    """(checkpoint hash, shards identity) naming what a directory scored; None when unknown, so
    a directory without a hash is never merged with another."""
    checkpoint_hash = summary["checkpoint_hash"][0] if "checkpoint_hash" in summary.columns and summary.height else None
    checkpoint_hash = checkpoint_hash or (run.get("checkpoint", {}).get("content_hash") or "")[:16]
    if not checkpoint_hash:
        return None
    shards = run.get("shards", {})
    return checkpoint_hash, shards.get("identity") or shards.get("uri")


def _preference(directory: str, summary: pl.DataFrame, run: dict) -> tuple[int, float]:
    """Sort key among duplicates, higher wins: samples scored, then when run.json was written."""
    samples = run.get("shards", {}).get("samples")
    if not isinstance(samples, int):
        pooled = summary.filter((pl.col("dataset") == ALL) & (pl.col("method") == CHAIN))
        samples = int(pooled["samples"][0]) if pooled.height and "samples" in pooled.columns else 0
    stamp = os.path.join(directory, FILES["run"])
    if not os.path.exists(stamp):
        stamp = os.path.join(directory, FILES["summary"])
    return samples, os.path.getmtime(stamp)


def dedupe(summaries: list[tuple[str, pl.DataFrame]], runs: dict[str, dict]) -> tuple[list[str], list[Duplicate]]:
    """(directories kept in their order, duplicates left out): one directory per (checkpoint hash,
    shards identity); see the module docstring for which one is kept."""
    groups: dict[tuple, list[str]] = {}
    for directory, summary in summaries:
        key = _identity(directory, summary, runs[directory])
        groups.setdefault(key if key is not None else ("dir", directory), []).append(directory)
    by_dir = dict(summaries)
    dropped: list[Duplicate] = []
    for key, members in groups.items():
        if len(members) < 2:
            continue
        prefs = {d: _preference(d, by_dir[d], runs[d]) for d in members}
        ranked = sorted(members, key=lambda d: (prefs[d], d), reverse=True)
        kept = ranked[0]
        for other in ranked[1:]:
            reason = "more samples" if prefs[kept][0] > prefs[other][0] else "more recent"
            dropped.append(Duplicate(skipped=other, kept=kept, checkpoint_hash=str(key[0]), reason=reason))
    skipped = {d.skipped for d in dropped}
    return [d for d, _ in summaries if d not in skipped], sorted(dropped, key=lambda d: d.skipped)


# ---------------------------------------------------------------- loading


def _read(path: str, method: str | None = None, columns: list[str] | None = None) -> pl.DataFrame:
    try:
        frame = pl.scan_parquet(path)
        names = frame.collect_schema().names()
        if method is not None:
            frame = frame.filter(pl.col("method") == method)
        if columns is not None:
            frame = frame.select([c for c in columns if c in names])
        return frame.collect()
    except Exception as error:  # polars raises several types for a truncated or foreign file
        raise ReportError(f"{path}: cannot read ({error})") from error


def read_run(directory: str) -> dict:
    """run.json, checked (results.read_run_record); {} when absent: it is context for the inputs
    table, never required, but one that is there and broken is said, not shown as if whole."""
    return read_run_record(directory) or {}


def fitted_on_scored_shards(run: dict) -> bool:
    """Whether run.json's checkpoint was fitted by `specreplay fit` on the very shards it was
    scored on: its config.json's `specreplay_fit.shards_identity` (scoring/fit.py) is the
    run's shards identity. Such a tau shows the tool at work, not what a real drafter reaches."""
    config = (run.get("checkpoint") or {}).get("config") or {}
    fitted = config.get("specreplay_fit") if isinstance(config, dict) else None
    identity = (run.get("shards") or {}).get("identity")
    return isinstance(fitted, dict) and identity is not None and fitted.get("shards_identity") == identity


def _labels(summaries: list[tuple[str, pl.DataFrame]]) -> dict[str, str]:
    """dir -> display label. The checkpoint name is the label unless two directories share it
    (one checkpoint scored on two shard sets, or two runs both called step_300): then the
    directory name tells them apart."""
    names = {
        d: (s["checkpoint"][0] if "checkpoint" in s.columns and s.height else os.path.basename(d)) + _decoding(s)
        for d, s in summaries
    }
    counts: dict[str, int] = {}
    for name in names.values():
        counts[name] = counts.get(name, 0) + 1
    tails = {d: os.path.join(os.path.basename(os.path.dirname(os.path.abspath(d))), os.path.basename(d)) for d in names}
    return {d: name if counts[name] == 1 else f"{name} [{tails[d]}]" for d, name in names.items()}


def _decoding(summary: pl.DataFrame) -> str:
    """' (T=0.6, top-p 0.95, top-k 20)' for results scored on sampled shards, '' for greedy."""
    sampling = sampling_of_row(summary.row(0, named=True)) if summary.height else None
    return "" if sampling is None else f" ({sampling.describe()})"


def kind_of(summary: pl.DataFrame) -> str:
    """'greedy', or 'sampled T=0.6' for results scored on shards sampled at T > 0."""
    sampling = sampling_of_row(summary.row(0, named=True)) if summary.height else None
    return "greedy" if sampling is None else f"sampled T={sampling.temperature:g}"


def summary_reach(summary: pl.DataFrame) -> tuple[list[int], list[int]] | None:
    """(reached, accepted) per block position of a sampled result from summary.parquet's
    reached_by_position: the expected anchors behind each rate, rounded, so the page greys the
    positions score calls too thin. None when the summary has no such column (an older score)."""
    rows = chain_all(summary)
    if "reached_by_position" not in rows.columns or not rows.height or rows["reached_by_position"][0] is None:
        return None
    reached = [_count(n) for n in rows["reached_by_position"][0]]
    rates = rows["accept_rate_by_position"][0] if "accept_rate_by_position" in rows.columns else None
    rates = list(rates) if rates is not None else [None] * len(reached)
    return reached, [_count(n * r) if r is not None else 0 for n, r in zip(reached, rates)]


def _count(value: float | None) -> int:
    # a position no anchor reached has a null or NaN rate/count: zero anchors behind it
    # floored, so a count score calls thin (29.6 < MIN_ANCHORS) stays under the threshold here
    return 0 if value is None or math.isnan(value) else int(value)


def position_reach(directory: str, positions: int) -> tuple[list[int], list[int]] | None:
    """(reached, accepted) per block position k = 1..positions over every anchor in anchors.parquet,
    counted as scoring.replay.metrics.position_counts counts them: position k is reached when the
    anchor's accepted_len >= k - 1 and its target token is known (k <= the anchor's number of
    known positions, the length of its draft_match list: the block may be cut by the token
    budget or the response's end); accepted when accepted_len >= k (which implies known).
    accepted / reached is summary.parquet's accept_rate_by_position. None without a readable
    anchors.parquet."""
    path = os.path.join(directory, FILES["anchors"])
    if not os.path.exists(path) or positions <= 0:
        return None
    try:
        frame = pl.scan_parquet(path).select(acc=pl.col("accepted_len"), known=pl.col("draft_match").list.len())
        exprs = []
        for k in range(1, positions + 1):
            exprs.append(((pl.col("acc") >= k - 1) & (pl.col("known") >= k)).sum().alias(f"r{k}"))
            exprs.append((pl.col("acc") >= k).sum().alias(f"a{k}"))
        row = frame.select(exprs).collect().row(0, named=True)
    except Exception:  # noqa: BLE001 - a truncated or foreign file: the counts are optional, the page notes their absence
        return None
    return [int(row[f"r{k}"]) for k in range(1, positions + 1)], [int(row[f"a{k}"]) for k in range(1, positions + 1)]


def _positions(summary: pl.DataFrame) -> int:
    rows = summary.filter((pl.col("dataset") == ALL) & (pl.col("method") == CHAIN))
    if "accept_rate_by_position" not in rows.columns or not rows.height:
        return 0
    rates = rows["accept_rate_by_position"][0]
    return 0 if rates is None else len(rates)


def _chain_parts(directory: str, label: str) -> tuple[pl.DataFrame | None, pl.DataFrame | None]:
    """(chain sample rows with their shard index, chain walk `produced`) of one directory."""
    samples = walk = None
    if os.path.exists(os.path.join(directory, FILES["samples"])):
        # samples.parquet lists each method's samples in shard order (scoring/score/collect.py), so the
        # row number among chain rows is the sample's index in its ShardSet.
        samples = _read(os.path.join(directory, FILES["samples"]), CHAIN, SAMPLE_COLUMNS)
        samples = samples.with_row_index("sample_index").with_columns(label=pl.lit(label))
    if os.path.exists(os.path.join(directory, FILES["walk"])):
        walk = _read(os.path.join(directory, FILES["walk"]), CHAIN, ["produced"]).with_columns(label=pl.lit(label))
    return samples, walk


def _concat(parts: list[pl.DataFrame | None]) -> pl.DataFrame | None:
    # diagonal_relaxed: directories may differ in budgets (columns) or have an all-null column
    # (Null dtype), which a plain concat refuses.
    parts = [p for p in parts if p is not None]
    return pl.concat(parts, how="diagonal_relaxed") if parts else None


def load_results(dirs: list[str]) -> Results:
    """Read summary (all columns), samples and walk (chain rows, needed columns) and per-position
    anchor counts of each directory, after leaving out duplicates (see `dedupe`)."""
    runs = {d: read_run(d) for d in dirs}
    summaries = [(d, _read(os.path.join(d, FILES["summary"]))) for d in dirs]
    kept, duplicates = dedupe(summaries, runs)
    summaries = [(d, s) for d, s in summaries if d in set(kept)]
    labels = _labels(summaries)
    summary_parts, sample_parts, walk_parts, reach = [], [], [], {}
    for d, summary in summaries:
        summary_parts.append(summary.with_columns(label=pl.lit(labels[d]), results_dir=pl.lit(d)))
        samples, walk = _chain_parts(d, labels[d])
        sample_parts.append(samples)
        walk_parts.append(walk)
        # at T > 0 reaching a position is random: only the summary holds its expected count, the
        # one score greys by; greedy counts come exact from anchors.parquet
        counts = summary_reach(summary) if _decoding(summary) else position_reach(d, _positions(summary))
        if counts is not None:
            reach[labels[d]] = counts
    summary_df = _concat(summary_parts)
    if "checkpoint_step" not in summary_df.columns:
        summary_df = summary_df.with_columns(checkpoint_step=pl.lit(None, dtype=pl.Int64))
    steps = {}
    for row in summary_df.select("label", "checkpoint_step").unique("label").iter_rows():
        steps[row[0]] = None if row[1] is None else int(row[1])
    return Results(
        dirs=kept,
        summary=summary_df,
        samples=_concat(sample_parts),
        walk=_concat(walk_parts),
        runs={d: runs[d] for d in kept},
        order=sorted(steps, key=lambda lab: (steps[lab] is None, steps[lab] or 0, lab)),
        steps=steps,
        dir_of={label: d for d, label in labels.items()},
        reach=reach,
        duplicates=duplicates,
        fitted_here={labels[d] for d in kept if fitted_on_scored_shards(runs[d])},
        kind={labels[d]: kind_of(s) for d, s in summaries},
    )


# ---------------------------------------------------------------- helpers the page shares


def ddtree_budgets(summary: pl.DataFrame) -> list[int]:
    """The DDTree budgets (tree nodes) present in a summary, ascending."""
    nodes = {DDTREE.setting_of(method) for method in summary["method"].unique().to_list()}
    return sorted(nodes - {None})


def eagle_trees(summary: pl.DataFrame) -> list:
    """The EAGLE tree settings (scoring.methods.eagle_tree.EagleTree) present in a summary, by size."""
    found = {EAGLE_TREES.setting_of(m) for m in summary["method"].unique().to_list()} - {None}
    return sorted(found, key=lambda tree: (tree.draft_tokens, tree.topk, tree.depth))


def datasets(summary: pl.DataFrame) -> list[str]:
    """(all) first, then the datasets by name."""
    names = sorted(set(summary["dataset"].to_list()) - {ALL})
    return ([ALL] if ALL in set(summary["dataset"]) else []) + names


def pick_evenly(items: list, k: int) -> list:
    """At most k items spread evenly over the list, first and last always kept."""
    if len(items) <= k:
        return list(items)
    index = sorted({round(i * (len(items) - 1) / (k - 1)) for i in range(k)})
    return [items[i] for i in index]


def fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def chain_all(summary: pl.DataFrame) -> pl.DataFrame:
    return summary.filter((pl.col("dataset") == ALL) & (pl.col("method") == CHAIN))


def kinds(results: Results) -> list[str]:
    """The kinds of run present, greedy first, then the sampled ones by temperature."""
    return sorted(set(results.kind.values()), key=lambda k: (k != "greedy", k))


def run_of(results: Results, label: str, named_kind: bool = True) -> str:
    """The training run a checkpoint belongs to ('run' of 'run/step_300'), then its kind of decoding
    when `named_kind`: greedy and sampled τ of one run are different experiments, never one curve."""
    run = label.rsplit("/", 1)[0] if "/" in label else ""
    kind = results.kind.get(label, "greedy") if named_kind else ""
    return " · ".join(part for part in (run, kind) if part)


def reference_label(results: Results) -> str | None:
    """The checkpoint the per-sample parts of the page are about: the latest one with samples,
    among greedy results when there are any (a sampled run is another experiment)."""
    if results.samples is None or results.samples.height == 0:
        return None
    have = set(results.samples["label"])
    with_samples = [lab for lab in results.order if lab in have]
    greedy = [lab for lab in with_samples if results.kind.get(lab, "greedy") == "greedy"]
    return (greedy or with_samples)[-1] if with_samples else None
