"""Predicted speed of every scored configuration from its exact offline tau and a cost profile
(docs/speed.md):

    step_s(b)    = verify_b(verified tokens) + sum over the drafter's passes of draft_b(tokens)
    tokens/s(b)  = b * tau / step_s(b)              (b sequences, tau tokens each per step)
    speedup(b)   = tau * verify_b(1) / step_s(b)    (over plain decoding: b tokens per verify_b(1))

per batch size b the profile measured; the best configuration per batch size is the fastest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pipeline.common.errors import UserError
from scoring.methods.chain import CHAIN
from scoring.speed.profile import Curve, Profile
from scoring.speed.shapes import StepShape, step_shape


@dataclass(frozen=True)
class Configuration:
    """One scored configuration of one result: its method, pooled tau and the chain's drafts."""

    checkpoint: str
    family: str
    method: str
    tau: float  # tokens per step over the workload (tokens_per_step)
    drafts: int  # the chain's drafts per step (a block drafter's block minus one)


@dataclass(frozen=True)
class Prediction:
    checkpoint: str
    method: str
    batch: int
    tau: float
    verified: int
    verify_s: float
    draft_s: float
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
    drafts = len(pooled[CHAIN]["accept_rate_by_position"] or [])
    family = record["checkpoint"]["family"]
    return [Configuration(name, family, method, tokens_per_step(row), drafts) for method, row in pooled.items()]


def cost(curve: Curve | None, tokens: int, what: str, batch: int, profile: Profile) -> float:
    """Seconds of one forward from `curve` at `tokens`, or the error saying what to measure."""
    seconds = curve.at(tokens) if curve is not None else None
    if seconds is None:
        measured = f"measures {curve.tokens[0]}..{curve.tokens[-1]} tokens" if curve else "has no entry"
        raise UserError(
            f"{profile.source}: {what} at batch {batch} {measured}; {tokens} tokens per sequence are needed: "
            "measure them (docs/speed.md) or leave out the methods that need them (`speed --method`)"
        )
    return seconds


def draft_seconds(profile: Profile, config: Configuration, shape: StepShape, batch: int) -> float:
    """The drafter's forwards of one step at `batch`, from its entry in the profile."""
    if not shape.draft_passes:
        return 0.0
    curves = profile.draft_curves(config.family, config.checkpoint)
    if curves is None:
        raise UserError(
            f"{profile.source}: no drafter cost for family {config.family!r} (needed by {config.checkpoint}); add "
            f'"drafters" entries with "family": "{config.family}" (docs/speed.md)'
        )
    what = f"drafters[{config.family}]"
    return sum(cost(curves.get(batch), tokens, what, batch, profile) for tokens in shape.draft_passes)


def predict_one(profile: Profile, config: Configuration, batch: int) -> Prediction:
    """The prediction of one configuration at one batch size (module docstring)."""
    shape = step_shape(config.family, config.method, config.drafts)
    verify = profile.verify[batch]
    plain_s = cost(verify, 1, "verify", batch, profile)
    verify_s = cost(verify, shape.verified, f"verify ({config.method})", batch, profile)
    draft_s = draft_seconds(profile, config, shape, batch)
    step_s = verify_s + draft_s
    return Prediction(
        config.checkpoint,
        config.method,
        batch,
        config.tau,
        shape.verified,
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
