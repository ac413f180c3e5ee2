"""`specreplay report`: results directories in, one self-contained HTML file out (scoring/report.py)."""

from __future__ import annotations

import click


@click.command()
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
def report(results, out, title, worst):
    """Write one self-contained HTML report (plots embedded, opens offline) from score results.

    RESULTS are directories written by `specreplay score`, or parents holding several: every
    summary.parquet below them is included. The report has a summary table (tau chain, tau per
    DDTree budget, all-anchor streak), the acceptance-length histogram, acceptance per block
    position, tau against DDTree budget, tau against training step, and the worst prompts.

    \b
    Example:
      specreplay report data/results --out report.html --title "tiny drafter, steps 150-300"
      specreplay report data/results/runs_step_150 data/results/runs_step_300 --worst 20
    """
    from scoring.report import write_report

    path = write_report(list(results), out, title=title, worst=worst)
    click.echo(f"wrote {path}")
