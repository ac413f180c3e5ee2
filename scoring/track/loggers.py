"""Put score results into the training dashboard: TensorBoard, Weights & Biases, MLflow.

`specreplay log` (existing results) and `specreplay watch` (each checkpoint as it is scored) both
go through here: `scalars_of` turns a summary.parquet into tagged scalars, `open_loggers` opens
the trackers asked for, and `log_results` logs results directories at their checkpoints'
training steps, once per (checkpoint, step, destination) thanks to a ledger beside the results.
The trackers themselves are in loggers_backends.py, the ledger in loggers_ledger.py.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Protocol

from pipeline.common.errors import UserError
from scoring.methods.chain import CHAIN
from scoring.methods.ddtree import DDTREE
from scoring.methods.eagle_tree import EAGLE_TREES
from scoring.results import (
    ALL_DATASETS,
    FILES,
    MIN_ANCHORS,
    read_run_record,
    results_dirs_below,
)
from scoring.track.backends import PREFIX, MlflowLogger, TensorBoardLogger, WandbLogger
from scoring.track.ledger import LEDGER_NAME, Ledger, ledger_path_for

__all__ = [
    "LEDGER_NAME",
    "Logger",
    "LoggerOptions",
    "ledger_path_for",
    "log_results",
    "open_loggers",
    "results_dirs_under",
    "scalars_of",
]


class Logger(Protocol):
    name: str  # "tensorboard", "wandb", "mlflow"
    destination: str  # where it writes, e.g. "tensorboard:/abs/dir": the ledger's key

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclass
class LoggerOptions:
    """Which trackers to log to; every field None means none."""

    tensorboard: str | None = None  # event directory (the trainer's log dir puts curves beside its loss)
    wandb_project: str | None = None
    wandb_run_id: str | None = None  # append to this run (e.g. the training run); default: run "specreplay"
    mlflow_uri: str | None = None  # tracking URI: sqlite:///mlflow.db, http://host:5000, ...
    mlflow_run_id: str | None = None  # append to this run; default: run named "specreplay" in the experiment
    mlflow_experiment: str = "specreplay"


def open_loggers(options: LoggerOptions) -> list[Logger]:
    """The loggers `options` asks for (possibly none). A missing package is a UserError naming
    the `loggers` extra; nothing connects before the first `log`."""
    if options.wandb_run_id and not options.wandb_project:
        raise UserError("--wandb-run-id needs --wandb-project (the project the run belongs to)")
    if options.mlflow_run_id and not options.mlflow_uri:
        raise UserError("--mlflow-run-id needs --mlflow-uri (the tracking store the run is in)")
    loggers: list[Logger] = []
    if options.tensorboard:
        loggers.append(TensorBoardLogger(options.tensorboard))
    if options.wandb_project:
        loggers.append(WandbLogger(options.wandb_project, options.wandb_run_id))
    if options.mlflow_uri:
        loggers.append(MlflowLogger(options.mlflow_uri, options.mlflow_run_id, options.mlflow_experiment))
    return loggers


# ---------------------------------------------------------------- scalars


def _rows(summary) -> list[dict]:
    # a polars DataFrame (to_dicts) or a pyarrow Table (to_pylist): no import of either needed
    return summary.to_dicts() if hasattr(summary, "to_dicts") else summary.to_pylist()


def _finite(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def dataset_tag(dataset: str) -> str:
    """A dataset name as one tag level: '(all)' -> 'all'; characters MLflow refuses in metric
    keys (anything but letters, digits, _ - . space :) and '/' become '_'."""
    return "all" if dataset == ALL_DATASETS else re.sub(r"[^\w\-. :]", "_", dataset)


def scalars_of(summary, reached: dict[str, list[float]] | None = None) -> dict[str, float]:
    """One results directory's summary.parquet (polars DataFrame or pyarrow Table) as tagged
    scalars, per dataset including the pooled '(all)' (tag level `all`):

        specreplay/<dataset>/tau_chain            chain tau (tokens per walk step, bonus-inclusive)
        specreplay/<dataset>/tau_ddtree_<N>       DDTree tau at budget N, one per budget scored
        specreplay/<dataset>/streak               chain all-anchor streak (anchor_accepted_len_mean,
                                                  accepted draft tokens per anchor, bonus-exclusive)
        specreplay/<dataset>/accept_rate_pos_<k>  P(block position k accepted | reached), k = 1..B-1,
                                                  where at least MIN_ANCHORS anchors reached k
        specreplay/<dataset>/accept_anchors_pos_<k>          the anchors that reached k (expected at T > 0)
        specreplay/<dataset>/accept_rate_pos_<k>_low, _high  its 95% Wilson interval on those counts

    A value that is null or NaN (no walk step, a block position never reached) is left out, and
    so is the rate of a position fewer than MIN_ANCHORS anchors reached (`reached`: dataset ->
    anchors per position, `position_reach`; a dataset without counts logs no position): one
    anchor's 0 or 1 there would plot as a cliff. These tags are a stable interface: dashboards
    and alerts are built on them.
    """
    scalars: dict[str, float] = {}
    for row in _rows(summary):
        counts = (reached or {}).get(row["dataset"]) or []
        found = _row_scalars(f"{PREFIX}/{dataset_tag(row['dataset'])}", row, counts)
        scalars.update({tag: float(v) for tag, v in found.items() if _finite(v)})
    return scalars


def _row_scalars(base: str, row: dict, reached: list[float]) -> dict:
    """The tags of one summary row (one dataset and method), values unchecked."""
    if row["method"] == CHAIN:
        found = {f"{base}/tau_chain": row.get("tau"), f"{base}/streak": row.get("anchor_accepted_len_mean")}
        rates = row.get("accept_rate_by_position") or []
        lows = row.get("accept_rate_low_by_position") or [None] * len(rates)  # absent from older results
        highs = row.get("accept_rate_high_by_position") or [None] * len(rates)
        for k, (rate, n, low, high) in enumerate(zip(rates, reached, lows, highs), start=1):
            if n >= MIN_ANCHORS and _finite(rate):
                found[f"{base}/accept_rate_pos_{k}"] = rate
                found[f"{base}/accept_anchors_pos_{k}"] = n
                found[f"{base}/accept_rate_pos_{k}_low"], found[f"{base}/accept_rate_pos_{k}_high"] = low, high
        return found
    tree = EAGLE_TREES.setting_of(row["method"])
    if tree is not None:
        return {f"{base}/tau_eagle_tree_{tree.topk}x{tree.depth}_{tree.draft_tokens}": row.get("tau")}
    nodes = DDTREE.setting_of(row["method"])
    if nodes is None:  # a method this version does not know: nothing to say about it
        return {}
    return {f"{base}/tau_ddtree_{nodes}": row.get("tau")}


def position_reach(directory: str, summary) -> dict[str, list[float]]:
    """dataset (and ALL_DATASETS) -> the anchors that reached each block position, from the
    directory's anchors.parquet, counted as scoring.replay.metrics.position_counts counts them:
    position k is reached when accepted_len >= k - 1 and the target is known there (k <= the
    length of draft_match). On sampled shards reaching is random: the expected count is taken as
    the anchors whose position k is known times the summary's rates at positions 1..k-1. {}
    without a readable anchors.parquet (then no position is logged)."""
    import polars as pl

    rows = [r for r in _rows(summary) if r["method"] == CHAIN and r.get("accept_rate_by_position")]
    path = os.path.join(directory, FILES["anchors"])
    if not rows or not os.path.exists(path):
        return {}
    positions = max(len(r["accept_rate_by_position"]) for r in rows)
    sampled = bool(rows[0].get("temperature"))  # as results.sampling_of_row reads it, without importing torch
    acc, known = pl.col("accepted_len"), pl.col("draft_match").list.len()
    counted = [(known >= k) & (pl.lit(sampled) | (acc >= k - 1)) for k in range(1, positions + 1)]
    try:
        frame = pl.scan_parquet(path).select(pl.col("dataset"), *(c.alias(f"r{i}") for i, c in enumerate(counted)))
        per = frame.group_by("dataset").agg(pl.all().sum()).collect()
    except Exception:  # noqa: BLE001 - a damaged or foreign file: log no position rather than fail the log
        return {}
    counts = {row.pop("dataset"): [float(v) for v in row.values()] for row in per.iter_rows(named=True)}
    counts[ALL_DATASETS] = [float(sum(c[i] for c in counts.values())) for i in range(positions)]
    if sampled:
        rates = {r["dataset"]: r["accept_rate_by_position"] for r in rows}
        counts = {d: expected_reach(c, rates.get(d) or []) for d, c in counts.items()}
    return counts


def expected_reach(known: list[float], rates: list[float]) -> list[float]:
    """Anchors with position k known times P(positions 1..k-1 accepted), a NaN rate read as 0."""
    out, survive = [], 1.0
    for k, n in enumerate(known):
        out.append(n * survive)
        rate = rates[k] if k < len(rates) else 0.0
        survive *= rate if _finite(rate) else 0.0
    return out


# ---------------------------------------------------------------- results directories


def results_dirs_under(path: str) -> list[str]:
    """`path` if it is a complete results directory (summary.parquet and run.json), else every
    complete one below it. Hidden directories (score's staging names) are never entered."""
    if not os.path.isdir(path):
        raise UserError(f"{path}: not a directory (pass a results directory written by `specreplay score`)")
    found = results_dirs_below(path, ("summary", "run"))
    if not found:
        raise UserError(f"no results directory (summary.parquet and run.json) at or below {path}")
    return found


@dataclass
class _Scored:
    directory: str
    checkpoint: str
    checkpoint_hash: str
    step: int | None
    scalars: dict[str, float]


def _load(directory: str) -> _Scored:
    import polars as pl

    summary = pl.read_parquet(os.path.join(directory, FILES["summary"]))
    first = summary.row(0, named=True) if summary.height else {}
    run_hash = _run_hash(directory)  # read even when the summary has the hash: a broken run.json is said
    checkpoint_hash = first.get("checkpoint_hash") or run_hash or f"dir:{os.path.abspath(directory)}"
    step = first.get("checkpoint_step")
    name = first.get("checkpoint") or os.path.basename(directory)
    stored = {r["dataset"]: r["reached_by_position"] for r in _rows(summary) if r.get("reached_by_position")}
    scalars = scalars_of(summary, stored or position_reach(directory, summary))  # recounted for older results
    return _Scored(directory, name, checkpoint_hash, None if step is None else int(step), scalars)


def _run_hash(directory: str) -> str | None:
    """run.json's checkpoint hash (16 hex); run.json checked first (results.read_run_record)."""
    record = read_run_record(directory) or {}
    return ((record.get("checkpoint") or {}).get("content_hash") or "")[:16] or None


# ---------------------------------------------------------------- logging


def log_results(result_dirs: list[str], loggers: list[Logger], ledger_path: str | None = None) -> list[str]:
    """Log each results directory's scalars to every logger at its checkpoint's training step
    (summary `checkpoint_step`), in step order. Skipped: a directory without a step, and any
    (checkpoint hash, step, destination) the ledger (default: `ledger_path_for(result_dirs)`)
    already holds. Returns one line per directory saying what was done; none without loggers
    (`watch` calls it whether or not any logger was asked for; `log` requires one)."""
    if not loggers or not result_dirs:
        return []
    ledger = Ledger(ledger_path or ledger_path_for(result_dirs))
    scored = sorted((_load(d) for d in result_dirs), key=lambda s: (s.step is None, s.step or 0, s.directory))
    return [_log_one(s, loggers, ledger) for s in scored]


def _log_one(scored: _Scored, loggers: list[Logger], ledger: Ledger) -> str:
    head = f"{scored.checkpoint} ({scored.directory})"
    if scored.step is None:
        return f"skipped {head}: no training step (checkpoint_step is null: neither its config nor its path names one)"
    if not scored.scalars:
        return f"skipped {head}: its summary.parquet has no tau, streak or acceptance value"
    logged, already = [], []
    for logger in loggers:
        previous = ledger.find(logger.destination, scored.checkpoint_hash, scored.step)
        if previous is not None:
            same = os.path.abspath(previous["results"]) == os.path.abspath(scored.directory)
            already.append(logger.destination + ("" if same else f" (from {previous['results']})"))
            continue
        logger.log(scored.step, scored.scalars)
        ledger.add(
            logger.destination,
            scored.checkpoint_hash,
            scored.step,
            scored.checkpoint,
            scored.directory,
            len(scored.scalars),
        )
        logged.append(logger.destination)
    parts = [f"step {scored.step}: {head}"]
    if logged:
        parts.append(f"logged {len(scored.scalars)} scalars to {', '.join(logged)}")
    if already:
        parts.append(f"already logged to {', '.join(already)}")
    return "; ".join(parts)
