"""Click commands of stage 2: `score` and `fit`."""

from __future__ import annotations

import click

from pipeline.shards import ShardError
from pipeline.sizes import parse_size


def _parse_budgets(text: str) -> list[int]:
    try:
        budgets = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as error:
        raise click.BadParameter(f"expected comma-separated integers like 4,8,16; got {text!r}") from error
    if any(b < 1 for b in budgets):
        raise click.BadParameter("DDTree budgets must be >= 1")
    return budgets


@click.command()
@click.option("--ckpt", "ckpts", multiple=True, required=True,
              help="Drafter checkpoint: a z-lab directory (config.json + safetensors) or a training "
                   "checkpoint (.safetensors/.pt + config.json beside it). Repeat it or pass a quoted glob "
                   "('runs/*/step_*') to score several; each gets its own results directory.")
@click.option("--shards", required=True, help="Extract output directory (local path or pyarrow.fs URI).")
@click.option("--out", required=True, help="Results directory (one checkpoint) or parent of one per checkpoint.")
@click.option("--ddtree-budgets", default="4,8,16,32,64,128,256", show_default=True,
              help="DDTree node budgets to simulate; empty string for chain only.")
@click.option("--device", default="auto", show_default=True, help="auto (GPU if present), cpu, cuda, cuda:1 ...")
@click.option("--dtype", default="auto", show_default=True, help="auto = fp32 on CPU, bf16 on GPU; or fp32/bf16/fp16.")
@click.option("--memory-budget", default="2GiB", show_default=True,
              help="Working memory for one batch of anchors; sets the chunk sizes.")
@click.option("--attention", type=click.Choice(["auto", "dense", "flex"]), default="auto", show_default=True,
              help="auto = block-sparse flex_attention on CUDA, dense explicit masks on CPU.")
@click.option("--anchors", "anchor_set", type=click.Choice(["all", "walk"]), default="all", show_default=True,
              help="all: every response position (walk numbers plus dense all-anchor metrics); walk: only the "
                   "anchors the simulated walks visit (same walk numbers, about tau times less drafter work).")
@click.option("--limit", type=int, default=None, help="Score only the first N samples.")
@click.option("--force", is_flag=True, help="Re-score checkpoints already scored on these shards.")
@click.option("--quiet", is_flag=True, help="No progress bars or summary table.")
def score(ckpts, shards, out, ddtree_budgets, device, dtype, memory_budget, attention, anchor_set, limit, force,
          quiet):
    """Replay stored shards through drafter checkpoints; write exact acceptance metrics.

    Writes anchors.parquet, walk.parquet, samples.parquet, summary.parquet and run.json, and
    prints tau for the chain and each DDTree budget.

    \b
    Example:
      specreplay score --ckpt runs/drafter/step_2000 --shards data/shards/smollm2-default \\
          --out data/results/step_2000
      specreplay score --ckpt 'runs/drafter/step_*' --shards data/shards/smollm2-default --out data/results
    """
    from scoring.checkpoint import CheckpointError, CompatibilityError
    from scoring.drafter import DrafterConfigError
    from scoring.score import ScoreConfig, run_score

    config = ScoreConfig(
        ckpts=list(ckpts), shards=shards, out=out, ddtree_budgets=_parse_budgets(ddtree_budgets),
        device=device, dtype=dtype, memory_budget=parse_size(memory_budget, "--memory-budget"), attention=attention, anchors=anchor_set,
        limit=limit,
        force=force, quiet=quiet,
    )
    try:
        run_score(config)
    except (ShardError, CheckpointError, CompatibilityError, DrafterConfigError, FileNotFoundError, ValueError) as error:
        raise click.ClickException(str(error)) from error


@click.command()
@click.option("--shards", required=True, help="Extract output directory to train on.")
@click.option("--out", required=True, help="Directory for checkpoints: OUT/step_<N>/ (z-lab format).")
@click.option("--steps", default=300, show_default=True, help="Optimizer steps.")
@click.option("--save-every", default=0, show_default=True, help="Also save every N steps (0: final only).")
@click.option("--layers", default=1, show_default=True, help="Drafter decoder layers.")
@click.option("--block-size", default=8, show_default=True, help="Block size B (drafts B - 1 tokens per step).")
@click.option("--layer-ids", default=None, help="Target feature layers to use (default: every stored layer).")
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--anchors-per-step", default=8, show_default=True,
              help="Anchors per optimizer step; the lm_head over the full vocabulary dominates the cost.")
@click.option("--seed", default=0, show_default=True)
@click.option("--quiet", is_flag=True)
def fit(shards, out, steps, save_every, layers, block_size, layer_ids, lr, anchors_per_step, seed, quiet):
    """Fit a small DFlash drafter to stored shards (a demo/test tool, not a trainer).

    \b
    Example:
      specreplay fit --shards data/shards/smollm2-default --out runs/tiny --steps 600 --save-every 300
    """
    from tqdm import tqdm

    from pipeline.layer_ids import parse_layer_ids
    from pipeline.shards import ShardSet
    from scoring.fit import FitOptions, fit_drafter, new_drafter_config

    try:
        shardset = ShardSet(shards)
        settings = shardset.settings
        ids = parse_layer_ids(layer_ids) if layer_ids else list(settings["layer_ids"])
        raw = new_drafter_config(settings["target"], num_layers=layers, block_size=block_size, layer_ids=ids)
        missing = sorted(set(raw["dflash_config"]["target_layer_ids"]) - set(settings["layer_ids"]))
        if missing:
            raise ValueError(f"feature layers {missing} are not stored in {shards} (stored: {settings['layer_ids']}); "
                             f"pass --layer-ids from the stored ones")
        samples = list(shardset.samples(tensors=["features"]))
        head = {k: v.float() for k, v in shardset.target_head().items()}
    except (ShardError, ValueError) as error:
        raise click.ClickException(str(error)) from error
    bar = tqdm(total=steps, desc="fit", disable=quiet, dynamic_ncols=True)

    def progress(step, loss):
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    _, written = fit_drafter(samples, head, settings["layer_ids"], raw, out,
                             FitOptions(steps=steps, lr=lr, anchors_per_step=anchors_per_step, seed=seed,
                                        save_every=save_every), progress)
    bar.close()
    for path in written:
        click.echo(f"wrote {path}")
    if written:
        click.echo(f"next: specreplay score --ckpt {written[-1]} --shards {shards} --out data/results/{out.rstrip('/').split('/')[-1]}")
