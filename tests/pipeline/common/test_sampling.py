"""pipeline/common/sampling.py: the sampling distribution (temperature, top-p, top-k) equals the
public reference's `_sampling_probs` bit for bit, ties at the top-p boundary included."""

from __future__ import annotations

import pytest
import torch

from pipeline.common.sampling import Sampling, sampling_probs, token_logprob


@pytest.mark.parametrize(
    "temperature, top_p, top_k",
    [(1.0, 1.0, 0), (0.6, 0.95, 20), (0.7, 0.5, 0), (1.3, 0.8, 7), (0.6, 0.95, 64), (0.9, 0.7, 1000), (2.0, 1.0, 5)],
)
@pytest.mark.parametrize("quantised", [False, True])
def test_sampling_probs_equals_reference(temperature, top_p, top_k, quantised):
    from dflash.model import _sampling_probs

    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(32, 64, generator=generator) * 3
    if quantised:  # few distinct values: many equal probabilities, ties at the top-p boundary
        logits = torch.randint(-3, 3, (32, 64), generator=generator).float()
    sampling = Sampling(temperature, top_p, top_k)  # top_k 64 and 1000 are >= V: no top-k filter
    want = _sampling_probs(logits, temperature, top_p, top_k)
    got = sampling_probs(logits, sampling)
    assert torch.equal(got, want)
    tokens = torch.randint(0, 64, (32,), generator=generator)
    assert torch.equal(token_logprob(logits, tokens, sampling), want.gather(-1, tokens[:, None])[:, 0].log())
    if quantised and top_p < 1:
        # Ties really straddle the boundary: equal logits, one token kept and the other dropped.
        straddles = [bool((got[r] > 0).any() and (got[r] == 0).any()) for r in range(32)]
        kept_values = [set(logits[r][got[r] > 0].tolist()) & set(logits[r][got[r] == 0].tolist()) for r in range(32)]
        assert any(s and v for s, v in zip(straddles, kept_values))
