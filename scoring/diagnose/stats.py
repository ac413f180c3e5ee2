"""The numbers `specreplay diagnose` compares and the verdict it draws from them.

Per sample and variant (chain, every anchor): the walk's tau (expected tau on sampled shards),
accepted lengths summed over anchors and acceptance at block position 1 (`sample_stats`).
Pooled: tau is the mean over samples with a step, as `score` reports it; the streak and the
position-1 acceptance are anchor-weighted (sum over sum). A variant's change from
as-configured gets a paired bootstrap interval over the same samples (scoring/compare/bootstrap.py).
The verdict names a variant only when its tau interval lies above zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.common.sampling import Sampling
from scoring.compare.bootstrap import FEW_SAMPLES, Judgement, judge, paired_bootstrap, paired_ratio_bootstrap
from scoring.diagnose.variants import CONFIGURED, VARIANTS
from scoring.replay import metrics
from scoring.replay.walk import next_stop_positions, stop_mask, walk
from scoring.score.collect import sampled_chain
from scoring.score.console import format_positions

METRICS = ("tau", "streak", "accept_pos1")


@dataclass
class SampleStats:
    """One sample replayed under one variant (chain, every anchor)."""

    tau: float | None  # the walk's tau (expected tau on sampled shards); None: no step
    accepted: float  # accepted length summed over anchors, bonus-exclusive (expected at T > 0)
    anchors: int
    pos1: float  # acceptance at block position 1 summed over anchors whose target there is known
    pos1_known: int
    reached: np.ndarray  # [L] per block position: anchors that verified it (expected at T > 0)
    accepted_at: np.ndarray  # [L] ... and accepted it
    nonfinite: bool = False  # the drafter produced NaN/Inf logits here: left out (left_out)


@dataclass
class Comparison:
    """One metric of one variant against as-configured, over the samples both measured."""

    variant: str
    metric: str
    value: float
    delta: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    samples: int = 0
    note: str | None = None


def left_out(positions: int) -> SampleStats:
    """A sample the drafter produced NaN/Inf logits on: counted nowhere (no tau, no anchors),
    so every comparison pairs only the samples both sides measured."""
    zeros = np.zeros(positions)
    return SampleStats(None, 0.0, 0, 0.0, 0, zeros, zeros.copy(), nonfinite=True)


def sample_stats(sample, result, stop_ids: list[int], sampling: Sampling) -> SampleStats:
    """SampleStats of one sample's all-anchor replay (chain only)."""
    if bool(result.nonfinite.any()):
        return left_out(result.draft_tokens.shape[1])
    is_stop = stop_mask(sample.input_ids, stop_ids)
    next_stop = next_stop_positions(is_stop)
    match, known = metrics.position_match(result.draft_tokens, result.target_tokens)
    if sampling.greedy:
        accepted = metrics.leading_matches(result.draft_tokens, result.target_tokens)
        produced = metrics.produced_tokens(
            accepted, result.anchors, sample.input_ids.numel(), next_stop[result.anchors]
        )
        tau = metrics.sample_tau([n for _, n in walk(produced, sample.prompt_len, is_stop)])
        counts = metrics.position_counts(accepted, match, known)
        accepted, first = accepted.double(), match[:, 0].double()
    else:  # rejection sampling: expectations (collect.sampled_chain)
        chain = sampled_chain(sample, result, is_stop, next_stop)
        tau, accepted, first = chain.expected_tau, chain.expected_accepted, chain.accept_probs[:, 0]
        counts = metrics.expected_position_counts(chain.accept_probs, known)
    return SampleStats(
        tau=tau,
        accepted=float(accepted.sum()),
        anchors=int(result.anchors.numel()),
        pos1=float((first * known[:, 0]).sum()),
        pos1_known=int(known[:, 0].sum()),
        reached=counts["reached"].double().numpy(),
        accepted_at=counts["accepted"].double().numpy(),
    )


