"""`specreplay fit`: a small drafter fitted to stored shards (a demo/test tool, scoring/fit.py)."""

from __future__ import annotations

import click

from scoring.config import FitOptions
from specreplay.commands.defaults import default


def d(name: str):
    return default(FitOptions, name)


def next_hint(ckpt: str, shards: str) -> str:
    """How to score the last checkpoint, with the program named as the user can type it.
    `score --out DIR` puts each checkpoint's results in DIR/<parent>_<name>/."""
    from scoring.results import result_dir_name
    from specreplay.hints import in_repository, program, results_dir

    out = results_dir()
    line = f"next: {program()} score --ckpt {ckpt} --shards {shards} --out {out}    # results in {out}/{result_dir_name(ckpt)}"
    return line + (f"\n  (or: make score CKPT={ckpt} SHARDS={shards})" if in_repository() else "")


@click.command(context_settings={"max_content_width": 100})
@click.option("--shards", required=True, help="Extract output directory to train on.")
@click.option("--out", required=True, help="Directory for checkpoints: OUT/step_<N>/ (z-lab format).")
@click.option("--steps", default=d("steps"), show_default=True, help="Optimizer steps.")
@click.option(
    "--save-every", default=d("save_every"), show_default=True, help="Also save every N steps (0: final only)."
)
@click.option("--layers", default=d("layers"), show_default=True, help="Drafter decoder layers.")
@click.option(
    "--block-size", default=d("block_size"), show_default=True, help="Block size B (drafts B - 1 tokens per step)."
)
@click.option("--layer-ids", default=None, help="Target feature layers to use (default: every stored layer).")
@click.option("--lr", default=d("lr"), show_default=True)
@click.option(
    "--anchors-per-step",
    default=d("anchors_per_step"),
    show_default=True,
    help="Anchors per optimizer step; the lm_head over the full vocabulary dominates the cost.",
)
@click.option("--seed", default=d("seed"), show_default=True)
@click.option("--quiet", is_flag=True)
def fit(shards, out, steps, save_every, layers, block_size, layer_ids, lr, anchors_per_step, seed, quiet):
    """Fit a small DFlash drafter to stored shards (a demo/test tool, not a trainer).

    \b
    Example:
      specreplay fit --shards data/shards/smollm2-default --out runs/tiny --steps 600 --save-every 300
    """
    from pipeline.common.layer_ids import parse_layer_ids
    from pipeline.common.paths import check_input_path, check_output_dir
    from scoring.fit import fit_from_shards
    from specreplay.progress import bars

    check_input_path(shards, "--shards", "directory")
    check_output_dir(out, "--out")

    options = FitOptions(
        steps=steps,
        lr=lr,
        anchors_per_step=anchors_per_step,
        seed=seed,
        save_every=save_every,
        layers=layers,
        block_size=block_size,
    )
    make_bar = bars(quiet)
    bar = make_bar(steps, "fit", unit="step") if make_bar is not None else None

    def progress(step, loss):
        if bar is not None:
            bar.update(1, loss=f"{loss:.3f}")

    written = fit_from_shards(shards, out, options, parse_layer_ids(layer_ids) if layer_ids else None, progress)
    if bar is not None:
        bar.close()
    for path in written:
        click.echo(f"wrote {path}")
    if written:
        click.echo(next_hint(written[-1], shards))
