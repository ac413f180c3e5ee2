"""vLLM's suffix decoding over the stored samples, served one after the other: Arctic Inference's
SuffixDecodingCache (arctic_inference/suffix_decoding/cache.py of arctic-inference 0.3.0, cited
`cache.py:`) driven as vLLM's SuffixDecodingProposer drives it (vllm/v1/spec_decode/suffix_decoding.py
of vLLM 0.33.0, cited `vllm:`).

vLLM, per request: at its first step with sampled tokens (the prefill's, vllm:51-54) it starts the
request (vllm:64-71): the prompt goes into a tree of the request's own (cache.py:153-154) and, unless
max_cached_requests is 0, the request takes a slot of the global tree, the oldest cached response
evicted (FIFO) while more than max_cached_requests are held (cache.py:155-161, 335-347). Each step it
appends the tokens just sampled to both trees (vllm:74, cache.py:208-215), then speculates from the
last max_tree_depth tokens of prompt + output (vllm:78-88): each tree's best chain (speculate.py),
the request's own tree winning a tie (cache.py:287-308). The prompt never enters the global tree; a
finished request's response stays there for later ones. So at anchor t of a sample (x_0 .. x_t known:
prompt and response up to t) the draft reads the sample's tree over x_0 .. x_t and the global tree
over the responses cached before it and x_P .. x_t of its own.
"""

from __future__ import annotations

from collections import deque

import numba
import numpy as np

from proposers.suffix.sequences import append, remove, start_sequence
from proposers.suffix.speculate import speculate
from proposers.suffix.tree import new_tree, with_room

UNPROPOSED = -1  # a slot past a short draft (the counts say how many there are)


@numba.njit(cache=True, nogil=True)
def serve_sample(mine, shared, use_shared, ids, prompt_len, offset, k, factor, min_prob, out, counts):
    """One sample served: its tokens ids (prompt_len of them the prompt) into its own tree `mine`, its
    response also into `shared` (the global tree, at store position `offset` on) when `use_shared`;
    the draft after each response position t but the last in out[t, :counts[t]]."""
    depth, total = mine[5].shape[0], ids.shape[0]
    ours, theirs, scratch = np.empty(k, np.int64), np.empty(k, np.int64), np.empty(k, np.int64)
    for p in range(prompt_len):
        append(mine, p)
    if use_shared:
        start_sequence(shared)
    for t in range(prompt_len, total):
        append(mine, t)
        if use_shared:
            append(shared, offset + t - prompt_len)
        if t + 1 == total:  # the last token: no anchor, but later samples see it in the global tree
            break
        lo = max(0, t + 1 - depth)
        n_ours, score_ours = speculate(mine, ids, lo, t + 1, k, factor, min_prob, ours, scratch)
        n_theirs, score_theirs = 0, np.float32(0.0)
        if use_shared:
            n_theirs, score_theirs = speculate(shared, ids, lo, t + 1, k, factor, min_prob, theirs, scratch)
        if score_ours >= score_theirs:
            out[t, :n_ours], counts[t] = ours[:n_ours], n_ours
        else:
            out[t, :n_theirs], counts[t] = theirs[:n_theirs], n_theirs


class SuffixCache:
    """The global tree and its FIFO of cached responses, across every sample served."""

    def __init__(self, depth: int, max_cached: int, factor: float, min_prob: float):
        self.depth, self.max_cached = depth, max_cached
        # Arctic's arguments are C++ floats (csrc/suffix_decoding/bindings.cc:45-76)
        self.factor, self.min_prob = np.float32(factor), np.float32(min_prob)
        self.shared = new_tree(16, np.zeros(1024, dtype=np.int64), depth)
        self.cached: deque[tuple[int, int]] = deque()  # store ranges of the cached responses, oldest first
        self.stored = 0  # tokens written to the global tree's store

    def serve(self, ids: np.ndarray, prompt_len: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """([N, k] drafts after each position, [N] how many) of the next sample (its int64 tokens): up
        to k = num_speculative_tokens drafts at each response position but the last, none elsewhere."""
        out = np.full((ids.shape[0], k), UNPROPOSED, dtype=np.int64)
        counts = np.zeros(ids.shape[0], dtype=np.int64)
        if ids.shape[0] <= prompt_len:  # no sampled token: vLLM never starts the request (vllm:51-54)
            return out, counts
        use_shared = self.max_cached != 0
        offset = self._start(ids[prompt_len:]) if use_shared else 0
        mine = new_tree(2 * ids.shape[0] + 2, ids, self.depth)  # at most 2n + 1 nodes over n suffixes
        serve_sample(mine, self.shared, use_shared, ids, prompt_len, offset, k, self.factor, self.min_prob, out, counts)
        return out, counts

    def _start(self, response: np.ndarray) -> int:
        """The response's slot in the global tree, the oldest evicted past max_cached (cache.py:335-347);
        where in the store it goes."""
        offset = self.stored
        self.cached.append((offset, offset + response.shape[0]))
        while len(self.cached) > self.max_cached:
            begin, end = self.cached.popleft()
            remove(self.shared, begin, end)
        suffixes = sum(end - begin for begin, end in self.cached)
        self.shared = with_room(self.shared, 2 * suffixes + 2, offset + response.shape[0])
        self.shared[4][offset : offset + response.shape[0]] = response
        self.stored = offset + response.shape[0]
        return offset