def _metric_arrays(stats: list[SampleStats], metric: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(per-sample numerators, per-sample counts or None for a plain mean) of one metric."""
    if metric == "tau":
        return np.array([np.nan if s.tau is None else s.tau for s in stats]), None
    if metric == "streak":
        return np.array([s.accepted for s in stats]), np.array([s.anchors for s in stats], dtype=np.float64)
    return np.array([s.pos1 for s in stats]), np.array([s.pos1_known for s in stats], dtype=np.float64)


def pooled(stats: list[SampleStats], metric: str) -> tuple[float, int]:
    """(the metric over all samples, samples counted): mean tau over samples with a step;
    streak and position-1 acceptance anchor-weighted (sum over sum)."""
    values, counts = _metric_arrays(stats, metric)
    if counts is None:
        keep = ~np.isnan(values)
        return (float(values[keep].mean()) if keep.any() else float("nan")), int(keep.sum())
    keep = counts > 0
    return (float(values.sum() / counts.sum()) if keep.any() else float("nan")), int(keep.sum())


def compare_metric(base: list[SampleStats], other: list[SampleStats], metric: str, name: str, **boot) -> Comparison:
    """`other` against `base` on one metric, paired over samples (bootstrap interval)."""
    a, counts = _metric_arrays(base, metric)
    b, other_counts = _metric_arrays(other, metric)
    value, _ = pooled(other, metric)
    keep = ~(np.isnan(a) | np.isnan(b)) if counts is None else (counts > 0) & (other_counts > 0)
    n = int(keep.sum())
    if n < 2:
        return Comparison(name, metric, value, samples=n, note="fewer than 2 samples to compare")
    if counts is None:
        delta, low, high = paired_bootstrap(a[keep], b[keep], **boot)
    else:
        delta, low, high = paired_ratio_bootstrap(a[keep], b[keep], counts[keep], **boot)
    return Comparison(name, metric, value, delta, low, high, n)


def compare_all(measured: list[tuple[str, list[SampleStats] | None, str | None]], resamples: int, seed: int):
    """Comparisons of every metric of every (variant, stats or None, note why not measured),
    as-configured first (no delta)."""
    base = measured[0][1]
    rows = []
    for name, stats, note in measured:
        for metric in METRICS:
            if stats is None:
                rows.append(Comparison(name, metric, float("nan"), note=note))
            elif name == CONFIGURED:
                value, n = pooled(base, metric)
                rows.append(Comparison(CONFIGURED, metric, value, samples=n))
            else:
                rows.append(compare_metric(base, stats, metric, name, resamples=resamples, seed=seed))
    return rows


def by_position(stats: list[SampleStats]) -> tuple[list[float], list[float]]:
    """(acceptance by block position, conditioned on reaching it, pooled over samples; the
    anchors that reached each position, expected counts at T > 0)."""
    reached = sum(s.reached for s in stats)
    accepted = sum(s.accepted_at for s in stats)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (accepted / reached).tolist(), np.asarray(reached, dtype=np.float64).tolist()


# --------------------------------------------------------------------------- verdict


def _ci(c: Comparison) -> str:
    return f"{c.delta:+.2f}, 95% CI {c.ci_low:.2f} to {c.ci_high:.2f}"


def _judged(c: Comparison) -> Judgement:
    if c.delta is None or c.ci_low is None:
        return Judgement.UNCHANGED
    return judge(c.ci_low, c.ci_high)


@dataclass
class Drawn:
    """The samples replayed, how many the shards hold, --limit as given (None: the default) and
    the prompt set the shards were extracted from: what the few-samples advice can offer."""

    samples: int
    available: int
    asked: int | None = None
    prompts: str | None = None


def verdict(
    comparisons: list[Comparison],
    positions: tuple[list[float], list[float]],
    drawn: Drawn,
    sampling: Sampling,
) -> list[str]:
    """The verdict lines, from what was measured only: a convention variant whose tau interval
    lies above zero is named first (the largest gain); otherwise the configuration is called
    consistent and acceptance by block position (`by_position`: rates, anchors) shows where it
    dies, positions reached by fewer than MIN_ANCHORS anchors left out."""
    unit = "tau" if sampling.greedy else "expected tau"
    tau = {c.variant: c for c in comparisons if c.metric == "tau"}
    base = tau[CONFIGURED]
    better = [c for c in tau.values() if VARIANTS[c.variant].convention and _judged(c) == Judgement.BETTER]
    better.sort(key=lambda c: -c.delta)
    lines = []
    if better:
        best = better[0]
        variant = VARIANTS[best.variant]
        lines.append(
            f"{unit} {base.value:.2f} as configured, {best.value:.2f} with {variant.change} ({_ci(best)}): "
            f"{variant.finding}"
        )
        lines += [f"also better: {c.variant} ({unit} {c.value:.2f}, {_ci(c)})" for c in better[1:]]
    else:
        lines.append(
            f"the configuration is consistent: no variant beats as-configured ({unit} {base.value:.2f}); "
            f"acceptance by block position: {format_positions(*positions)}"
        )
    bf16 = tau.get("bf16")
    if bf16 is not None and _judged(bf16) != Judgement.UNCHANGED:
        lines.append(f"numerics: bf16 changes {unit} by {_ci(bf16)}; {VARIANTS['bf16'].finding}")
    few = few_samples_line(drawn, sampling)
    return lines + ([few] if few else [])


def few_samples_line(drawn: Drawn, sampling: Sampling) -> str | None:
    """Below FEW_SAMPLES, how to get more: a larger --limit while the shards hold more, else a
    larger extract (a --limit beyond what the shards hold cannot help, so it is not advised)."""
    if drawn.samples >= FEW_SAMPLES:
        return None
    rough = f"intervals from fewer than {FEW_SAMPLES} samples are rough"
    if drawn.available > drawn.samples:
        wanted = min(drawn.available, FEW_SAMPLES * 2)
        return f"{drawn.samples} samples: {rough}; pass --limit {wanted} (the shards hold {drawn.available}) for a firmer answer"
    asked = f"; --limit {drawn.asked} asked for more" if drawn.asked is not None and drawn.asked > drawn.samples else ""
    source = f" (prompt set {drawn.prompts})" if drawn.prompts else ""
    more = "extract more prompts (a larger --prompts set, or a larger extract --limit)"
    if not sampling.greedy:
        more += " or more responses per prompt (extract --num-samples)"
    return (
        f"{drawn.samples} samples, all the shards hold{source}{asked}: {rough}; for a firmer answer {more} "
        "and diagnose on those shards"
    )
