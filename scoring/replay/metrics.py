"""Acceptance metrics: short pure functions over per-anchor tensors, each stating its definition.

Conventions. An anchor t is a response position where a block [x_t, mask, ...] starts. Block
position k = 1..L (L = block length - 1) drafts the token at t + k; the target's token there is
y_k (the stored greedy token) or -1 where it is unknown (past the end of the response) or past
the block. "bonus-exclusive" counts accepted draft tokens only; "bonus-inclusive" adds the
token the target itself contributes at every step (what the online loop appends).

The semantics, in words: docs/metrics.md.
"""

from __future__ import annotations

import torch


def leading_matches(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """Chain acceptance, bonus-exclusive: the number of leading block positions whose draft
    equals the target token. [A, L] x [A, L] -> [A] int64. Unknown targets (-1) never match."""
    match = (draft_tokens == target_tokens) & (target_tokens >= 0)
    return match.long().cumprod(dim=1).sum(dim=1)


def tree_accepted(pop_index: torch.Tensor, budget: int) -> torch.Tensor:
    """DDTree acceptance alpha, bonus-exclusive: the depth of the deepest node on the target's
    path inside the tree of `budget` nodes. pop_index [A, L] is when the target-path prefix of
    each depth leaves the best-first heap; the tree of budget N is the first N pops and is
    prefix-closed, so alpha = the number of leading depths with pop index < N. -> [A]."""
    return (pop_index < budget).long().cumprod(dim=1).sum(dim=1)


def accepted_len(
    draft_tokens: torch.Tensor, target_tokens: torch.Tensor, pop_index: torch.Tensor, tree_nodes: int | None
) -> torch.Tensor:
    """Accepted draft tokens per anchor (bonus-exclusive) of one method: the chain when
    tree_nodes is None, else the DDTree of `tree_nodes` nodes. -> [A]."""
    if tree_nodes is None:
        return leading_matches(draft_tokens, target_tokens)
    return tree_accepted(pop_index, tree_nodes)


def produced_tokens(
    accepted: torch.Tensor, anchors: torch.Tensor, seq_len: int, next_stop: torch.Tensor
) -> torch.Tensor:
    """Tokens one decoding step at each anchor appends (bonus-inclusive), as `dflash_generate`:
    accepted + 1, capped by the tokens that exist after the anchor (the max_new_tokens budget
    for greedy responses) and cut just after the first stop token.

    produced(t) = min(accepted(t) + 1, seq_len - 1 - t, next_stop(t) - t), where next_stop(t)
    is the first position > t holding a stop token (seq_len + big when none).
    """
    return torch.minimum(torch.minimum(accepted + 1, seq_len - 1 - anchors), next_stop - anchors)


def position_match(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position match, independent of earlier positions: (match [A, L] bool, known [A, L] bool).
    The per-position match rate is match.sum() / known.sum() over any set of anchors."""
    known = target_tokens >= 0
    return (draft_tokens == target_tokens) & known, known


def reached_accept(accepted: torch.Tensor, block_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance per block position conditioned on reaching it (the "where does it die" curve).
    reached[a, k] = accepted[a] >= k (position k+1 was verified); accepted_here[a, k] =
    accepted[a] >= k + 1. Rate at position k+1 = accepted_here.sum(0) / reached.sum(0)."""
    k = torch.arange(block_positions, device=accepted.device)
    return accepted[:, None] >= k[None, :], accepted[:, None] >= k[None, :] + 1


def expected_accepted(target_logprob: torch.Tensor) -> torch.Tensor:
    """Smooth acceptance proxy, bonus-exclusive: sum_k prod_{j<=k} q_j(y_j), the expected
    chain length if each position were accepted independently with the draft's probability
    of the target token. target_logprob [A, L] = log q_k(y_k), NaN where unknown (treated as 0
    probability, so the product stops there)."""
    logp = torch.nan_to_num(target_logprob.double(), nan=float("-inf"))
    return torch.exp(torch.cumsum(logp, dim=1)).sum(dim=1).float()


def kl_on_topk(target_topk_logprobs: torch.Tensor, draft_logprobs_at_topk: torch.Tensor) -> torch.Tensor:
    """KL(p || q) restricted to the target's stored top-k support, both renormalised there:
    p^ = softmax(log p over the support), q^ likewise; KL = sum p^ (log p^ - log q^).
    [..., k] x [..., k] -> [...]."""
    log_p = torch.log_softmax(target_topk_logprobs.float(), dim=-1)
    log_q = torch.log_softmax(draft_logprobs_at_topk.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def position_counts(accepted: torch.Tensor, match: torch.Tensor, known: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per block position, summed over anchors: reached (position verified and its target
    known), accepted (and accepted), match and known (see position_match). [A], [A, L] -> [L] each.
    Counts add over samples; acceptance_by_position turns them into rates."""
    reached, accepted_here = reached_accept(accepted, known.shape[1])
    return {
        "reached": (reached & known).sum(0),
        "accepted": (accepted_here & known).sum(0),
        "match": match.sum(0),
        "known": known.sum(0),
    }


def acceptance_by_position(accepted: torch.Tensor, reached: torch.Tensor) -> torch.Tensor:
    """P(block position k accepted | reached), the "where does acceptance die" curve: summed
    accepted / summed reached per position (NaN where never reached). [L] x [L] -> [L]."""
    return accepted.double() / reached.double()


def wilson_interval(
    accepted: torch.Tensor, reached: torch.Tensor, z: float = 1.959964
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 95% Wilson score interval of each position's rate accepted / reached (NaN where never
    reached). Anchors of one response are not independent, so it is narrower than a resampling
    of responses would give: a reading of the counts, not of the prompts. [L] x [L] -> [L], [L]."""
    n, p = reached.double(), accepted.double() / reached.double()
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * torch.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def match_rate_by_position(match: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """Per-position draft/target agreement, independent of earlier positions: summed match /
    summed known per position (NaN where no target is known). [L] x [L] -> [L]."""
    return match.double() / known.double()


def streak(accepted: torch.Tensor) -> float:
    """All-anchor streak, bonus-exclusive: the mean accepted length over every anchor scored,
    whether or not the walk visits it (denser and steadier than the walk's tau)."""
    return float(accepted.double().mean())


def sample_tau(produced: list[int]) -> float | None:
    """One response's acceptance length (bonus-inclusive): the mean `produced` over its walk's
    steps; None for a response with no step (its first token was already a stop token)."""
    return sum(produced) / len(produced) if produced else None


def tau(per_sample: list[float | None]) -> float:
    """Mean acceptance length, as the DFlash benchmark reports it: the mean over responses of
    each response's sample_tau. Responses with no step (None) are left out, as it does."""
    means = [t for t in per_sample if t is not None]
    return sum(means) / len(means) if means else float("nan")


# --------------------------------------------------------------------------- sampling (T > 0)
# docs/sampling.md#acceptance-given-the-emitted-response: drafts d_j ~ q_j, accepted while u_j q_j(d_j) < p_j(d_j). Given the emitted
# response y (distributed as the target samples), block position j is accepted with probability
# a_j = min(1, q_j(y_j) / p_j(y_j)), conditionally on every earlier position being accepted.


def acceptance_probs(draft_logprob: torch.Tensor, target_logprob: torch.Tensor) -> torch.Tensor:
    """a_j = min(1, q_j(y_j) / p_j(y_j)) from log q and log p [A, L] under the shard's sampling
    settings; 0 where either is unknown (NaN: past the response or the block)."""
    ratio = torch.exp(draft_logprob.double() - target_logprob.double()).clamp(max=1.0)
    return torch.nan_to_num(ratio, nan=0.0)


def survival(accept_probs: torch.Tensor) -> torch.Tensor:
    """P(accepted >= k) = prod_{j<=k} a_j for k = 0..L (k = 0 is 1). [A, L] -> [A, L + 1]."""
    ones = torch.ones_like(accept_probs[:, :1])
    return torch.cat([ones, torch.cumprod(accept_probs, dim=1)], dim=1)


def accepted_distribution(accept_probs: torch.Tensor) -> torch.Tensor:
    """P(accepted = m) for m = 0..L: P(>= m) - P(>= m + 1). [A, L] -> [A, L + 1]."""
    at_least = survival(accept_probs)
    return at_least - torch.cat([at_least[:, 1:], torch.zeros_like(at_least[:, :1])], dim=1)


def expected_accepted_sampled(accept_probs: torch.Tensor) -> torch.Tensor:
    """E[accepted] per anchor, bonus-exclusive: sum_{k>=1} prod_{j<=k} a_j. [A, L] -> [A]."""
    return survival(accept_probs)[:, 1:].sum(dim=1)


def produced_distribution(
    accept_probs: torch.Tensor, anchors: torch.Tensor, seq_len: int, next_stop: torch.Tensor
) -> torch.Tensor:
    """P(produced = n) per anchor for n = 0..L + 1 (bonus-inclusive), each accepted length m
    mapped through produced_tokens' caps (budget, end of response, first stop). -> [A, L + 2]."""
    A, L = accept_probs.shape
    by_accepted = accepted_distribution(accept_probs)  # [A, L + 1]
    m = torch.arange(L + 1)[None, :].expand(A, L + 1)
    produced = produced_tokens(m, anchors[:, None], seq_len, next_stop[anchors][:, None])  # [A, L + 1]
    out = torch.zeros(A, L + 2, dtype=by_accepted.dtype)
    return out.scatter_add_(1, produced.clamp(min=0), by_accepted)


def expected_position_counts(accept_probs: torch.Tensor, known: torch.Tensor) -> dict[str, torch.Tensor]:
    """position_counts' reached / accepted in expectation: reached_k = sum P(accepted >= k - 1),
    accepted_k = sum P(accepted >= k), over anchors whose position k is known. [A, L] -> [L]."""
    at_least = survival(accept_probs)
    return {"reached": (at_least[:, :-1] * known).sum(0), "accepted": (at_least[:, 1:] * known).sum(0)}


def tau_standard_error(per_sample: list[float | None]) -> float | None:
    """Sampling error of tau over responses: std(per-response tau, ddof 1) / sqrt(n); None
    below two responses."""
    means = [t for t in per_sample if t is not None]
    if len(means) < 2:
        return None
    mean = sum(means) / len(means)
    variance = sum((t - mean) ** 2 for t in means) / (len(means) - 1)
    return (variance / len(means)) ** 0.5
