"""`specreplay report`: results directories in, one self-contained HTML file out (scoring/report/page.py)."""

from __future__ import annotations

import click


def check_report_out(out: str) -> None:
    """--out is the HTML file: an existing directory there is refused before anything is read."""
    import os

    from pipeline.common.errors import UserError

    if os.path.isdir(out):
        raise UserError(
            f"--out {out} is a directory; give the HTML file to write, e.g. --out {os.path.join(out, 'report.html')}"
        )


@click.command(context_settings={"max_content_width": 100})
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--out", default="report.html", show_default=True, help="HTML file to write (parent directories are created)."
)
@click.option("--title", default=None, help="Page title (default: 'specreplay report').")
@click.option(
    "--worst",
    default=10,
    show_default=True,
    type=click.IntRange(min=0),
    help="How many lowest-tau prompts to list (0: none).",
)
@click.option(
    "--sample-views",
    "sample_views",
    default=3,
    show_default=True,
    type=click.IntRange(min=0),
    help="How many worst and how many best samples (by chain tau) to show token by token (0: only --sample ones).",
)
@click.option(
    "--sample",
    "samples",
    multiple=True,
    metavar="ID",
    help="Also show this sample token by token; repeatable. ID is the sample id as the report's Sample column "
    "shows it (the prompt record's id, e.g. gsm8k/0003 in the bundled sets; on sampled shards each draw adds "
    "#K, e.g. gsm8k/0003#0), or DATASET/ID when one id is in two datasets.",
)
@click.option(
    "--shards",
    default=None,
    metavar="DIR",
    help="Where the scored shards are now, when they moved since scoring (default: the path in run.json).",
)
@click.option(
    "--tokenizer",
    default=None,
    metavar="PATH",
    help="Tokenizer directory for the token view (default: the one extract saved under <shards>/tokenizer/).",
)
@click.option(
    "--profile",
    "profile_path",
    default=None,
    metavar="PROFILE.json",
    help="A cost profile (`specreplay profile`, docs/speed.md): adds a Predicted speed section (speedup against "
    "the tokens verified per step, per batch size; the fastest configuration per checkpoint and batch size).",
)
def report(results, out, title, worst, sample_views, samples, shards, tokenizer, profile_path):
    """Write one self-contained HTML report (plots embedded, opens offline) from score results.

    RESULTS are directories written by `specreplay score`, or parents holding several: every
    summary.parquet below them is included, once per checkpoint (a checkpoint scored twice on the
    same shards is listed once: the run on the most samples, then the most recent). The report has
    a summary table (tau chain, best and per-budget DDTree tau, all-anchor streak, exact walks;
    drafters fitted on the very samples they are scored on are marked), the acceptance-length
    histogram, acceptance per block position, tau against DDTree budget, tau against training
    step, the worst prompts, and the worst and best responses token by token (accepted draft
    tokens, the target's bonus tokens, the drafter's rejected guesses), read from the shards.
    Diagnoses (`specreplay diagnose`) found below RESULTS get a Diagnose section; RESULTS may
    hold diagnoses only.

    \b
    Example:
      specreplay report data/results --out report.html --title "tiny drafter, steps 150-300"
      specreplay report data/results/runs_step_150 data/results/runs_step_300 --worst 20
      specreplay report data/results --sample gsm8k/0003 --shards /new/place/of/shards
      specreplay report data/results data/diagnose       # with the diagnoses beside the results
    """
    from scoring.report.page import SampleViews, write_report

    check_report_out(out)
    views = SampleViews(count=sample_views, ids=list(samples), shards=shards, tokenizer=tokenizer)
    profile = None
    if profile_path is not None:
        from scoring.speed.profile import load_profile

        profile = load_profile(profile_path)
    written = write_report(list(results), out, title=title, worst=worst, views=views, profile=profile)
    for duplicate in written.duplicates:
        click.echo(
            f"skipped {duplicate.skipped}: same checkpoint (hash {duplicate.checkpoint_hash}) on the same shards "
            f"as {duplicate.kept} ({duplicate.reason})"
        )
    click.echo(f"wrote {written.path}")
    for sample, anchor in written.sample_anchors.items():
        click.echo(f"sample {sample}: file://{written.path}{anchor}")
