"""The geometry of a proposer that reads the tokens alone and drafts a chain of up to K tokens at
every anchor (an n-gram lookup, a standalone draft model): K = its config's block_size, never
shortened to the budget by the proposer (the walk rule cuts, as the engines do)."""

from __future__ import annotations

import torch

from proposers.interface import Drafts, Needs, point_mass_logprob


class TokenChain:
    needs = Needs()  # the stored tokens alone
    independent_drafts = False  # no per-position marginals: DDTree has nothing to build a tree from

    def __init__(self, config):
        self.config = config
        self.family, self.layout = config.family, config.layout

    @property
    def max_drafts(self) -> int:
        return self.config.block_size

    def block_len(self, remaining: torch.Tensor) -> torch.Tensor:
        return torch.full_like(remaining, self.config.block_size)

    def depth(self, block_len: int) -> int:
        return block_len

    def anchors_per_chunk(self, block_len: int, ctx_len: int, vocab: int, options) -> int:
        return max(1, options.memory_bytes // (64 * block_len))  # a few numbers per draft

    def draft_logprob(self, drafts: Drafts, tokens: torch.Tensor, sampling) -> torch.Tensor:
        """q is a point mass on the draft: the engines verify such drafts by sampling the target."""
        return point_mass_logprob(drafts, tokens, sampling)
