"""`specreplay diagnose`: which convention, if any, makes a checkpoint's acceptance low
(scoring/diagnose/run.py)."""

from __future__ import annotations

import os

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
@click.option(
    "--family",
    default=None,
    metavar="NAME[:LAYOUT]",
    help="Read the checkpoint's config as this family's (and layout's) instead of detecting it, as score --family.",
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
    Example (after `make demo`):
      specreplay diagnose --ckpt data/demo/runs/tiny/step_600 --shards data/demo/shards --out data/demo/diagnose
      specreplay diagnose --ckpt data/demo/runs/tiny/step_600 --shards data/demo/shards-neighbours \\
          --variants layers-1,layers+1   # shards from the extract command diagnose prints for layers-1
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
    if config.family is not None:
        from proposers.layouts import Override

        Override.parse(config.family)
    check_input_path(config.shards, "--shards", "directory")
    check_roles([config.ckpt], config.shards)
    check_output_dir(config.out, "--out")
    diagnosis = run_diagnose(config, progress=bars(no_progress), program=program())
    rows, record = load(diagnosis.out_dir)
    click.echo("\n".join(console_lines(rows, record, diagnosis.out_dir)))
    click.echo(next_line(config, diagnosis.checkpoint["checkpoint_hash"], program()))


def next_line(config, checkpoint_hash: str, program: str) -> str:
    """The `report` to run next, on directories that exist: the diagnosis beside the checkpoint's
    score results when they are found next to --out, else the diagnosis alone."""
    scored = scored_results_beside(config.ckpt, config.out, checkpoint_hash)
    if scored is None:
        report = os.path.join(config.out, "report.html")
        return (
            f"next: {program} report {config.out} --out {report}   "
            "# add the --out you score this checkpoint into to see the diagnosis beside its results"
        )
    report = os.path.normpath(
        os.path.join(shown_path(os.path.commonpath([scored, os.path.abspath(config.out)])), "report.html")
    )
    return (
        f"next: {program} report {shown_path(scored)} {config.out} --out {report}   # the diagnosis beside the scores"
    )


def scored_results_beside(ckpt: str, out: str, checkpoint_hash: str) -> str | None:
    """The `score --out` holding this checkpoint's results (<out>/<parent>_<name>/run.json of
    the same content), looked for in --out's parent and the directories beside --out; None
    when there is none."""
    import json

    from scoring.results import FILES, result_dir_name

    parent = os.path.dirname(os.path.abspath(out))
    beside = sorted(e.path for e in os.scandir(parent) if e.is_dir() and not e.name.startswith("."))
    for candidate in [parent, *(d for d in beside if d != os.path.abspath(out))]:
        try:
            with open(os.path.join(candidate, result_dir_name(ckpt), FILES["run"])) as f:
                content_hash = (json.load(f).get("checkpoint") or {}).get("content_hash") or ""
        except (OSError, ValueError, AttributeError):
            continue
        if content_hash.startswith(checkpoint_hash):
            return candidate
    return None


def shown_path(path: str) -> str:
    """`path` relative to the working directory when it is below it, else absolute."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
