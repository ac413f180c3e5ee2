"""`specreplay profile`: measure a cost profile of the serving side on this machine's engine, for
`specreplay speed` (scoring/speed/llama_bench.py; the profile: docs/speed.md)."""

from __future__ import annotations

import json
import os

import click


def drafters_to_time(served: tuple[str, ...], drafts: tuple[str, ...]) -> tuple[dict, dict]:
    """(--serve's, --draft's) family -> GGUF; a family given to both, or one llama-server does not
    serve, is refused."""
    from scoring.speed.llama_server import SPEC_TYPES

    serve, bench = draft_models(served, "--serve"), draft_models(drafts)
    both = sorted(set(serve) & set(bench))
    if both:
        raise click.BadParameter(f"{both[0]} is given to --draft too: time each drafter one way", param_hint="--serve")
    unserved = [family for family in serve if family not in SPEC_TYPES]
    if unserved:
        raise click.BadParameter(
            f"llama-server serves no {unserved[0]!r} drafter ({', '.join(SPEC_TYPES)})", param_hint="--serve"
        )
    return serve, bench


def token_counts(text: str, option: str = "--tokens") -> list[int]:
    """'1-5,8,16' -> [1, 2, 3, 4, 5, 8, 16]: counts and inclusive ranges, comma-separated."""
    counts: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise click.BadParameter(f"{part!r} is not a count or a range like 1-17", param_hint=option) from None
        if first < 1 or last < first:
            raise click.BadParameter(f"{part!r}: counts start at 1 and a range goes up", param_hint=option)
        counts.update(range(first, last + 1))
    return sorted(counts)


def draft_models(items: tuple[str, ...], option: str = "--draft") -> dict[str, str]:
    """('draft=small.gguf', ...) -> {family: GGUF}."""
    found = {}
    for item in items:
        family, _, path = item.partition("=")
        if not path or family in found:
            raise click.BadParameter(f"{item!r}: give FAMILY=PATH.gguf, each family once", param_hint=option)
        if not os.path.isfile(path):
            raise click.BadParameter(f"{path}: no such file", param_hint=option)
        found[family] = path
    return found


@click.command()
@click.option("--target", "target", required=True, metavar="TARGET.gguf", help="The target as llama.cpp serves it.")
@click.option(
    "--draft",
    "drafts",
    multiple=True,
    metavar="FAMILY=DRAFT.gguf",
    help="A standalone draft model to time too (its one-token forward), as the family its results carry "
    "(`draft` for draft:PATH baselines); repeatable.",
)
@click.option(
    "--tokens",
    default="1-17",
    show_default=True,
    help="Tokens per sequence to time the target's forward at: counts and ranges, e.g. 1-9,17,33 (cover the "
    "largest chain K + 1 or tree budget + 1 you will predict).",
)
@click.option(
    "--context", default=512, show_default=True, type=click.IntRange(min=0), help="Tokens already in the KV cache."
)
@click.option(
    "--reps", default=5, show_default=True, type=click.IntRange(min=1), help="Repetitions; the median is kept."
)
@click.option(
    "--threads", default=os.cpu_count() or 1, type=click.IntRange(min=1), help="CPU threads (default: all cores)."
)
@click.option(
    "--llama-arg",
    "llama_args",
    multiple=True,
    help="More llama-bench options, as the server runs (e.g. --llama-arg=-fa --llama-arg=off); repeatable.",
)
@click.option(
    "--serve",
    "served",
    multiple=True,
    metavar="FAMILY=DRAFTER.gguf",
    help="A drafter llama-bench cannot run (DFlash, DSpark, EAGLE-3, an MTP head: give the target's GGUF), "
    "timed inside llama-server serving the target with it, at each K of --serve-drafts; repeatable.",
)
@click.option(
    "--serve-drafts",
    default="1-8",
    show_default=True,
    help="Drafts per step (--spec-draft-n-max) to time each --serve drafter at: counts and ranges.",
)
@click.option(
    "--serve-requests",
    default=3,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests timed inside llama-server per measurement (after one warm-up request), --context prompt "
    "tokens each: per --serve drafter and K, and with --in-server.",
)
@click.option(
    "--in-server",
    "in_server",
    is_flag=True,
    help="Time the target inside llama-server by its own step timers instead of llama-bench: plain decoding, "
    "the speculative step without a draft, and each step of --tokens minus 1 drafts less its draft call (all "
    "logits, sampling and bookkeeping as served; llama-bench times one forward alone).",
)
@click.option(
    "--verify-draft",
    default=None,
    metavar="DRAFT.gguf",
    help="With --in-server: the draft model whose draft-simple steps time the verification (default: the "
    "target itself; any model of its vocabulary: its own cost is subtracted).",
)
@click.option(
    "--llama-bench", "llama_bench", default=None, help="llama-bench's path (default: make setup's, else PATH)."
)
@click.option("--out", required=True, help="The profile JSON to write.")
@click.option("--force", is_flag=True, help="Replace an existing --out file.")
def profile(
    target,
    drafts,
    tokens,
    context,
    reps,
    threads,
    llama_args,
    served,
    serve_drafts,
    serve_requests,
    in_server,
    verify_draft,
    llama_bench,
    out,
    force,
):
    """Measure how long the target's forward takes for 1, 2, ... tokens per sequence after
    --context tokens, and each drafter's forward, on this machine's llama.cpp: the cost profile
    `specreplay speed` predicts tokens per second from. The target by llama-bench (one forward
    alone) or, with --in-server, by llama-server's own step timers (verification as served, plain
    decoding apart); standalone draft models (--draft) by llama-bench; drafters that read the
    target's features (--serve) inside llama-server. One sequence (batch 1); a profile for larger
    batches, measured elsewhere, follows the same schema (docs/speed.md).

    \b
    Example:
      specreplay profile --target smollm2-f32.gguf --draft draft=small-f32.gguf --tokens 1-9 --out cpu.json
      specreplay profile --target t.gguf --serve dflash=dflash.gguf --serve-drafts 4,8,15 --tokens 1-16 --out cpu.json
      specreplay speed data/results --profile cpu.json
    """
    from pipeline.common.errors import UserError
    from scoring.speed.measure import Measurement, Wanted, measure_profile

    if os.path.exists(out) and not force:
        raise UserError(f"{out} exists; give another --out or --force to replace it")
    serve, bench = drafters_to_time(served, drafts)
    if verify_draft is not None and not os.path.isfile(verify_draft):
        raise click.BadParameter(f"{verify_draft}: no such file", param_hint="--verify-draft")
    wanted = Wanted(
        target,
        token_counts(tokens),
        in_server,
        verify_draft,
        bench,
        serve,
        token_counts(serve_drafts, "--serve-drafts"),
    )
    work = os.path.splitext(out)[0] + "-logs"
    how = Measurement(context, reps, serve_requests, threads, tuple(llama_args), llama_bench, work)
    measured = measure_profile(wanted, how)
    with open(out, "w") as f:
        json.dump(measured, f, indent=1)
    verify = measured["verify"]
    click.echo(
        f"wrote {out}: the target's forward {verify[0]['seconds'] * 1000:.2f} ms at {verify[0]['tokens']} token(s) .. "
        f"{verify[-1]['seconds'] * 1000:.2f} ms at {verify[-1]['tokens']}, context {context}"
    )
