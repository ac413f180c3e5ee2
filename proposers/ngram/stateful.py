"""llama-server's n-gram types that keep state along the server's loop (ngram-map-k, ngram-map-k4v:
llama_map.py; ngram-mod: llama_mod.py; ngram-cache: llama_cache.py) as a ServerStateful proposer (proposers/interface.py): the
replay begins each request, asks for each step's draft along the walk and reports what the server
counted as accepted, as llama-server does for one slot serving the requests one after another.

The server calls the type only when it can verify a draft (Chunk.room > 0, get_n_draft_max) and
reports acceptance only after a step that had one (tools/server/server-context.cpp:2983-3027, 3945);
a draft call changes the state even when it returns nothing (ngram-mod's table, ngram-map's index).
"""

from __future__ import annotations

import torch

from proposers.interface import Chunk, Drafts, PackedTokens
from proposers.ngram.llama_cache import NgramCache
from proposers.ngram.llama_map import NgramMap
from proposers.ngram.llama_mod import NgramMod
from proposers.toolkit.token_chain import TokenChain

UNPROPOSED = -1


def engine_of(config):
    """One slot's state machine for the config's type (and ngram-mod's shared table)."""
    if config.rule == "ngram-mod":
        return NgramMod(config.min_n, config.n_min, config.block_size)
    if config.rule == "ngram-cache":
        return NgramCache()
    return NgramMap(config.min_n, config.block_size, config.rule == "ngram-map-k", config.min_hits)


class LlamaStatefulProposer(TokenChain):
    """Drafts along the server's loop; `begin`, one-anchor `propose` calls and `accept` in walk order."""

    def __init__(self, config):
        super().__init__(config)
        self.engine = engine_of(config)
        self.tokens: list[int] = []  # the current request's sample: H = tokens[:t], s = tokens[t]
        self.drafted = False  # the last step had a draft: the server reports its acceptance

    def prepare(self, samples, target, options):
        return None, [None for _ in samples]  # the state lives across requests, in self.engine

    def begin(self, packed: PackedTokens, sample_idx: int) -> None:
        start, length = int(packed.starts[sample_idx]), int(packed.lengths[sample_idx])
        self.tokens = packed.ids[start : start + length].tolist()
        self.engine.begin(self.tokens, int(packed.prompt_lens[sample_idx]))
        self.drafted = False

    def propose(self, packed: PackedTokens, chunks: list[Chunk], target, options) -> list[Drafts]:
        [chunk] = chunks  # one step at a time (scoring/replay/anchors.py replay_walks)
        assert chunk.anchors.numel() == 1 and chunk.room is not None, "replayed one step at a time, llama.cpp loop"
        anchor, room = int(chunk.anchors[0]), int(chunk.room[0])
        drafts = self.engine.draft(self.tokens, anchor)[: chunk.block_len] if room > 0 else []
        self.drafted = bool(drafts)
        out = torch.full((1, chunk.block_len), UNPROPOSED, dtype=torch.long)
        out[0, : len(drafts)] = torch.tensor(drafts, dtype=torch.long)
        device = chunk.anchors.device
        return [Drafts(None, out.to(device), torch.tensor([len(drafts)], device=device))]

    def accept(self, accepted: int) -> None:
        if self.drafted:
            self.engine.accept(accepted)
