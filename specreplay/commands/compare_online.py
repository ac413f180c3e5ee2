"""`specreplay compare-online RESULTS --server URL`: the offline walk beside the engine's own counts
(scoring/online/), per sample and, with llama-server's log, per verification step."""

from __future__ import annotations

import json

import click

VERDICT_COLUMNS = ("sample_id", "response", "offline", "online", "step", "verdict")


@click.command("compare-online")
@click.argument("results_dir", metavar="RESULTS")
@click.option("--server", required=True, help="The serving engine's base URL, serving the target with the drafter.")
@click.option(
    "--engine",
    type=click.Choice(["auto", "llama.cpp", "vllm", "sglang"]),
    default="auto",
    show_default=True,
    help="The engine's dialect; auto: what its GET /v1/models says (owned_by).",
)
@click.option(
    "--engine-log",
    default=None,
    help="llama-server's stderr, the server started with LLAMA_TRACE=1: per-step counts (one request at a time).",
)
@click.option("--limit", type=int, default=None, help="Only the first N samples of the results.")
@click.option("--request-timeout", type=float, default=600.0, show_default=True, help="Seconds per request.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary and every sample as JSON instead.")
def compare_online(results_dir, server, engine, engine_log, limit, request_timeout, as_json):
    """Ask a serving engine for every scored sample's response and set its own speculative-decoding
    counts beside the offline walk's, sample by sample: the first question when served acceptance
    is far below what the offline numbers promise.

    RESULTS is a directory `specreplay score` wrote (score it with the engine's --walk-rule, and
    --steps = the server's draft length, for counts that can be equal step for step). Each stored
    prompt is sent once, greedy, with the extract's max_new_tokens. A sample is `equal` (same
    response, same counts), `differs` (same response, other counts: the line says what that points
    at: the walk rule, the draft length, the drafts themselves), or `not comparable` (the engine's
    response is not the stored one). Exits 1 when any sample differs.

    \b
    Example:
      LLAMA_TRACE=1 llama-server -m target.gguf -md drafter.gguf --spec-type draft-dflash \\
          --spec-draft-n-max 15 --parallel 1 -fa off -ctk f32 -ctv f32 -ctkd f32 -ctvd f32 \\
          --port 8080 2> server.log &
      specreplay score --ckpt drafter/ --shards data/shards/t --out data/results --walk-rule llama.cpp --steps 15
      specreplay compare-online data/results/x_drafter --server http://127.0.0.1:8080 --engine-log server.log
    """
    from pipeline.common.paths import check_input_path
    from scoring.online.run import OnlineConfig, run_compare_online, summary

    check_input_path(results_dir, "RESULTS", "directory")
    config = OnlineConfig(results_dir, server, engine, engine_log, limit, request_timeout)
    facts, verdicts = run_compare_online(config)
    totals = summary(verdicts)
    if as_json:
        click.echo(json.dumps({**facts, **totals, "samples": [v.__dict__ for v in verdicts]}, indent=1))
    else:
        click.echo(headline(facts, totals))
        click.echo(table(verdicts))
        for v in verdicts:
            if v.points_at:
                click.echo(f"{v.sample_id}: {v.points_at}")
    raise SystemExit(1 if totals["differs"] else 0)


def headline(facts: dict, totals: dict) -> str:
    return (
        f"{facts['engine']} serving {facts['model']}, walk rule {facts['walk_rule']}: {totals['equal']} of "
        f"{totals['compared']} samples equal, {totals['differs']} differ, {totals['not_comparable']} not comparable "
        f"(the engine's response is not the stored one); accepted drafts on the same responses offline "
        f"{rate(totals['offline_accepted'], totals['offline_drafted'])}, online "
        f"{rate(totals['online_accepted'], totals['online_drafted'])}"
    )


def rate(accepted: int, drafted: int) -> str:
    return f"{accepted}/{drafted}" + (f" ({accepted / drafted:.3f})" if drafted else "")


def table(verdicts) -> str:
    from scoring.score.console import aligned

    def pair(value) -> str:
        return "-" if value is None else f"{value[0]}/{value[1]}"

    cells = [
        [
            v.sample_id,
            v.response,
            pair(v.offline),
            pair(v.online),
            "-" if v.first_difference is None else str(v.first_difference),
            v.verdict,
        ]
        for v in verdicts
    ]
    return "\n".join(aligned(list(VERDICT_COLUMNS), cells, left={"sample_id", "response", "verdict"}))
