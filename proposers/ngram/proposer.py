"""vLLM's n-gram lookup (v1/spec_decode/ngram_proposer.py, its rule read line by line) at every anchor.

At anchor t the tokens so far are x_0 .. x_t (the prompt and the response up to t). For each earlier
position e <= t - 1, the match length there is the longest L <= prompt_lookup_max with
x_{e-L+1..e} = x_{t-L+1..t}; the proposer takes the longest match over e (ties: the earliest e) and,
when it is at least prompt_lookup_min long, proposes x_{e+1} .. x_{e+K}, cut at x_t (fewer than K
drafts near the end; none without a match). vLLM computes it with a KMP scan of the reversed tokens
whose border length is capped at prompt_lookup_max: the same matches, the same tie rule. Its cap at
max_model_len is not applied (a response never reaches it here).

The drafts at t read only x_0 .. x_t, never an earlier draft, so teacher forcing is exact: draft j is
what vLLM proposes whatever drafts 1..j-1 were. q is a point mass on the drafts (an n-gram samples
nothing: at T > 0 vLLM's rejection sampler accepts a draft with probability p(draft)).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from proposers.interface import Chunk, Drafts, PackedTokens
from proposers.ngram.llama_simple import simple_drafts
from proposers.toolkit.token_chain import TokenChain

UNPROPOSED = -1  # the token at a slot past a short proposal (Drafts.limit says how many there are)


@numba.njit(cache=True, nogil=True)
def _lookup(ids, start, end, min_n, max_n, k, out) -> int:
    """Drafts of the context ids[start:end] into out[:k]; returns how many."""
    total = end - start
    if total < min_n:
        return 0
    best, best_end = 0, -1
    for e in range(total - 1):  # earlier ends; a strictly longer match replaces: the earliest wins ties
        length = 0
        while length < max_n and length <= e and ids[start + e - length] == ids[end - 1 - length]:
            length += 1
        if length > best:
            best, best_end = length, e
    if best < min_n:
        return 0
    follow = best_end + 1
    count = min(k, total - follow)
    for j in range(count):
        out[j] = ids[start + follow + j]
    return count


@numba.njit(cache=True, nogil=True)
def lookup_drafts(ids, starts, anchors, min_n, max_n, k, out, counts) -> None:
    """For anchor i (position anchors[i] of the sample starting at starts[i] in ids): its drafts in
    out[i] and their number in counts[i]."""
    for i in range(anchors.shape[0]):
        counts[i] = _lookup(ids, starts[i], starts[i] + anchors[i] + 1, min_n, max_n, k, out[i])


class NgramProposer(TokenChain):
    """An n-gram lookup as a Proposer: tokens only, no state, K drafts (or fewer) per anchor; vLLM's
    `ngram` (here) or llama-server's `ngram-simple` (llama_simple.py), as the config's rule says.
    Neither engine shortens the K drafts to the budget (TokenChain)."""

    def prepare(self, samples, target, options):
        return None, [None for _ in samples]  # nothing to compute ahead: the lookup reads the tokens

    def propose(self, packed: PackedTokens, chunks: list[Chunk], target, options) -> list[Drafts]:
        ids, starts = packed.ids.cpu().numpy(), packed.starts.cpu().numpy()
        return [self._drafts(ids, starts, chunk) for chunk in chunks]

    def _drafts(self, ids: np.ndarray, starts: np.ndarray, chunk: Chunk) -> Drafts:
        anchors = chunk.anchors.cpu().numpy()
        out = np.full((anchors.shape[0], chunk.block_len), UNPROPOSED, dtype=ids.dtype)
        counts = np.zeros(anchors.shape[0], dtype=np.int64)
        cfg, starts = self.config, starts[chunk.sample_idx.cpu().numpy()]
        if cfg.rule == "ngram-simple":
            simple_drafts(ids, starts, anchors, cfg.min_n, chunk.block_len, out, counts)
        else:
            lookup_drafts(ids, starts, anchors, cfg.min_n, cfg.max_n, chunk.block_len, out, counts)
        device = chunk.anchors.device
        return Drafts(None, torch.from_numpy(out).long().to(device), torch.from_numpy(counts).to(device))
