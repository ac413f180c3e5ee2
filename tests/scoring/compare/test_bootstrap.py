"""The paired bootstrap of `specreplay compare` (scoring/compare/bootstrap.py): the interval's
coverage, what pairing buys, seeding and validation, the ratio bootstrap, the verdict's words."""

from __future__ import annotations

import numpy as np
import pytest

from scoring.compare.bootstrap import paired_bootstrap, paired_ratio_bootstrap, verdict


def test_coverage_of_the_interval():
    """Over 100 synthetic datasets with a known mean difference the 95% interval covers it in
    roughly 95% of them (percentile bootstrap at n = 60 undercovers slightly)."""
    rng = np.random.default_rng(3)
    truth, covered = 0.2, 0
    for trial in range(100):
        a = rng.gamma(2.0, 1.0, 60) + 1.0
        b = a + truth + rng.normal(0, 0.5, 60)  # differences: mean = truth
        _, low, high = paired_bootstrap(a, b, resamples=1000, seed=trial)
        covered += low <= truth <= high
    assert 88 <= covered <= 99, covered


def test_pairing_narrows_the_interval():
    rng = np.random.default_rng(4)
    a = rng.normal(3.0, 1.0, 300)  # large spread between samples ...
    b = a + 0.05 + rng.normal(0, 0.02, 300)  # ... small, consistent shift within each sample
    delta, low, high = paired_bootstrap(a, b, resamples=2000, seed=0)
    # the unpaired bootstrap resamples A and B independently
    ia, ib = rng.integers(0, 300, (2, 2000, 300))
    unpaired = b[ib].mean(axis=1) - a[ia].mean(axis=1)
    u_low, u_high = np.quantile(unpaired, [0.025, 0.975])
    assert (high - low) < 0.05 * (u_high - u_low)
    assert low > 0 and u_low < 0 < u_high  # only the paired interval sees the shift
    assert delta == pytest.approx(0.05, abs=0.005)


def test_bootstrap_is_seeded_and_validated():
    a, b = np.arange(10.0), np.arange(10.0) + np.linspace(-1, 2, 10)
    assert paired_bootstrap(a, b, seed=7) == paired_bootstrap(a, b, seed=7)
    assert paired_bootstrap(a, b, seed=7) != paired_bootstrap(a, b, seed=8)
    with pytest.raises(ValueError, match="same length"):
        paired_bootstrap(a, b[:5])
    with pytest.raises(ValueError, match="empty"):
        paired_bootstrap(a[:0], b[:0])
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap(a, b, confidence=95)
    with pytest.raises(ValueError, match="NaN"):
        paired_bootstrap(np.array([1.0, np.nan]), np.array([1.0, 2.0]))
    # a wider confidence level gives a wider interval
    _, l90, h90 = paired_bootstrap(a, b, confidence=0.90)
    _, l99, h99 = paired_bootstrap(a, b, confidence=0.99)
    assert l99 <= l90 and h99 >= h90


def test_ratio_bootstrap_reduces_to_the_mean_bootstrap():
    rng = np.random.default_rng(9)
    a, b = rng.uniform(0, 3, 50), rng.uniform(0, 3, 50)
    assert paired_ratio_bootstrap(a, b, np.ones(50), seed=4) == pytest.approx(paired_bootstrap(a, b, seed=4))
    with pytest.raises(ValueError, match="positive"):
        paired_ratio_bootstrap(a, b, np.zeros(50))


def test_verdict_words():
    assert verdict(0.31, 0.22, 0.40) == "B is better by 0.31 tau, 95% CI 0.22 to 0.40"
    assert verdict(-0.31, -0.40, -0.22) == "A is better by 0.31 tau, 95% CI 0.22 to 0.40"
    assert verdict(0.02, -0.05, 0.09) == "no significant difference (B - A = 0.02, 95% CI -0.05 to 0.09)"
    assert verdict(0.004, 0.002, 0.006, confidence=0.9) == "B is better by 0.004 tau, 90% CI 0.002 to 0.006"
    assert verdict(1.0, 1.0, 1.0, n=1).startswith("too few paired samples")
