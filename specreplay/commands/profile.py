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


def torch_measurement(how, device: str | None, dtype: str | None, threads: int):
    """The measurement with the torch engine's device and dtype (CUDA when torch sees one)."""
    import dataclasses

    import torch

    torch.set_num_threads(threads)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return dataclasses.replace(how, device=device, dtype=dtype or "auto")


def draft_models(items: tuple[str, ...], option: str = "--draft") -> dict[str, str]:
    """('draft=small.gguf', ...) -> {family: GGUF}."""
    found = {}
    for item in items:
        family, _, path = item.partition("=")
        if not path or family in found:
            raise click.BadParameter(f"{item!r}: give FAMILY=PATH.gguf, each family once", param_hint=option)
        if not os.path.exists(path):
            raise click.BadParameter(f"{path}: no such file or directory", param_hint=option)
        found[family] = path
    return found


def engine_checked(engine: str, given: dict) -> None:
    """Refuse an option the chosen --engine does not read (one line naming it)."""
    llama_only = ("serve", "in_server", "verify_draft", "llama_args", "llama_bench")
    wrong = [name for name in llama_only if given[name]] if engine == "torch" else []
    if engine != "torch":
        wrong = [name for name in ("device", "dtype", "in_generate") if given[name]]
        wrong += ["batch"] if given["batch"] != "1" else []
    if wrong:
        other = "llama.cpp" if engine == "torch" else "torch"
        option = "--" + wrong[0].replace("_", "-")
        raise click.BadParameter(f"{option} is read by --engine {other} only", param_hint="--engine")


@click.command()
@click.option(
    "--target",
    "target",
    required=True,
    metavar="TARGET.gguf|DIR",
    help="The target as the engine runs it: a GGUF for llama.cpp; a transformers directory for torch.",
)
@click.option(
    "--engine",
    type=click.Choice(["llama.cpp", "torch"]),
    default="llama.cpp",
    show_default=True,
    help="Who times the forwards: llama.cpp's llama-bench / llama-server (CPU, one sequence), or transformers "
    "on torch (a GPU when present; several sequences with --batch).",
)
@click.option(
    "--batch",
    default="1",
    show_default=True,
    help="With --engine torch: batch sizes (sequences per forward) to time at: counts and ranges, e.g. 1,4,8-16.",
)
@click.option(
    "--device", default=None, help="With --engine torch: cpu, cuda or cuda:N (default: cuda when torch sees one)."
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "fp32", "bf16", "fp16"]),
    default=None,
    help="With --engine torch: the weights' dtype (default auto: fp32 on CPU, bf16 on CUDA).",
)
@click.option(
    "--draft",
    "drafts",
    multiple=True,
    metavar="FAMILY=DRAFT",
    help="A standalone draft model to time too (its one-token forward), as the family its results carry "
    "(`draft` for draft:PATH baselines): a GGUF for llama.cpp, a transformers directory for torch; repeatable.",
)
@click.option(
    "--tokens",
    default="1-17",
    show_default=True,
    help="Tokens per sequence to time the target's forward at: counts and ranges, e.g. 1-9,17,33 (cover the "
    "largest chain K + 1 or tree budget + 1 you will predict).",
)
@click.option(
    "--context", default=512, show_default=True, type=click.IntRange(min=1), help="Tokens already in the KV cache."
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
    help="Drafts per step (--spec-draft-n-max) to time each --serve drafter at (with --engine torch --in-generate: "
    "each K of prompt lookup and assisted generation): counts and ranges.",
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
    "--in-generate",
    "in_generate",
    is_flag=True,
    help="With --engine torch: time steps inside transformers' own generate too, one sequence: plain decoding "
    "as generate's step, and at each K of --serve-drafts the share of a speculative step beside the target's "
    "forward, for prompt lookup (family ngram) and assisted generation with each --draft model (its lookup "
    "or draft model and the loop's own work; --serve-requests prompts of --context tokens).",
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
    engine,
    batch,
    device,
    dtype,
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
    in_generate,
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
    target's features (--serve) inside llama-server; one sequence. With --engine torch, the
    target (a transformers directory) and --draft models by transformers' forwards on torch, on a
    GPU when one is present, at each --batch size; with --in-generate, steps inside transformers'
    own generate too (docs/speed.md).

    \b
    Example:
      specreplay profile --target smollm2-f32.gguf --draft draft=small-f32.gguf --tokens 1-9 --out cpu.json
      specreplay profile --target t.gguf --serve dflash=dflash.gguf --serve-drafts 4,8,15 --tokens 1-16 --out cpu.json
      specreplay profile --engine torch --target Qwen/Qwen3-8B-dir --batch 1,4,16 --tokens 1-17 --out h200.json
      specreplay profile --engine torch --target DIR --draft draft=SMALL-DIR --in-generate --serve-drafts 1-8 --out gen.json
      specreplay speed data/results --profile cpu.json
    """
    from pipeline.common.errors import UserError

    if os.path.exists(out) and not force:
        raise UserError(f"{out} exists; give another --out or --force to replace it")
    given = {"serve": served, "in_server": in_server, "verify_draft": verify_draft, "llama_args": llama_args}
    given |= {"llama_bench": llama_bench, "device": device, "dtype": dtype, "batch": batch, "in_generate": in_generate}
    engine_checked(engine, given)
    serve, bench = drafters_to_time(served, drafts)
    if verify_draft is not None and not os.path.isfile(verify_draft):
        raise click.BadParameter(f"{verify_draft}: no such file", param_hint="--verify-draft")
    from scoring.speed.measure import Measurement, Wanted, measure_profile

    counts = token_counts(tokens), token_counts(serve_drafts, "--serve-drafts")
    batches = tuple(token_counts(batch, "--batch"))
    wanted = Wanted(target, counts[0], in_server, verify_draft, bench, serve, counts[1], engine, batches, in_generate)
    work = os.path.splitext(out)[0] + "-logs"
    how = Measurement(context, reps, serve_requests, threads, tuple(llama_args), llama_bench, work)
    if engine == "torch":
        how = torch_measurement(how, device, dtype, threads)
    written(measure_profile(wanted, how), out)


def written(measured: dict, out: str) -> None:
    """The profile written to `out`, and one line saying what it holds."""
    with open(out, "w") as f:
        json.dump(measured, f, indent=1)
    verify = measured["verify"]
    click.echo(
        f"wrote {out}: the target's forward {verify[0]['seconds'] * 1000:.2f} ms at {verify[0]['tokens']} token(s) .. "
        f"{verify[-1]['seconds'] * 1000:.2f} ms at {verify[-1]['tokens']}, context {measured['measured']['context_len']}"
    )
