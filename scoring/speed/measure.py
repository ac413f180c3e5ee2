"""`specreplay profile`: a cost profile measured here with llama.cpp (docs/speed.md), assembled from
llama-bench's forwards (llama_bench.py) and llama-server's own timers (llama_server.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from scoring.speed.llama_bench import bench_draft, bench_verify, target_facts
from scoring.speed.llama_server import served_pass, served_target
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


def measured_rows(wanted: Wanted, how: Measurement) -> tuple[dict, str]:
    """({verify, plain, drafters} rows, what timed the target)."""
    if wanted.in_server:
        rows = served_target(wanted.target, wanted.verify_draft or wanted.target, wanted.tokens, how)
        engine = f"llama.cpp llama-server's own step timers ({how.requests} requests after a warm-up)"
    else:
        verify, cpu = bench_verify(wanted.target, wanted.tokens, how)
        rows = {"verify": verify, "plain": []}
        engine = f"llama.cpp llama-bench (median of {how.reps} repetitions; CPU {cpu})"
    rows["drafters"] = [bench_draft(family, gguf, how) for family, gguf in wanted.drafts.items()]
    served = [served_pass(f, g, wanted.target, k, how) for f, g in wanted.serve.items() for k in wanted.serve_drafts]
    rows["drafters"] += merged(served)
    return rows, engine


def merged(rows: list[dict]) -> list[dict]:
    """One row per (family, batch, tokens): an autoregressive drafter's one-token pass timed at
    several K is their mean."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["family"], row["batch"], row["tokens"]), []).append(row)
    return [dict(same[0], seconds=sum(r["seconds"] for r in same) / len(same)) for same in groups.values()]


def measure_profile(wanted: Wanted, how: Measurement) -> dict:
    """The profile as a dict (profile.py's schema)."""
    if wanted.in_server or wanted.serve:
        os.makedirs(how.work, exist_ok=True)
    rows, engine = measured_rows(wanted, how)
    flags = " ".join(how.extra) or "default flags"
    timed = [f"{family} {gguf}" for family, gguf in {**wanted.drafts, **wanted.serve}.items()]
    return {
        "format": FORMAT,
        "target": target_facts(wanted.target),
        "measured": {
            "engine": f"{engine}, {flags}, {how.threads} threads",
            "device": "CPU",
            "context_len": how.context,
            "notes": "; ".join(
                [f"target {wanted.target}", *timed]
                + (["drafters timed inside llama-server: " + ", ".join(wanted.serve)] if wanted.serve else [])
            ),
        },
        **rows,
    }
