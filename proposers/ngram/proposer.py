"""vLLM's n-gram lookup (v1/spec_decode/ngram_proposer.py, its rule read line by line) at every anchor.

At anchor t the tokens so far are x_0 .. x_t (the prompt and the response up to t). For each earlier
position e <= t - 1, the match length there is the longest L <= prompt_lookup_max with
x_{e-L+1..e} = x_{t-L+1..t}; the proposer takes the longest match over e (ties: the earliest e) and,
when it is at least prompt_lookup_min long, proposes x_{e+1} .. x_{e+K}, cut at x_t (fewer than K
drafts near the end; none without a match). vLLM computes it with a KMP scan of the reversed tokens
whose border length is capped at prompt_lookup_max; here the earlier occurrences of x_t are walked
(occurrences.py): the same matches, the same tie rule. Its cap at
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
from proposers.ngram.occurrences import Occurrences, occurrences
from proposers.toolkit.token_chain import TokenChain

UNPROPOSED = -1  # the token at a slot past a short proposal (Drafts.limit says how many there are)


@numba.njit(cache=True, nogil=True)
def _lookup(ids, start, end, min_n, max_n, k, out, first, nxt) -> int:
    """Drafts of the context ids[start:end] into out[:k]; returns how many. The earlier ends e are
    the earlier occurrences of the last token (occurrences.py), earliest first: a strictly longer
    match replaces, so the earliest wins ties, and a match of max_n tokens ends the search."""
    total, last = end - start, end - 1
    if total < min_n:
        return 0
    best, best_end = 0, -1
    e = first[last]
    while e != -1 and e < last:
        length = 1  # ids[e] == ids[last]: the chain holds the last token's occurrences
        while length < max_n and e - length >= start and ids[e - length] == ids[last - length]:
            length += 1
        if length > best:
            best, best_end = length, e
            if best == max_n:
                break
        e = nxt[e]
    if best < min_n:
        return 0
    follow = best_end - start + 1
    count = min(k, total - follow)
    for j in range(count):
        out[j] = ids[start + follow + j]
    return count


@numba.njit(cache=True, nogil=True)
def lookup_drafts(ids, starts, anchors, min_n, max_n, k, out, counts, first, nxt) -> None:
    """For anchor i (position anchors[i] of the sample starting at starts[i] in ids): its drafts in
    out[i] and their number in counts[i]; first / nxt: the occurrence chains of ids (occurrences.py)."""
    for i in range(anchors.shape[0]):
        counts[i] = _lookup(ids, starts[i], starts[i] + anchors[i] + 1, min_n, max_n, k, out[i], first, nxt)


class NgramProposer(TokenChain):
    """An n-gram lookup as a Proposer: tokens only, no state, K drafts (or fewer) per anchor; vLLM's
    `ngram` (here) or llama-server's `ngram-simple` (llama_simple.py), as the config's rule says.
    Neither engine shortens the K drafts to the budget (TokenChain)."""

    def prepare(self, samples, target, options):
        """The occurrence chains of the samples' tokens (occurrences.py), which every lookup walks."""
        ids = [tokens.cpu().numpy() for tokens, _ in samples]
        lengths = np.array([len(t) for t in ids], dtype=np.int64)
        return occurrences(np.concatenate(ids), lengths), [None for _ in ids]

    def propose(self, packed: PackedTokens, chunks: list[Chunk], target, options) -> list[Drafts]:
        ids, starts = packed.ids.cpu().numpy(), packed.starts.cpu().numpy()
        return [self._drafts(ids, starts, packed.state, chunk) for chunk in chunks]

    def _drafts(self, ids: np.ndarray, starts: np.ndarray, chains: Occurrences, chunk: Chunk) -> Drafts:
        anchors = chunk.anchors.cpu().numpy()
        out = np.full((anchors.shape[0], chunk.block_len), UNPROPOSED, dtype=ids.dtype)
        counts = np.zeros(anchors.shape[0], dtype=np.int64)
        cfg, starts = self.config, starts[chunk.sample_idx.cpu().numpy()]
        if cfg.rule == "ngram-simple":
            simple_drafts(ids, starts, anchors, cfg.min_n, chunk.block_len, out, counts, chains.prev)
        else:
            lookup_drafts(
                ids, starts, anchors, cfg.min_n, cfg.max_n, chunk.block_len, out, counts, chains.first, chains.nxt
            )
        device = chunk.anchors.device
        return Drafts(None, torch.from_numpy(out).long().to(device), torch.from_numpy(counts).to(device))
