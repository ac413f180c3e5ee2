"""The sampling distribution both stages use at temperature > 0, as the reference defines it.

`sampling_probs` is the public DFlash loop's `_sampling_probs` (docs/sampling.md#the-sampling-distribution): scores =
logits / T; keep the top_k scores when 0 < top_k < V; softmax; when top_p < 1, sort descending
and keep a token while (cumulative probability - its probability) < top_p; renormalise. The
target's responses are sampled from it at extract, its p_t(y_t) is stored, and the drafter's
q_j is computed from it at score. (transformers' logits warpers draw the top-p boundary
differently, so they are not used.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def check(self) -> Sampling:
        """Raise ValueError on settings the reference refuses (its `_validate_sampling`)."""
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"sampling settings temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}: "
                "temperature and top-k must be >= 0 and top-p in (0, 1]"
            )
        return self

    def describe(self) -> str:
        """'greedy' or 'T=0.6, top-p 0.95, top-k 20' (filters that are off left out)."""
        if self.greedy:
            return "greedy"
        parts = [f"T={self.temperature:g}"]
        if self.top_p < 1:
            parts.append(f"top-p {self.top_p:g}")
        if self.top_k > 0:
            parts.append(f"top-k {self.top_k}")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return asdict(self)


def sampling_of(settings: dict) -> Sampling:
    """The sampling settings an extract recorded in its manifest `settings` (greedy when absent)."""
    recorded = settings.get("sampling") or {}
    return Sampling(
        float(recorded.get("temperature", 0.0)), float(recorded.get("top_p", 1.0)), int(recorded.get("top_k", 0))
    )


def sampling_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[..., V] float32 probabilities of the sampling distribution (zero outside top-k/top-p)."""
    scores = logits.float() / sampling.temperature
    vocab = scores.shape[-1]
    indices = None
    if 0 < sampling.top_k < vocab:
        scores, indices = torch.topk(scores, sampling.top_k, dim=-1)
    probs = _top_p(torch.softmax(scores, dim=-1), sampling.top_p)
    if indices is not None:
        probs = torch.zeros_like(logits, dtype=probs.dtype).scatter(-1, indices, probs)
    return probs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference's nucleus rule on [..., n] probabilities, renormalised (same ops, same order,
    so ties at the boundary fall the same way)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p
    probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    return probs / probs.sum(dim=-1, keepdim=True)


def token_logprob(logits: torch.Tensor, tokens: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[...] log p(token) under the sampling distribution of `logits` [..., V]; -inf where the
    token is filtered out. With top-k only the k kept scores are normalised (no [..., V]
    probability tensor); callers chunk rows so the [rows, V] scores fit their memory budget."""
    tokens = tokens.long().clamp(min=0)[..., None]
    scores = logits.float() / sampling.temperature
    if not 0 < sampling.top_k < scores.shape[-1]:
        return _top_p(torch.softmax(scores, dim=-1), sampling.top_p).gather(-1, tokens)[..., 0].log()
    kept, indices = torch.topk(scores, sampling.top_k, dim=-1)
    probs = _top_p(torch.softmax(kept, dim=-1), sampling.top_p)
    return (probs * (indices == tokens)).sum(dim=-1).log()
