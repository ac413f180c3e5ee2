"""Predicted speed of every scored configuration from its exact offline tau and a cost profile
(docs/speed.md):

    step_s(b)    = mean over the walk's steps of verify_b(d + 1) + the drafter's forwards at d drafts
    tokens/s(b)  = b * tau / step_s(b)              (b sequences, tau tokens each per step)
    speedup(b)   = tau * plain_b / step_s(b)        (over plain decoding: b tokens per plain_b)

d is each step's drafts as the walk rule's loop verified them (walk.parquet `drafted`: 0 where an
n-gram found no match or the budget left no room, fewer near the end), or the chain's K for every
step where the result has no walk (sampled shards) and for tree methods; plain_b is the profile's
plain decoding step, else verify_b(1). The best configuration per batch size is the fastest.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass

import polars as pl

from pipeline.common.errors import UserError
from scoring import results
from scoring.methods.chain import CHAIN
from scoring.speed.profile import Curve, Profile
from scoring.speed.shapes import draft_passes, verified_tokens


@dataclass(frozen=True)
class Configuration:
    """One scored configuration of one result: its method, pooled tau and the chain's drafts."""

    checkpoint: str
    family: str
    method: str
    tau: float  # tokens per step over the workload (tokens_per_step)
    drafts: int  # the chain's drafts per step (a block drafter's block minus one)
    # steps by the drafts the loop verified (walk.parquet); None: every step drafts `drafts`
    drafted: dict[int, int] | None = None

    def steps_by_drafts(self) -> dict[int, int]:
        return self.drafted or {self.drafts: 1}


@dataclass(frozen=True)
class Prediction:
    checkpoint: str
    method: str
    batch: int
    tau: float
    verified: int  # tokens verified per sequence at a full step (K + 1, a tree's budget + 1)
    verify_s: float  # mean over the steps
    draft_s: float  # mean over the steps
    step_s: float
    tokens_per_s: float
    plain_tokens_per_s: float
    speedup: float


def tokens_per_step(row: dict) -> float:
    """A workload's tokens per step: tokens produced over steps, pooled over the samples (its
    throughput's numerator; the mean of per-sample tau weighs a short sample like a long one).
    Without walk counts (sampled shards' chain: an expectation), the expected tau."""
    if row.get("steps") and row.get("tokens_produced") is not None:
        return row["tokens_produced"] / row["steps"]
    return row["tau"]


def configurations(summary_rows: list[dict], record: dict, name: str) -> list[Configuration]:
    """The pooled rows of a result's summary with a tau, as configurations (chain first)."""
    pooled = {r["method"]: r for r in summary_rows if r["dataset"] == "(all)" and r["tau"] is not None}
    if CHAIN not in pooled:
        return []
    drafts = results.chain_drafts(pooled[CHAIN])
    family = record["checkpoint"]["family"]
    return [Configuration(name, family, method, tokens_per_step(row), drafts) for method, row in pooled.items()]


def walk_drafted(directory: str) -> dict[int, int] | None:
    """The chain's steps by the drafts its loop verified (walk.parquet), or None without a walk."""
    path = os.path.join(directory, results.FILES["walk"])
    if not os.path.isfile(path):
        return None
    steps = pl.read_parquet(path, columns=["method", "drafted"]).filter(pl.col("method") == CHAIN)["drafted"]
    return dict(Counter(steps.drop_nulls().to_list())) or None


def cost(curve: Curve | None, tokens: int, what: str, batch: int, profile: Profile, unit: str = "tokens") -> float:
    """Seconds of one forward from `curve` at `tokens` (a step curve's: drafts, `unit`), or the
    error saying what to measure."""
    seconds = curve.at(tokens) if curve is not None else None
    if seconds is None:
        measured = f"measures {curve.tokens[0]}..{curve.tokens[-1]} {unit}" if curve else "has no entry"
        raise UserError(
            f"{profile.source}: {what} at batch {batch} {measured}; {tokens} {unit} per sequence are needed: "
            "measure them (docs/speed.md) or leave out the methods that need them (`speed --method`)"
        )
    return seconds


def draft_seconds(profile: Profile, config: Configuration, drafts: int, batch: int) -> float:
    """The drafter's forwards of one step drafting `drafts`, from its entry in the profile; a chain
    step from its step curve when the profile has one (measured in the loop at the configuration's
    K, its steps with fewer drafts included: every step is priced at K)."""
    steps = profile.step_curves(config.family, config.checkpoint) if config.method == CHAIN else None
    if steps is not None:
        return cost(steps.get(batch), config.drafts, f"draft_steps[{config.family}]", batch, profile, "drafts")
    passes = draft_passes(config.family, config.method, drafts, config.drafts)
    if not passes:
        return 0.0
    curves = profile.draft_curves(config.family, config.checkpoint)
    if curves is None:
        raise UserError(
            f"{profile.source}: no drafter cost for family {config.family!r} (needed by {config.checkpoint}); add "
            f'"drafters" entries with "family": "{config.family}" (docs/speed.md)'
        )
    what = f"drafters[{config.family}]"
    return sum(cost(curves.get(batch), tokens, what, batch, profile) for tokens in passes)


def plain_seconds(profile: Profile, batch: int) -> float:
    """One plain decoding step at `batch`: the profile's `plain`, else the target's one-token forward."""
    if batch in profile.plain:
        return profile.plain[batch]
    return cost(profile.verify[batch], 1, "verify", batch, profile)


def predict_one(profile: Profile, config: Configuration, batch: int) -> Prediction:
    """The prediction of one configuration at one batch size (module docstring)."""
    verify = profile.verify[batch]
    steps = config.steps_by_drafts()
    total = sum(steps.values())
    verify_s = draft_s = 0.0
    for drafts, count in steps.items():
        tokens = verified_tokens(config.method, drafts)
        verify_s += count * cost(verify, tokens, f"verify ({config.method})", batch, profile) / total
        draft_s += count * draft_seconds(profile, config, drafts, batch) / total
    plain_s = plain_seconds(profile, batch)
    step_s = verify_s + draft_s
    return Prediction(
        config.checkpoint,
        config.method,
        batch,
        config.tau,
        verified_tokens(config.method, config.drafts),
        verify_s,
        draft_s,
        step_s,
        batch * config.tau / step_s,
        batch / plain_s,
        config.tau * plain_s / step_s,
    )


def predict(profile: Profile, configs: list[Configuration], batches: list[int] | None = None) -> list[Prediction]:
    """Every configuration at every batch size (the profile's, or those asked: each must be measured)."""
    batches = batches or profile.batches
    missing = [b for b in batches if b not in profile.verify]
    if missing:
        raise UserError(
            f"{profile.source}: batch size {missing[0]} is not measured (verify has {', '.join(map(str, profile.batches))})"
        )
    return [predict_one(profile, config, b) for b in batches for config in configs]


def best_per_batch(predictions: list[Prediction]) -> dict[int, Prediction]:
    """batch -> the fastest prediction (the fewer verified tokens, then the earlier, on a tie)."""
    best: dict[int, Prediction] = {}
    for p in predictions:
        held = best.get(p.batch)
        if held is None or (p.speedup, -p.verified) > (held.speedup, -held.verified):
            best[p.batch] = p
    return best


def as_rows(predictions: list[Prediction]) -> list[dict]:
    """The predictions as rows (speed.parquet; docs/speed.md), each with whether it is its batch's best."""
    best = {id(p) for p in best_per_batch(predictions).values()}
    return [dict(asdict(p), best=id(p) in best) for p in predictions]
