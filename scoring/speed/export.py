"""A result's acceptance in the engines' own synthetic forms (docs/speed.md#export), so a user can
time their serving stack at exactly this acceptance before deploying the drafter:

- llama.cpp: `--spec-synth-rates P1,...,PK` (common/arg.cpp, common/speculative.cpp
  common_speculative_synth_rates_resolve: K = the draft limit, unconditional, non-increasing, in
  [0, 1]; the server accepts draft i with probability P_i / P_{i-1}, server-context.cpp
  server_sample_and_accept_synth);
- vLLM: `rejection_sample_method: "synthetic"` with `synthetic_acceptance_rates` (the same K
  unconditional rates, vllm/config/speculative.py `_resolve_synthetic_acceptance_rates`);
- vLLM's dynamic speculative decoding: `num_speculative_tokens_per_batch_size`, inclusive batch
  ranges -> K (vllm/v1/spec_decode/dynamic/utils.py), the predicted fastest chain K per measured
  batch size among results of one drafter at several K.

P_k = the fraction of the walk's full steps (K drafts verified) that accepted at least k drafts;
without walk rows (sampled shards) the product of the all-anchor conditional rates up to k.
"""

from __future__ import annotations

import os

import polars as pl

from pipeline.common.errors import UserError
from scoring import results
from scoring.methods.chain import CHAIN
from scoring.speed.predict import Prediction


def walk_rates(directory: str, drafts: int) -> list[float] | None:
    """P_1..P_K from the chain's walk steps that verified `drafts` drafts; None without such steps."""
    path = os.path.join(directory, results.FILES["walk"])
    if not os.path.isfile(path):
        return None
    steps = pl.read_parquet(path, columns=["method", "drafted", "accepted_len"])
    full = steps.filter((pl.col("method") == CHAIN) & (pl.col("drafted") == drafts))["accepted_len"]
    if full.len() == 0:
        return None
    return [float((full >= k).mean()) for k in range(1, drafts + 1)]


def anchor_rates(directory: str) -> list[float]:
    """P_1..P_K as the running product of the pooled chain's accept_rate_by_position."""
    summary = pl.read_parquet(os.path.join(directory, results.FILES["summary"]))
    row = summary.filter((pl.col("dataset") == results.ALL_DATASETS) & (pl.col("method") == CHAIN)).row(0, named=True)
    rates, running = [], 1.0
    for rate in row["accept_rate_by_position"] or []:
        running *= rate if rate == rate else 0.0  # NaN: the position was never reached
        rates.append(running)
    return rates


def synthetic_rates(directory: str) -> list[float]:
    """The result's unconditional per-position acceptance, non-increasing, rounded to 6 digits."""
    anchors = anchor_rates(directory)  # its length is the chain's K either way
    if not anchors:
        raise UserError(f"{directory}: its chain has no draft positions; nothing to export")
    rates = walk_rates(directory, len(anchors)) or anchors
    return [round(r, 6) for r in rates]


def llama_cpp_flag(directory: str) -> str:
    rates = synthetic_rates(directory)
    return f"--spec-draft-n-max {len(rates)} --spec-synth-rates {','.join(f'{r:g}' for r in rates)}"


def vllm_synthetic(directory: str) -> dict:
    rates = synthetic_rates(directory)
    return {
        "num_speculative_tokens": len(rates),
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": rates,
    }


def vllm_dynamic(predictions: list[Prediction]) -> dict:
    """The fastest chain K per measured batch size as vLLM's batch-size schedule: each measured
    batch size up to the next one takes its K (vLLM carries the last K past the final range)."""
    chains = [p for p in predictions if p.method == CHAIN]
    batches = sorted({p.batch for p in chains})
    if len({p.verified for p in chains}) < 2:
        raise UserError(
            "the dynamic schedule chooses K per batch size: give results of one drafter scored at several K"
        )
    best = {b: max((p for p in chains if p.batch == b), key=lambda p: (p.speedup, -p.verified)) for b in batches}
    ends = [b - 1 for b in batches[1:]] + [batches[-1]]
    schedule = [[b, end, best[b].verified - 1] for b, end in zip(batches, ends)]
    schedule[0][0] = 1  # vLLM's schedule starts at batch size 1; below the smallest measured, its K
    return {
        "num_speculative_tokens": max(k for _, _, k in schedule),
        "num_speculative_tokens_per_batch_size": schedule,
    }
