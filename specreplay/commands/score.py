"""`specreplay score`: replay shards through drafter checkpoints (stage 2, scoring/score.py)."""

from __future__ import annotations

import click

from pipeline.errors import UserError
from pipeline.sizes import format_size, parse_size
from scoring.config import ScoreConfig
from specreplay.commands.defaults import default


def parse_tree_nodes(text: str) -> list[int]:
    """'4,8,16' -> [4, 8, 16]; '' -> [] (chain only)."""
    try:
        budgets = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--ddtree-budgets: expected comma-separated integers like 4,8,16; got {text!r}") from None
    if any(b < 1 for b in budgets):
        raise UserError(f"--ddtree-budgets {text!r}: DDTree budgets (tree nodes) must be >= 1")
    return budgets


def d(name: str):
    return default(ScoreConfig, name)


@click.command(context_settings={"max_content_width": 100})
@click.option(
    "--ckpt",
    "ckpts",
    multiple=True,
    required=True,
    help="Drafter checkpoint: a z-lab directory (config.json + safetensors) or a training "
    "checkpoint (.safetensors/.pt + config.json beside it). Repeat it or pass a quoted glob "
    "('runs/*/step_*') to score several; each gets its own results directory.",
)
@click.option("--shards", required=True, help="Extract output directory (local path or pyarrow.fs URI).")
@click.option("--out", required=True, help="Results directory (one checkpoint) or parent of one per checkpoint.")
@click.option(
    "--ddtree-budgets",
    "tree_nodes",
    default=",".join(map(str, d("tree_nodes"))),
    show_default=True,
    help="DDTree budgets (nodes per tree) to simulate; empty string for chain only.",
)
@click.option("--device", default=d("device"), show_default=True, help="auto (GPU if present), cpu, cuda, cuda:1 ...")
@click.option(
    "--dtype", default=d("dtype"), show_default=True, help="auto = fp32 on CPU, bf16 on GPU; or fp32/bf16/fp16."
)
@click.option(
    "--memory-budget",
    "memory_bytes",
    default=format_size(d("memory_bytes")),
    show_default=True,
    help="Working memory for one batch of anchors; sets the chunk sizes.",
)
@click.option(
    "--attention",
    type=click.Choice(["auto", "dense", "flex"]),
    default=d("attention"),
    show_default=True,
    help="auto = block-sparse flex_attention on CUDA, dense explicit masks on CPU.",
)
@click.option(
    "--anchors",
    "anchors",
    type=click.Choice(["all", "walk"]),
    default=d("anchors"),
    show_default=True,
    help="all: every response position (walk numbers plus dense all-anchor metrics); walk: only the "
    "anchors the simulated walks visit (same walk numbers, about tau times less drafter work).",
)
@click.option("--limit", type=int, default=None, help="Score only the first N samples.")
@click.option("--force", is_flag=True, help="Re-score checkpoints already scored on these shards.")
@click.option("--quiet", is_flag=True, help="No progress bars or summary table.")
def score(**options):
    """Replay stored shards through drafter checkpoints; write exact acceptance metrics.

    Writes anchors.parquet, walk.parquet, samples.parquet, summary.parquet and run.json, and
    prints tau for the chain and each DDTree budget.

    \b
    Example:
      specreplay score --ckpt runs/drafter/step_2000 --shards data/shards/smollm2-default \\
          --out data/results/step_2000
      specreplay score --ckpt 'runs/drafter/step_*' --shards data/shards/smollm2-default --out data/results
    """
    from scoring.score import run_score
    from specreplay.progress import bars

    options.update(
        ckpts=list(options["ckpts"]),
        tree_nodes=parse_tree_nodes(options["tree_nodes"]),
        memory_bytes=parse_size(options["memory_bytes"], "--memory-budget"),
    )
    run_score(ScoreConfig(**options), progress=bars(options["quiet"]))
