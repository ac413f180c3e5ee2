"""The statistics of `specreplay compare`: paired bootstrap intervals and their plain-words verdicts.

Definitions (a[i], b[i] are the values of paired sample i under A and B; n pairs):

- Paired percentile bootstrap: resample the n pairs with replacement (an index matrix
  [resamples, n], numpy, seeded), recompute the statistic on each resample, and take the
  (1 - confidence) / 2 and (1 + confidence) / 2 quantiles over the resamples as the interval.
  The statistic is mean(b) - mean(a) (paired_bootstrap), or, when sample i contributes sums over
  its counts[i] anchors, sum(b) / sum(counts) - sum(a) / sum(counts) (paired_ratio_bootstrap).
- Verdict: B (A) is better when the whole interval of B - A lies above (below) zero; otherwise
  no significant difference. n < 2 pairs support no verdict; below FEW_SAMPLES pairs the
  interval is unreliable (too narrow).
- Chance: of k intervals at confidence c, about k * (1 - c) exclude zero by chance alone when
  nothing differs.
"""

from __future__ import annotations

import math
from enum import Enum

import numpy as np

FEW_SAMPLES = 20  # below this many pairs a percentile bootstrap interval is unreliable
# indices drawn per bootstrap chunk: bounds memory at ~32 MiB of int64 whatever n and resamples are
_CHUNK_ELEMENTS = 1 << 22


def _bootstrap_means(numerator: np.ndarray, denominator: np.ndarray | None, resamples: int, seed: int) -> np.ndarray:
    """Per resample: mean(numerator[idx]) or sum(numerator[idx]) / sum(denominator[idx])."""
    n = numerator.size
    rng = np.random.default_rng(seed)
    chunk = max(1, _CHUNK_ELEMENTS // n)
    means = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        index = rng.integers(0, n, size=(stop - start, n))
        if denominator is None:
            means[start:stop] = numerator[index].mean(axis=1)
        else:
            means[start:stop] = numerator[index].sum(axis=1) / denominator[index].sum(axis=1)
    return means


def _validate(arrays: list[np.ndarray], resamples: int, confidence: float) -> None:
    """ValueError unless the arrays are paired (1-d, equal length, not empty) and finite, and
    0 < confidence < 1 and resamples >= 1."""
    if any(x.ndim != 1 or x.shape != arrays[0].shape for x in arrays):
        shapes = " and ".join(str(x.shape) for x in arrays)
        raise ValueError(f"a and b must be 1-d arrays of the same length (paired samples); got shapes {shapes}")
    if arrays[0].size == 0:
        raise ValueError("no paired samples to compare (a and b are empty)")
    if not all(np.isfinite(x).all() for x in arrays):
        raise ValueError("a and b must be finite; drop samples with a null/NaN tau before bootstrapping")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be between 0 and 1 (e.g. 0.95); got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1 (e.g. 2000); got {resamples}")


def paired_bootstrap(
    a: np.ndarray, b: np.ndarray, resamples: int = 2000, seed: int = 0, confidence: float = 0.95
) -> tuple[float, float, float]:
    """(delta, low, high) for delta = mean(b) - mean(a) over paired samples a[i], b[i].

    The interval is the paired percentile bootstrap: an index matrix [resamples, n] drawn
    with replacement (numpy, seeded; chunked over resamples to bound memory), the mean of
    b - a on each resample, and its (1 - confidence) / 2 and (1 + confidence) / 2 quantiles.
    mean(b[idx]) - mean(a[idx]) equals mean((b - a)[idx]), so the differences are resampled.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    _validate([a, b], resamples, confidence)
    diff = b - a
    means = _bootstrap_means(diff, None, resamples, seed)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(diff.mean()), float(low), float(high)


def paired_ratio_bootstrap(
    sum_a: np.ndarray,
    sum_b: np.ndarray,
    counts: np.ndarray,
    resamples: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> tuple[float, float, float]:
    """(delta, low, high) for the anchor-weighted delta = sum(sum_b) / sum(counts) -
    sum(sum_a) / sum(counts), where sample i contributes sum_a[i], sum_b[i] over its counts[i]
    anchors (> 0). Samples are resampled as in paired_bootstrap (same seed, same draws) and
    sum((sum_b - sum_a)[idx]) / sum(counts[idx]) is taken on each resample."""
    sum_a, sum_b, counts = (np.asarray(x, dtype=np.float64) for x in (sum_a, sum_b, counts))
    _validate([sum_a, sum_b, counts], resamples, confidence)
    if (counts <= 0).any():
        raise ValueError("counts must be positive (anchors per sample)")
    diff = sum_b - sum_a
    means = _bootstrap_means(diff, counts, resamples, seed)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(diff.sum() / counts.sum()), float(low), float(high)


def digits(*values: float) -> int:
    """Decimals that show the smallest nonzero magnitude among values (2 at least, 4 at most)."""
    decimals = 2
    smallest = min((abs(v) for v in values if v), default=1.0)
    while decimals < 4 and round(smallest, decimals) == 0:
        decimals += 1
    return decimals


class Judgement(str, Enum):
    """B against A, read from an interval of B - A."""

    BETTER = "better"
    WORSE = "worse"
    UNCHANGED = "no significant change"


def judge(low: float, high: float) -> Judgement:
    """The one verdict rule (compare, watch, diagnose): better when the interval lies above zero,
    worse when it lies below, otherwise no significant difference."""
    if low > 0:
        return Judgement.BETTER
    if high < 0:
        return Judgement.WORSE
    return Judgement.UNCHANGED


def verdict(
    delta: float, low: float, high: float, confidence: float = 0.95, n: int | None = None, unit: str = "tau"
) -> str:
    """Plain words for a B - A interval: 'B is better by 0.31 tau, 95% CI 0.22 to 0.40' when low > 0;
    'A is better by ...' (the interval of A - B) when high < 0; otherwise 'no significant
    difference (B - A = ..., 95% CI ... to ...)'. n < 2 pairs cannot support a verdict."""
    level = f"{confidence * 100:g}%"
    if n is not None and n < 2:
        return f"too few paired samples to judge (n = {n})"
    d = digits(delta, low, high)
    judged = judge(low, high)
    if judged == Judgement.BETTER:
        return f"B is better by {delta:.{d}f} {unit}, {level} CI {low:.{d}f} to {high:.{d}f}"
    if judged == Judgement.WORSE:
        return f"A is better by {-delta:.{d}f} {unit}, {level} CI {-high:.{d}f} to {-low:.{d}f}"
    return f"no significant difference (B - A = {delta:.{d}f}, {level} CI {low:.{d}f} to {high:.{d}f})"


def chance_note(intervals: int, confidence: float) -> str:
    """'32 intervals at 95%: expect about 1-2 to exclude zero by chance ...': the expected count is
    intervals * (1 - confidence)."""
    level = f"{confidence * 100:g}%"
    expected = intervals * (1.0 - confidence)
    if expected < 1:
        about = f"fewer than 1 ({expected:.2g})"
    elif math.isclose(expected, round(expected)):
        about = f"about {round(expected)}"
    else:
        about = f"about {math.floor(expected)}-{math.ceil(expected)}"
    noun = "interval" if intervals == 1 else "intervals"
    return f"{intervals} {noun} at {level}: expect {about} to exclude zero by chance alone when nothing differs"
