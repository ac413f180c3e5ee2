"""`specreplay compare A B`: the console report and files around scoring/compare/run.py's statistics.

Console order: the headline (pooled chain tau, one sentence) first on stdout; the warnings on
stderr; then which directories, the definitions, the tau table, the all-anchor streak table,
the footnotes and how many intervals were computed (with how many would exclude zero by chance).
"""

from __future__ import annotations

import json
import os
import warnings

import click

TABLE_COLUMNS = ("dataset", "method", "n", "tau_a", "tau_b", "delta", "ci_low", "ci_high", "verdict")
STREAK_COLUMNS = {  # console header -> comparison column
    "dataset": "dataset",
    "method": "method",
    "n": "streak_n",
    "anchors": "streak_anchors",
    "streak_a": "streak_a",
    "streak_b": "streak_b",
    "delta": "streak_delta",
    "ci_low": "streak_ci_low",
    "ci_high": "streak_ci_high",
    "verdict": "streak_verdict",
}
COUNT_COLUMNS = ("dropped_null", "unmatched", "differing")


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _render(headers: list[str], cells: list[list[str]]) -> str:
    from scoring.score.console import aligned

    return "\n".join(aligned(headers, cells, left={"dataset", "method", "verdict"}))


def format_table(rows: list[dict]) -> str:
    """The tau table: TABLE_COLUMNS (with dropped_null / unmatched / differing after n when any
    row has some), numbers to 3 decimals, verdict left-aligned last."""
    counts = [c for c in COUNT_COLUMNS if any(r.get(c) for r in rows)]
    columns = list(TABLE_COLUMNS[:3]) + counts + list(TABLE_COLUMNS[3:])
    return _render(columns, [[_cell(r.get(c)) for c in columns] for r in rows])


def format_streak_table(rows: list[dict]) -> str:
    """The all-anchor streak table: STREAK_COLUMNS, one row per (dataset, method) with a streak."""
    kept = [r for r in rows if r.get("streak_verdict") is not None]
    return _render(list(STREAK_COLUMNS), [[_cell(r.get(c)) for c in STREAK_COLUMNS.values()] for r in kept])


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
@click.option(
    "--allow-different-shards",
    is_flag=True,
    help="Compare results scored on different (or uncheckable) shards; only samples whose tokens match "
    "(samples.parquet tokens_hash) are paired, the others are counted in `differing`.",
)
@click.option("--out", default=None, help="Also write the comparison to this .parquet or .csv file.")
@click.option(
    "--profile",
    "profile_path",
    default=None,
    metavar="PROFILE.json",
    help="A cost profile (`specreplay profile`, docs/speed.md): also each side's fastest configuration and its "
    "predicted speedup per measured batch size.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (rows and warnings) instead of the table.")
def compare(a, b, methods, datasets, resamples, seed, confidence, allow_different_shards, out, profile_path, as_json):
    """Is checkpoint B better than A? tau difference B - A per dataset and method, with a
    paired bootstrap confidence interval over samples and a plain-words verdict; the same for
    the all-anchor streak (anchors.parquet). The first line is the pooled chain verdict.

    A and B are results directories written by `specreplay score` (each holds samples.parquet;
    a directory holding one checkpoint's results directory, or duplicates of one, is accepted).
    They must have been scored on the same shards (run.json shards.identity), unless
    --allow-different-shards. Samples are paired by (dataset, sample_id) and equal tokens
    (tokens_hash); a pair where either run has no tau (the sample had no walk step) is dropped
    and counted in `dropped_null`.

    \b
    Example:
      specreplay compare data/results/runs_step_150 data/results/runs_step_300
      specreplay compare A B --method chain --dataset gsm8k --out compare.csv
    """
    from scoring.compare.run import run_comparison

    profile = None
    if profile_path is not None:
        from scoring.speed.profile import load_profile

        profile = load_profile(profile_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comparison = run_comparison(
            a,
            b,
            methods=list(methods) or None,
            datasets=list(datasets) or None,
            resamples=resamples,
            seed=seed,
            confidence=confidence,
            allow_different_shards=allow_different_shards,
        )
    notes = [str(w.message) for w in caught]
    predicted = {}
    if profile is not None:
        from scoring.speed.run import fastest_line

        predicted = {side: fastest_line(d, profile) for side, d in (("A", comparison.dir_a), ("B", comparison.dir_b))}
    rows = comparison.table.to_dicts()
    if out:
        write_table(comparison.table, out)
    if as_json:
        for note in notes:
            click.echo(f"warning: {note}", err=True)
        payload = as_payload(comparison, a, b, resamples, seed, allow_different_shards, notes)
        click.echo(json.dumps({**payload, "predicted_speed": predicted} if predicted else payload, indent=1))
    else:
        click.echo(comparison.headline)
        for note in notes:
            click.echo(f"warning: {note}", err=True)
        _print_report(comparison, rows, resamples, seed)
        for side, line in predicted.items():
            click.echo(f"{side}: {line}")
    if out:
        click.echo(f"wrote {out}", err=as_json)


def as_payload(comparison, a: str, b: str, resamples: int, seed: int, allow: bool, notes: list) -> dict:
    """The --json object: inputs, settings, what the report says, warnings and every row."""
    return {
        "a": a,
        "b": b,
        **comparison.payload(),
        "confidence": comparison.confidence,
        "resamples": resamples,
        "seed": seed,
        "allow_different_shards": allow,
        "warnings": notes,
        "rows": comparison.table.to_dicts(),
    }


def _print_report(comparison, rows: list[dict], resamples: int, seed: int) -> None:
    from scoring.compare.run import chance_note

    c = comparison
    click.echo(f"A: {c.checkpoint_a} ({c.dir_a}; checkpoint_hash {c.checkpoint_hash_a or 'unknown'})")
    click.echo(f"B: {c.checkpoint_b} ({c.dir_b}; checkpoint_hash {c.checkpoint_hash_b or 'unknown'})")
    click.echo("tau = mean over paired samples of each sample's tokens per walk step (accepted + bonus); delta = B - A")
    click.echo(f"{c.confidence * 100:g}% CI: paired bootstrap over samples ({resamples} resamples, seed {seed})")
    click.echo("")
    click.echo(format_table(rows))
    click.echo("")
    if c.streak_compared and any(r["streak_verdict"] is not None for r in rows):
        click.echo(
            "all-anchor streak = accepted draft tokens per anchor (bonus-exclusive), over the anchors both runs "
            "scored of the paired samples"
        )
        click.echo(format_streak_table(rows))
    else:
        click.echo(f"all-anchor streak: not compared ({c.streak_missing or 'no method has it in both runs'})")
    click.echo("")
    if any(r["dropped_null"] for r in rows):
        click.echo("dropped_null: pairs left out because a run has no tau for the sample (no walk step)")
    if any(r["unmatched"] for r in rows):
        click.echo("unmatched: samples in only one run, left out")
    if any(r["differing"] for r in rows):
        click.echo(
            f"differing: {c.differing_samples} sample(s) whose prompt or response differ between A and B "
            f"(samples.parquet tokens_hash, or prompt_len / response_len / prompt_text where a run lacks it), never paired"
        )
    click.echo(chance_note(c.intervals, c.confidence))
