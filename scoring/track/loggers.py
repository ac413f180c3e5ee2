"""Put score results into the training dashboard: TensorBoard, Weights & Biases, MLflow.

`specreplay log` (existing results) and `specreplay watch` (each checkpoint as it is scored) both
go through here: `scalars_of` turns a summary.parquet into tagged scalars, `open_loggers` opens
the trackers asked for, and `log_results` logs results directories at their checkpoints'
training steps, once per (checkpoint, step, destination) thanks to a ledger beside the results.
The trackers themselves are in loggers_backends.py, the ledger in loggers_ledger.py.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Protocol

from pipeline.common.errors import UserError
from scoring.results import ALL_DATASETS, CHAIN, FILES, results_dirs_below, tree_nodes_of
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


def scalars_of(summary) -> dict[str, float]:
    """One results directory's summary.parquet (polars DataFrame or pyarrow Table) as tagged
    scalars, per dataset including the pooled '(all)' (tag level `all`):

        specreplay/<dataset>/tau_chain            chain tau (tokens per walk step, bonus-inclusive)
        specreplay/<dataset>/tau_ddtree_<N>       DDTree tau at budget N, one per budget scored
        specreplay/<dataset>/streak               chain all-anchor streak (anchor_accepted_len_mean,
                                                  accepted draft tokens per anchor, bonus-exclusive)
        specreplay/<dataset>/accept_rate_pos_<k>  P(block position k accepted | reached), k = 1..B-1

    A value that is null or NaN (no walk step, a block position never reached) is left out.
    These tags are a stable interface: dashboards and alerts are built on them.
    """
    scalars: dict[str, float] = {}
    for row in _rows(summary):
        found = _row_scalars(f"{PREFIX}/{dataset_tag(row['dataset'])}", row)
        scalars.update({tag: float(v) for tag, v in found.items() if _finite(v)})
    return scalars


def _row_scalars(base: str, row: dict) -> dict:
    """The tags of one summary row (one dataset and method), values unchecked."""
    if row["method"] == CHAIN:
        found = {f"{base}/tau_chain": row.get("tau"), f"{base}/streak": row.get("anchor_accepted_len_mean")}
        for k, rate in enumerate(row.get("accept_rate_by_position") or [], start=1):
            found[f"{base}/accept_rate_pos_{k}"] = rate
        return found
    try:
        nodes = tree_nodes_of(row["method"])
    except ValueError:  # a method this version does not know: nothing to say about it
        return {}
    return {f"{base}/tau_ddtree_{nodes}": row.get("tau")}


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
    checkpoint_hash = first.get("checkpoint_hash") or _run_hash(directory) or f"dir:{os.path.abspath(directory)}"
    step = first.get("checkpoint_step")
    name = first.get("checkpoint") or os.path.basename(directory)
    return _Scored(directory, name, checkpoint_hash, None if step is None else int(step), scalars_of(summary))


def _run_hash(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, FILES["run"])) as f:
            return ((json.load(f).get("checkpoint") or {}).get("content_hash") or "")[:16] or None
    except (OSError, ValueError):
        return None


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
