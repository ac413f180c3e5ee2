"""`specreplay profile`: a cost profile measured here (docs/speed.md), assembled from llama.cpp's
llama-bench forwards (llama_bench.py) and llama-server's own timers (llama_server.py), or from
transformers' forwards on torch (torch_bench.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from scoring.speed.llama_bench import bench_draft, bench_verify, target_facts
from scoring.speed.llama_server import Served, drafter_row, drafter_server, interleave, target_rows, target_servers
from scoring.speed.profile import FORMAT


@dataclass(frozen=True)
class Measurement:
    """How the forwards are timed: the KV cache's tokens, repetitions (llama-bench) or requests
    (llama-server) after one warm-up, threads, more llama.cpp options, llama-bench's path."""

    context: int
    reps: int
    requests: int
    threads: int
    extra: tuple[str, ...]
    binary: str | None
    work: str  # where llama-server's logs are kept
    n_predict: int = 32
    device: str = "cpu"  # the torch engine's
    dtype: str = "auto"  # the torch engine's: fp32 on CPU, bf16 on CUDA


@dataclass(frozen=True)
class Wanted:
    """What to time: the target (GGUF) at `tokens` per sequence, inside the server or by llama-bench
    (`verify_draft`: the draft model the server's steps draft with), draft models by llama-bench
    (family -> GGUF), drafters inside the server (family -> GGUF) at each K of `serve_drafts`."""

    target: str
    tokens: list[int]
    in_server: bool
    verify_draft: str | None
    drafts: dict[str, str]
    serve: dict[str, str]
    serve_drafts: list[int]
    engine: str = "llama.cpp"  # or "torch": the target (a transformers directory) by torch_bench.py
    batches: tuple[int, ...] = (1,)  # the torch engine's batch sizes
    in_generate: bool = False  # the torch engine's: steps timed inside generate at each K of serve_drafts


def measured_rows(wanted: Wanted, how: Measurement, more: list[Served]) -> tuple[dict, str]:
    """({verify, plain, drafters} rows, what timed the target); every llama-server, `more`'s
    included, serves in the same interleaved rounds."""
    target = (
        target_servers(wanted.target, wanted.verify_draft or wanted.target, wanted.tokens, how)
        if wanted.in_server
        else {}
    )
    served = {
        (family, k): drafter_server(family, gguf, wanted.target, k, how)
        for family, gguf in wanted.serve.items()
        for k in wanted.serve_drafts
    }
    if target or served or more:
        interleave([*target.values(), *served.values(), *more], wanted.target, how.threads, how.extra)
    if wanted.in_server:
        rows = target_rows(target, wanted.tokens)
        engine = f"llama.cpp llama-server's own step timers ({how.requests} requests after a warm-up, interleaved)"
    else:
        verify, cpu = bench_verify(wanted.target, wanted.tokens, how)
        rows = {"verify": verify, "plain": []}
        engine = f"llama.cpp llama-bench (median of {how.reps} repetitions; CPU {cpu})"
    rows["drafters"] = [bench_draft(family, gguf, how) for family, gguf in wanted.drafts.items()]
    rows["drafters"] += merged([drafter_row(family, k, one) for (family, k), one in served.items()])
    return rows, engine


def merged(rows: list[dict]) -> list[dict]:
    """One row per (family, batch, tokens): an autoregressive drafter's one-token pass timed at
    several K is their mean."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["family"], row["batch"], row["tokens"]), []).append(row)
    return [dict(same[0], seconds=sum(r["seconds"] for r in same) / len(same)) for same in groups.values()]


def measure_profile(wanted: Wanted, how: Measurement, more: tuple[Served, ...] = ()) -> dict:
    """The profile as a dict (profile.py's schema). `more`: other servers (the bench's served
    configurations) whose requests go round with the profile's own."""
    if wanted.engine == "torch":
        from scoring.speed.torch_bench import torch_profile_rows  # torch loaded only for its engine
        from scoring.speed.torch_generate import in_generate_rows

        ks = list(wanted.serve_drafts)
        served = (lambda model, drafts: in_generate_rows(model, drafts, ks, how)) if wanted.in_generate else None
        rows, facts, engine = torch_profile_rows(
            wanted.target, wanted.drafts, list(wanted.batches), wanted.tokens, how, served
        )
        device = how.device
    else:
        if wanted.in_server or wanted.serve:
            os.makedirs(how.work, exist_ok=True)
        rows, engine = measured_rows(wanted, how, list(more))
        engine += f", {' '.join(how.extra) or 'default flags'}, {how.threads} threads"
        facts, device = target_facts(wanted.target), "CPU"
    timed = [f"{family} {path}" for family, path in {**wanted.drafts, **wanted.serve}.items()]
    served = ["drafters timed inside llama-server: " + ", ".join(wanted.serve)] if wanted.serve else []
    return {
        "format": FORMAT,
        "target": facts,
        "measured": {
            "engine": engine,
            "device": device,
            "context_len": how.context,
            "notes": "; ".join([f"target {wanted.target}", *timed, *served]),
        },
        **rows,
    }
