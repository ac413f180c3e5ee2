"""vLLM's suffix decoding (method "suffix": v1/spec_decode/suffix_decoding.py over Arctic Inference's
SuffixDecodingCache, arctic-inference 0.3.0) at every anchor, as a Proposer.

At anchor t (x_0 .. x_t known: the prompt and the stored response up to t) the drafts are what vLLM's
proposer returns after the target produced x_t: the best chain of the sample's own tree (its prompt
and response so far) and of the global tree (the responses of the samples served before it, and its
own so far), cache.py has the rule. Teacher forcing is exact: the trees take only sampled tokens,
which along the stored response are the stored tokens, and appending them a step's worth at a time
or one by one leaves the same tree (SuffixTree::extend appends them one by one,
csrc/suffix_decoding/suffix_tree.cc:506-511); so the drafts at t read x_0 .. x_t and earlier samples
only, never an earlier draft, and draft j is what vLLM proposes whatever drafts 1..j-1 were. q is a
point mass on the drafts (nothing is sampled; at T > 0 vLLM's rejection sampler accepts a draft with
probability p(draft)). vLLM cuts the draft at max_model_len - 1 (suffix_decoding.py:83-85): not
applied, a response never reaches it here.

State across samples: the global tree, so a sample's drafts depend on the samples served before it
and on their order. The replay serves every sample once, one at a time, to its end, in replay order
(`serve`, called by scoring/replay/packing.py for each group before `prepare`), and run.json records
that order (`requests`). What an engine serving requests concurrently sees differs: a request's
global tree also holds the partial responses of the requests served beside it. The global tree gets
each stored response in full; vLLM's last step of a request may add a few tokens past it (drafts
accepted after the stop token or the budget, which the stored response does not hold).
"""

from __future__ import annotations

import numpy as np
import torch

from proposers.interface import Chunk, Drafts, PackedTokens
from proposers.suffix.cache import SuffixCache
from proposers.toolkit.token_chain import TokenChain


class SuffixProposer(TokenChain):
    """Suffix decoding as a Proposer: tokens only; up to num_speculative_tokens drafts per anchor, as
    many as the trees' best match offers; state kept across the samples served."""

    def __init__(self, config):
        super().__init__(config)
        cfg = self.config
        self.cache = SuffixCache(cfg.max_tree_depth, cfg.max_cached_requests, cfg.max_spec_factor, cfg.min_token_prob)
        self.served: tuple[np.ndarray, np.ndarray] | None = None  # the last `serve`'s drafts, for `prepare`
        if cfg.max_cached_requests == 0:
            self.requests = "vLLM's suffix decoding with its global tree off: no request changes another's drafts"
        else:  # a request's own response takes one of the slots (cache.py)
            before = cfg.max_cached_requests - 1
            self.requests = f"vLLM's suffix decoding drafts from the responses of up to {before} requests before"

    def serve(self, requests: list[tuple[torch.Tensor, int]]) -> None:
        """The next samples (token ids, prompt length), served in this order after those served
        before: their drafts at every position, end to end, for `prepare`. The draft length is read
        here, not at construction: `score --steps` sets it after the proposer is built."""
        drafts, counts = [], []
        for tokens, prompt_len in requests:
            ids = tokens.detach().cpu().numpy().astype(np.int64)
            out, count = self.cache.serve(ids, int(prompt_len), self.config.block_size)
            drafts.append(out)
            counts.append(count)
        self.served = (np.concatenate(drafts), np.concatenate(counts))

    def prepare(self, samples, target, options):
        """The drafts `serve` computed for these samples (the same ones, in the same order)."""
        lengths = [tokens.numel() for tokens, _ in samples]
        if self.served is None or self.served[0].shape[0] != sum(lengths):
            raise RuntimeError("suffix decoding: prepare() without serve() of the same samples first")
        state, self.served = self.served, None
        return state, [None for _ in lengths]

    def propose(self, packed: PackedTokens, chunks: list[Chunk], target, options) -> list[Drafts]:
        return [self._drafts(packed, chunk) for chunk in chunks]

    def _drafts(self, packed: PackedTokens, chunk: Chunk) -> Drafts:
        drafts, counts = packed.state
        rows = (packed.starts[chunk.sample_idx] + chunk.anchors).cpu().numpy()
        device = chunk.anchors.device
        tokens = torch.from_numpy(drafts[rows, : chunk.block_len]).long().to(device)
        limit = torch.from_numpy(np.minimum(counts[rows], chunk.block_len)).to(device)
        return Drafts(None, tokens, limit)
