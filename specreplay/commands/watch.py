"""`specreplay watch`: score a training run's checkpoints as they land (scoring/track/watch.py)."""

from __future__ import annotations

import os
import sys

import click

from pipeline.common.sizes import parse_size
from scoring.config import ScoreConfig
from specreplay.commands.score import parse_tree_nodes, score as score_command

# The score options that mean the same here, taken from `score` itself so the defaults and help
# never drift apart. Not --force (a watcher that replaced results on every restart would redo
# the whole run) nor --json.
SHARED_OPTIONS = (
    "tree_nodes",
    "device",
    "dtype",
    "memory_bytes",
    "attention",
    "anchors",
    "anchor_drafts",
    "limit",
    "sample",
    "seed",
    "datasets",
)
LOGGER_OPTIONS = ("tensorboard", "wandb_project", "wandb_run_id", "mlflow_uri", "mlflow_run_id")


@click.command(context_settings={"max_content_width": 100})
@click.option(
    "--ckpt",
    "ckpts",
    multiple=True,
    required=True,
    help="Quoted glob of the run's checkpoints ('runs/run7/step_*'), repeatable: directories or weight files "
    "with config.json beside them. Hidden and tmp- names are never scored.",
)
@click.option("--shards", required=True, help="Extract output directory (local path or pyarrow.fs URI).")
@click.option("--out", required=True, help="Parent of the results (--out/<parent>_<name>/ each) and of report.html.")
@click.option(
    "--interval", default=60.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds between polls."
)
@click.option(
    "--once",
    is_flag=True,
    help="Score what is complete now (two looks min(interval, 2 s) apart), write --out/report.html (also when "
    "nothing was new) and exit: for cron and CI.",
)
@click.option(
    "--baseline",
    "baselines",
    multiple=True,
    metavar="NAME",
    help="A baseline to put every checkpoint beside, repeatable: a name (ngram:vllm:k=4, draft:PATH:n=4) or an "
    "engine's settings .json, as `score --ckpt` takes them. Scored once first; each checkpoint's line is "
    "followed by its pooled chain tau against each baseline's with the paired 95% interval.",
)
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("--quiet", is_flag=True, help="No progress bars; only the line of each scored checkpoint and problems.")
@click.option("--tensorboard", default=None, metavar="DIR", help="Log to TensorBoard event files in DIR.")
@click.option("--wandb-project", default=None, metavar="P", help="Log to this Weights & Biases project.")
@click.option("--wandb-run-id", default=None, metavar="ID", help="W&B run to append to (e.g. the training run's).")
@click.option("--mlflow-uri", default=None, metavar="URI", help="Log to this MLflow tracking URI.")
@click.option("--mlflow-run-id", default=None, metavar="ID", help="MLflow run to append to.")
def watch(ckpts, shards, out, interval, once, baselines, no_progress, quiet, **options):
    """Score every checkpoint of a training run as it lands, once each, oldest step first.

    A checkpoint is scored when it is complete (config and weights present, every indexed shard
    present, headers readable, sizes and mtimes unchanged since the previous poll); one being
    written, truncated or corrupt is reported once and looked at again at each poll. Results go
    where `score` puts them, and they are the only state: a restart skips what is scored. After
    each checkpoint: one line (step, tau chain, best DDTree, change against the previous step
    with its 95% paired-bootstrap interval; with --baseline, one line per baseline: "step 4000: tau
    2.91 vs ngram:vllm:k=4 1.38, +1.53 [+1.41, +1.66]"), --out/report.html rewritten, the loggers fed.
    Ctrl-C or SIGTERM stops it cleanly (exit 130/143); the checkpoint being scored is redone
    by the next run.

    \b
    Example, beside a trainer:
      specreplay watch --ckpt 'runs/run7/step_*' --shards data/shards/smollm2 --out results/run7 \\
          --sample 64 --ddtree-budgets 16,64 --tensorboard runs/run7/logs
    """
    from scoring.track.watch import WatchOptions, run_watch
    from specreplay.hints import program
    from specreplay.progress import bars

    loggers = logger_options({name: options.pop(name) for name in LOGGER_OPTIONS})
    config = score_config(list(ckpts), shards, out, options)
    watch_options = WatchOptions(
        interval=interval,
        once=once,
        quiet=quiet,
        loggers=loggers,
        progress=bars(no_progress or quiet),
        echo=click.echo,
        warn=lambda line: click.echo(line, err=True),
        program=program(),
        baselines=tuple(baselines),
    )
    result = run_watch(config, watch_options)
    if once and result.stopped_by is None:
        click.echo(once_summary(result))
    if result.stopped_by is not None:
        # a signal: the cleanup has run, so end now; interpreter exit could wait on a library's
        # worker thread, and a scheduler's SIGTERM must end the process (seen once in a fresh clone)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(result.exit_code)
    sys.exit(result.exit_code)


def score_config(ckpts: list[str], shards: str, out: str, options: dict) -> ScoreConfig:
    """The ScoreConfig of the shared score options, parsed as `score` parses them."""
    datasets = [name.strip() for name in (options["datasets"] or "").split(",") if name.strip()]
    options.update(
        tree_nodes=parse_tree_nodes(options["tree_nodes"]),
        memory_bytes=parse_size(options["memory_bytes"], "--memory-budget"),
        datasets=datasets or None,
    )
    from pipeline.common.paths import check_input_path, check_output_dir

    check_input_path(shards, "--shards", "directory")
    check_output_dir(out, "--out")
    return ScoreConfig(ckpts=ckpts, shards=shards, out=out, **options)


def logger_options(given: dict):
    """scoring.track.loggers.LoggerOptions when any logger option is given (only then is it imported)."""
    if all(value is None for value in given.values()):
        return None
    from scoring.track.loggers import LoggerOptions

    return LoggerOptions(**given)


def once_summary(result) -> str:
    """The last line of a --once run: what it did and what it left."""
    parts = [f"{len(result.scored)} scored", f"{len(result.skipped)} already scored"]
    if result.waiting:
        parts.append(f"{len(result.waiting)} incomplete, not scored ({', '.join(result.waiting)})")
    if result.failed:
        parts.append(f"{len(result.failed)} failed")
    return "once: " + ", ".join(parts)


# Placed after --out, in score's order, so --help reads like score's.
watch.params[3:3] = [param for param in score_command.params if param.name in SHARED_OPTIONS]
