"""The sampled (T > 0) acceptance formulas of scoring/replay/metrics.py against simulation of the
reference's rejection sampling (the expected-tau walk of walk.py: test_walk.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scoring.replay import metrics


def _simulate_block(p: np.ndarray, q: np.ndarray, rng) -> tuple[np.ndarray, int]:
    """One block of the reference's rejection sampling with per-position target p [L+1, V] and
    drafter q [L, V] (independent of the prefix): drafts d_j ~ q_j, accepted while
    u q(d) < p(d), bonus from normalise(max(0, p - q)) (p at the last position when all are
    accepted). Returns the response continuation y [L+1] (tokens after the block's emission
    drawn from p, as later steps would in distribution) and the accepted count."""
    L, V = q.shape
    drafts = np.array([rng.choice(V, p=q[j]) for j in range(L)])
    accepted = 0
    while accepted < L and rng.random() * q[accepted, drafts[accepted]] < p[accepted, drafts[accepted]]:
        accepted += 1
    if accepted == L:
        bonus = rng.choice(V, p=p[L])
    else:
        residual = np.maximum(p[accepted] - q[accepted], 0)
        bonus = rng.choice(V, p=residual / residual.sum() if residual.sum() > 0 else p[accepted])
    y = list(drafts[:accepted]) + [bonus]
    y += [rng.choice(V, p=p[j]) for j in range(len(y), L + 1)]
    return np.array(y), accepted


def _expected_given(y: np.ndarray, p: np.ndarray, q: np.ndarray, rule: str = "min(1,q/p)") -> float:
    L = q.shape[0]
    log_q = torch.tensor(np.log(q[np.arange(L), y[:L]]))[None]
    log_p = torch.tensor(np.log(p[np.arange(L), y[:L]]))[None]
    if rule == "q":  # a plausible wrong formula: accept with the draft's probability of the token
        return float(metrics.expected_accepted_sampled(log_q.exp()))
    return float(metrics.expected_accepted_sampled(metrics.acceptance_probs(log_q, log_p)))


def test_expected_acceptance_given_the_emitted_tokens_matches_rejection_sampling():
    """E[accepted | y] = sum_k prod_{j<=k} min(1, q_j(y_j)/p_j(y_j)): the simulated accepted count
    minus that expectation, given each run's own emitted tokens, has mean zero; the rule
    'accept with q_j(y_j)' is far off."""
    rng = np.random.default_rng(0)
    L, V = 4, 6
    p = rng.dirichlet(np.ones(V) * 0.7, size=L + 1)
    q = 0.6 * p[:L] + 0.4 * rng.dirichlet(np.ones(V), size=L)  # a drafter close to the target
    runs = [_simulate_block(p, q, rng) for _ in range(6000)]
    right = np.array([acc - _expected_given(y, p, q) for y, acc in runs])
    wrong = np.array([acc - _expected_given(y, p, q, "q") for y, acc in runs])
    se = right.std(ddof=1) / np.sqrt(len(runs))
    assert abs(right.mean()) < 3 * se, (right.mean(), se)
    assert abs(wrong.mean()) > 10 * wrong.std(ddof=1) / np.sqrt(len(runs)), wrong.mean()
    # and the emitted first token is distributed as the target samples (exactness)
    first = np.bincount([y[0] for y, _ in runs], minlength=V) / len(runs)
    assert np.abs(first - p[0]).max() < 4 * np.sqrt(p[0] * (1 - p[0]) / len(runs)).max()


def test_distributions_sum_to_one_and_respect_the_caps():
    torch.manual_seed(0)
    a = torch.rand(5, 7, dtype=torch.float64)
    a[:, 5:] = 0  # a truncated block
    dist = metrics.accepted_distribution(a)
    assert torch.allclose(dist.sum(1), torch.ones(5, dtype=torch.float64)) and (dist >= -1e-15).all()
    assert torch.allclose((dist * torch.arange(8)).sum(1), metrics.expected_accepted_sampled(a))
    anchors = torch.tensor([0, 1, 2, 3, 4])
    next_stop = torch.tensor([3, 3, 3, 30, 30, 30, 30, 30, 30, 30, 30])  # a stop token at position 3
    produced = metrics.produced_distribution(a, anchors, 9, next_stop)
    assert torch.allclose(produced.sum(1), torch.ones(5, dtype=torch.float64))
    assert produced[0, 4:].sum() == 0 and produced[2, 2:].sum() == 0  # cut just after the stop
    assert produced[4, 5:].sum() == 0  # anchor 4 of a 9-token sequence: at most 4 tokens remain


def test_tau_standard_error():
    assert metrics.tau_standard_error([1.0, None]) is None
    values = [1.0, 2.0, 4.0, None]
    assert metrics.tau_standard_error(values) == pytest.approx(np.std([1, 2, 4], ddof=1) / np.sqrt(3))


def test_sampling_acceptance_probabilities():
    log_q = torch.log(torch.tensor([[0.2, 0.5, float("nan")]]))
    log_p = torch.log(torch.tensor([[0.4, 0.25, 0.3]]))
    a = metrics.acceptance_probs(log_q, log_p)
    assert torch.allclose(a, torch.tensor([[0.5, 1.0, 0.0]], dtype=torch.float64))
    counts = metrics.expected_position_counts(a, torch.tensor([[True, True, False]]))
    assert torch.allclose(counts["reached"], torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64))
    assert torch.allclose(counts["accepted"], torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64))
