"""`specreplay compare A B`: the console table and files around scoring/compare.py's statistics."""

from __future__ import annotations

import json
import os
import warnings

import click

TABLE_COLUMNS = ("dataset", "method", "n", "tau_a", "tau_b", "delta", "ci_low", "ci_high", "verdict")


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def format_table(rows: list[dict]) -> str:
    """The console table: TABLE_COLUMNS (with dropped_null / unmatched after n when any row has
    some), numbers to 3 decimals, verdict left-aligned last."""
    counts = [c for c in ("dropped_null", "unmatched") if any(r[c] for r in rows)]
    columns = list(TABLE_COLUMNS[:3]) + counts + list(TABLE_COLUMNS[3:])
    cells = [[_cell(r[c]) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    left = {"dataset", "method", "verdict"}

    def line(values):
        parts = [v.ljust(w) if c in left else v.rjust(w) for c, v, w in zip(columns, values, widths)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(columns)] + [line(row) for row in cells])


def write_table(df, path: str) -> None:
    """Write the comparison as parquet or CSV, chosen by the extension of path."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".parquet", ".csv"):
        raise click.BadParameter(f"{path}: use a .parquet or .csv file name", param_hint="--out")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if ext == ".csv":
        df.write_csv(path)
    else:
        df.write_parquet(path)


@click.command()
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.option(
    "--method",
    "methods",
    multiple=True,
    help="Only this method (chain, ddtree-16, ...); repeat for several. Default: every method in both.",
)
@click.option(
    "--dataset",
    "datasets",
    multiple=True,
    help="Only this dataset (or '(all)'); repeat for several. Default: every dataset and '(all)'.",
)
@click.option("--resamples", default=2000, show_default=True, help="Bootstrap resamples.")
@click.option("--seed", default=0, show_default=True, help="Bootstrap random seed (results are reproducible).")
@click.option("--confidence", default=0.95, show_default=True, help="Confidence level of the interval.")
@click.option("--out", default=None, help="Also write the comparison to this .parquet or .csv file.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (rows and warnings) instead of the table.")
def compare(a, b, methods, datasets, resamples, seed, confidence, out, as_json):
    """Is checkpoint B better than A? tau difference B - A per dataset and method, with a
    paired bootstrap confidence interval over samples and a plain-words verdict.

    A and B are results directories written by `specreplay score` (each holds samples.parquet).
    Samples are paired by (dataset, sample_id); a pair where either run has no tau (the sample
    had no walk step) is dropped and counted in `dropped_null`.

    \b
    Example:
      specreplay compare data/results/runs_step_150 data/results/runs_step_300
      specreplay compare A B --method chain --dataset gsm8k --out compare.csv
    """
    from scoring.compare import compare_results

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = compare_results(
            a,
            b,
            methods=list(methods) or None,
            datasets=list(datasets) or None,
            resamples=resamples,
            seed=seed,
            confidence=confidence,
        )
    notes = [str(w.message) for w in caught]
    for note in notes:
        click.echo(f"warning: {note}", err=True)
    rows = df.to_dicts()
    if out:
        write_table(df, out)
    if as_json:
        click.echo(json.dumps(as_payload(rows, a, b, resamples, seed, confidence, notes), indent=1))
    else:
        _print_report(rows, a, b, resamples, seed, confidence)
    if out:
        click.echo(f"wrote {out}", err=as_json)


def as_payload(rows: list[dict], a: str, b: str, resamples: int, seed: int, confidence: float, notes: list) -> dict:
    """The --json object: inputs, settings, warnings and every row."""
    first = rows[0] if rows else {}
    return {
        "a": a,
        "b": b,
        "checkpoint_a": first.get("checkpoint_a"),
        "checkpoint_b": first.get("checkpoint_b"),
        "confidence": confidence,
        "resamples": resamples,
        "seed": seed,
        "warnings": notes,
        "rows": rows,
    }


def _print_report(rows: list[dict], a: str, b: str, resamples: int, seed: int, confidence: float) -> None:
    if rows:
        click.echo(f"A: {rows[0]['checkpoint_a']} ({a})")
        click.echo(f"B: {rows[0]['checkpoint_b']} ({b})")
    click.echo("tau = mean over paired samples of each sample's tokens per walk step (accepted + bonus); delta = B - A")
    click.echo(f"{confidence * 100:g}% CI: paired bootstrap over samples ({resamples} resamples, seed {seed})")
    click.echo(format_table(rows))
    if any(r["dropped_null"] for r in rows):
        click.echo("dropped_null: pairs left out because a run has no tau for the sample (no walk step)")
    if any(r["unmatched"] for r in rows):
        click.echo("unmatched: samples in only one run, left out")
