"""`specreplay speed RESULTS... --profile P`: predicted tokens per second and speedup of every
scored configuration at each measured batch size, the fastest per batch size named
(scoring/speed/; the formula and what it leaves out: docs/speed.md)."""

from __future__ import annotations

import json

import click

COLUMNS = {  # console header -> prediction field
    "checkpoint": "checkpoint",
    "method": "method",
    "tau": "tau",
    "verified": "verified",
    "step ms": "step_s",
    "tokens/s": "tokens_per_s",
    "plain tokens/s": "plain_tokens_per_s",
    "speedup": "speedup",
}


def cell(field: str, value) -> str:
    if field == "step_s":
        return f"{value * 1000:.2f}"
    if field in ("tokens_per_s", "plain_tokens_per_s"):
        return f"{value:.1f}"
    if field in ("tau", "speedup"):
        return f"{value:.3f}"
    return str(value)


def batch_lines(rows: list[dict], batch: int) -> list[str]:
    """The table of one batch size, the fastest configuration marked with '*'."""
    from scoring.score.console import aligned

    mine = [r for r in rows if r["batch"] == batch]
    cells = [[cell(f, r[f]) + ("*" if f == "speedup" and r["best"] else "") for f in COLUMNS.values()] for r in mine]
    best = next(r for r in mine if r["best"])
    head = f"batch {batch}: fastest {best['checkpoint']} {best['method']}, {best['speedup']:.2f}x over plain decoding"
    return [head, *aligned(list(COLUMNS), cells, left={"checkpoint", "method"}), ""]


def print_synthetic(paths: list[str], engine: str) -> None:
    """Each results directory's acceptance as the engine's synthetic setting, one line each."""
    from pipeline.common.errors import UserError
    from scoring import results
    from scoring.speed.export import llama_cpp_flag, vllm_synthetic

    directories = [d for path in paths for d in results.results_dirs_below(path)]
    if not directories:
        raise UserError(f"no results directory (with {results.FILES['summary']}) under {', '.join(paths)}")
    for directory in directories:
        setting = llama_cpp_flag(directory) if engine == "llama.cpp" else json.dumps(vllm_synthetic(directory))
        click.echo(f"{directory}: {setting}")


@click.command()
@click.argument("results_paths", metavar="RESULTS...", nargs=-1, required=True)
@click.option(
    "--profile",
    "profile_path",
    default=None,
    metavar="PROFILE.json",
    help="Cost profile of the serving side: the target's verification forward and each drafter's forward "
    "by batch size and tokens per sequence (`specreplay profile`; docs/speed.md declares it). Needed except "
    "for --export llama.cpp / vllm.",
)
@click.option(
    "--export",
    "export",
    type=click.Choice(["llama.cpp", "vllm", "vllm-dynamic"]),
    default=None,
    help="Print the acceptance in an engine's own synthetic form instead, to time a serving stack at exactly "
    "it: llama.cpp = llama-server's --spec-synth-rates, vllm = vLLM's synthetic rejection sampler rates (one "
    "per results directory); vllm-dynamic = vLLM's num_speculative_tokens_per_batch_size, the fastest K per "
    "batch size among results of one drafter at several K (needs --profile).",
)
@click.option(
    "--batch",
    "batches",
    type=click.IntRange(min=1),
    multiple=True,
    help="Only this batch size (one the profile measured); repeat for several. Default: every measured one.",
)
@click.option(
    "--method",
    "methods",
    multiple=True,
    help="Only this method (chain, ddtree-16, eagle-tree-4x5-8, ...); repeat for several. Default: every scored one.",
)
@click.option("--out", default=None, help="Also write every prediction to this .parquet or .csv file.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the profile's measurement and every row).")
def speed(results_paths, profile_path, export, batches, methods, out, as_json):
    """Which configuration is fastest at each batch size, and by how much? From each results
    directory's exact tau (summary.parquet, pooled over datasets) and a measured cost profile:
    step time = the target verifying the step's tokens + the drafter's forwards; tokens/s =
    batch x tau / step time; speedup over plain decoding at the same batch size.

    It leaves out the spread of acceptance within a batch, scheduling and sampling overheads
    (docs/speed.md says each).

    \b
    Example:
      specreplay speed data/results --profile my-gpu.json
      specreplay speed data/results/run7_step_300 --export llama.cpp   # llama-server --spec-synth-rates
      specreplay speed data/results/runs_step_300 --profile my-gpu.json --batch 1 --batch 8 --out speed.csv
    """
    from scoring.speed.predict import as_rows
    from scoring.speed.profile import load_profile
    from scoring.speed.run import predict_results
    from specreplay.commands.compare import write_table

    if export in ("llama.cpp", "vllm"):
        print_synthetic(list(results_paths), export)
        return
    if profile_path is None:
        raise click.UsageError("give --profile (measure one with `specreplay profile`)")
    profile = load_profile(profile_path)
    if export == "vllm-dynamic":
        from scoring.speed.export import vllm_dynamic

        click.echo(
            json.dumps(vllm_dynamic(predict_results(list(results_paths), profile, list(batches) or None, ["chain"])))
        )
        return
    rows = as_rows(predict_results(list(results_paths), profile, list(batches) or None, list(methods) or None))
    if out:
        import polars as pl

        write_table(pl.DataFrame(rows), out)
    if as_json:
        click.echo(json.dumps({"profile": profile_path, "measured": profile.file.measured.model_dump(), "rows": rows}))
        return
    m = profile.file.measured
    click.echo(f"profile {profile_path}: {m.engine} on {m.device}, context {m.context_len} tokens")
    for batch in sorted({r["batch"] for r in rows}):
        for line in batch_lines(rows, batch):
            click.echo(line)
    if out:
        click.echo(f"wrote {out}")
