"""`specreplay diagnose`: which convention, if any, makes a checkpoint's acceptance low
(scoring/diagnose/run.py)."""

from __future__ import annotations

import click

from pipeline.common.sizes import format_size, parse_size
from scoring.config import DEFAULT_DIAGNOSE_SAMPLES, DiagnoseConfig
from specreplay.commands.defaults import default


def d(name: str):
    return default(DiagnoseConfig, name)


VARIANT_HELP = (
    "positions+1, positions-1 (block position ids start at t+1 / t-1), context+1, context-1 (context "
    "covers 0..t / 0..t-2), layers-1, layers+1 (feature layer ids shifted; need `extract --neighbour-layers`), "
    "no-window, window-everywhere, causal-block, scales (embedding/output scales at 1), bf16 (precision probe)"
)


@click.command(context_settings={"max_content_width": 100})
@click.option("--ckpt", required=True, help="The drafter checkpoint whose acceptance looks wrong.")
@click.option("--shards", required=True, help="Extract output directory the checkpoint is scored on.")
@click.option("--out", default=d("out"), show_default=True, help="Parent of the output: writes --out/<parent>_<name>/.")
@click.option(
    "--limit",
    type=int,
    default=None,
    help=f"Samples to replay, drawn with --seed and spread over the datasets [default: {DEFAULT_DIAGNOSE_SAMPLES}, "
    "80 s at SmolLM2-135M shapes on 2 CPU cores].",
)
@click.option("--seed", type=int, default=d("seed"), show_default=True, help="Seed of the sample draw and bootstrap.")
@click.option(
    "--variants",
    default=None,
    help=f"Comma-separated subset to replay besides as-configured [default: every one that applies]: {VARIANT_HELP}.",
)
@click.option("--device", default=d("device"), show_default=True, help="auto (GPU if present), cpu, cuda, ...")
@click.option("--dtype", default=d("dtype"), show_default=True, help="Compute dtype of as-configured (fp32, bf16).")
@click.option(
    "--memory-budget",
    "memory_bytes",
    default=format_size(d("memory_bytes")),
    show_default=True,
    help="Working memory for one batch of anchors.",
)
@click.option("--force", is_flag=True, help="Replace an earlier diagnosis in the same directory.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def diagnose(no_progress, **options):
    """Find out which convention, if any, a checkpoint with low acceptance was trained under.

    Replays the same samples under the checkpoint's configuration and under each variant (one
    convention changed at a time), and prints chain tau, the all-anchor streak and acceptance at
    block position 1 for each, with the change from as-configured and a paired-bootstrap 95%
    interval over samples. The verdict names a variant only when its tau interval lies above
    zero; otherwise it calls the configuration consistent and shows where acceptance dies.
    Writes diagnose.parquet and diagnose.json (shown by `specreplay report`). Never changes how
    `score` scores.

    \b
    Example:
      specreplay diagnose --ckpt runs/tiny/step_600 --shards data/shards/smollm2-default
      specreplay diagnose --ckpt runs/tiny/step_600 --shards data/shards/smollm2-neighbours --variants layers-1,layers+1
    """
    from pipeline.common.paths import check_input_path, check_output_dir, check_roles
    from scoring.diagnose.run import run_diagnose
    from scoring.diagnose.variants import parse_variants
    from scoring.diagnose.view import console_lines, load
    from specreplay.hints import program
    from specreplay.progress import bars

    variants = parse_variants(options["variants"])[1:] if options["variants"] else None
    options.update(variants=variants, memory_bytes=parse_size(options["memory_bytes"], "--memory-budget"))
    config = DiagnoseConfig(**options)
    check_input_path(config.shards, "--shards", "directory")
    check_roles([config.ckpt], config.shards)
    check_output_dir(config.out, "--out")
    diagnosis = run_diagnose(config, progress=bars(no_progress), program=program())
    rows, record = load(diagnosis.out_dir)
    click.echo("\n".join(console_lines(rows, record, diagnosis.out_dir)))
    click.echo(
        f"next: {program()} report data/results {config.out} --out report.html   "
        "# the diagnosis beside your score results (use your score --out)"
    )
