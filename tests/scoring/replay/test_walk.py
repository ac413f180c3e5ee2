"""The expected-tau walk of scoring/replay/walk.py (sampling, T > 0) against exhaustive
enumeration of walks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scoring.replay.walk import expected_tau, steps_distribution, walk_end


def _enumerate_steps(probs: np.ndarray, start: int, end: int) -> dict[int, float]:
    """P(S = s) by following every path."""
    if start == end:
        return {0: 1.0}
    out: dict[int, float] = {}
    for n in range(1, probs.shape[1]):
        if probs[start, n] > 0 and start + n <= end:
            for s, w in _enumerate_steps(probs, start + n, end).items():
                out[s + 1] = out.get(s + 1, 0.0) + probs[start, n] * w
    return out


@pytest.mark.parametrize("seed", range(4))
def test_steps_distribution_equals_enumeration(seed):
    rng = np.random.default_rng(seed)
    end, width = 11, 5
    probs = rng.dirichlet(np.ones(width - 1), size=end)
    probs = np.concatenate([np.zeros((end, 1)), probs], axis=1)  # produced >= 1
    for t in range(end):  # the caps: a step never passes the end
        probs[t, end - t + 1 :] = 0
        probs[t] /= probs[t].sum()
    got = steps_distribution(torch.tensor(probs), 0, end).numpy()
    want = _enumerate_steps(probs, 0, end)
    assert np.allclose(got, [want.get(s, 0.0) for s in range(end + 1)])
    tau, mean_steps = expected_tau(torch.tensor(got), end)
    assert tau == pytest.approx(sum(end / s * w for s, w in want.items()))
    assert tau > end / mean_steps  # Jensen: E[N/S] > N / E[S] when S varies


def test_walk_end_and_no_step():
    is_stop = torch.tensor([False, False, False, True, False, False])
    assert walk_end(1, is_stop) == 3 and walk_end(4, is_stop) == 5 and walk_end(3, is_stop) == 3
    steps = steps_distribution(torch.zeros(0, 3, dtype=torch.float64), 3, 3)
    assert expected_tau(steps, 0) == (None, 0.0)
