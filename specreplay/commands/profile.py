"""`specreplay profile`: measure a cost profile of the serving side on this machine's engine, for
`specreplay speed` (scoring/speed/llama_bench.py; the profile: docs/speed.md)."""

from __future__ import annotations

import json
import os

import click


def token_counts(text: str) -> list[int]:
    """'1-5,8,16' -> [1, 2, 3, 4, 5, 8, 16]: counts and inclusive ranges, comma-separated."""
    counts: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise click.BadParameter(f"{part!r} is not a count or a range like 1-17", param_hint="--tokens") from None
        if first < 1 or last < first:
            raise click.BadParameter(f"{part!r}: counts start at 1 and a range goes up", param_hint="--tokens")
        counts.update(range(first, last + 1))
    return sorted(counts)


def draft_models(items: tuple[str, ...]) -> dict[str, str]:
    """('draft=small.gguf', ...) -> {family: GGUF}."""
    found = {}
    for item in items:
        family, _, path = item.partition("=")
        if not path or family in found:
            raise click.BadParameter(f"{item!r}: give FAMILY=PATH.gguf, each family once", param_hint="--draft")
        if not os.path.isfile(path):
            raise click.BadParameter(f"{path}: no such file", param_hint="--draft")
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
    "--llama-bench", "llama_bench", default=None, help="llama-bench's path (default: make setup's, else PATH)."
)
@click.option("--out", required=True, help="The profile JSON to write.")
@click.option("--force", is_flag=True, help="Replace an existing --out file.")
def profile(target, drafts, tokens, context, reps, threads, llama_args, llama_bench, out, force):
    """Measure how long the target's forward takes for 1, 2, ... tokens per sequence after
    --context tokens, and each draft model's one-token forward, with llama.cpp's own llama-bench on
    this machine: the cost profile `specreplay speed` predicts tokens per second from. One
    sequence (batch 1): llama-bench runs no batch of sequences; a profile for larger batches,
    measured elsewhere, follows the same schema (docs/speed.md).

    \b
    Example:
      specreplay profile --target smollm2-f32.gguf --draft draft=small-f32.gguf --tokens 1-9 --out cpu.json
      specreplay speed data/results --profile cpu.json
    """
    from pipeline.common.errors import UserError
    from scoring.speed.llama_bench import measure

    if os.path.exists(out) and not force:
        raise UserError(f"{out} exists; give another --out or --force to replace it")
    measured = measure(
        target, draft_models(drafts), token_counts(tokens), context, reps, threads, llama_args, llama_bench
    )
    with open(out, "w") as f:
        json.dump(measured, f, indent=1)
    verify = measured["verify"]
    click.echo(
        f"wrote {out}: the target's forward {verify[0]['seconds'] * 1000:.2f} ms at {verify[0]['tokens']} token(s) .. "
        f"{verify[-1]['seconds'] * 1000:.2f} ms at {verify[-1]['tokens']}, context {context}"
    )
