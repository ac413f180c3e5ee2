"""The P-EAGLE drafter model: the EAGLE-style decoder (proposers/toolkit/eagle/decoder.py, its
weights and names) and `mask_hidden` [1, 1, n*H], the learned stand-in for the target's features
at the positions that have none yet.

Inference (vLLM's parallel drafting, v1/spec_decode/llm_base_proposer.py with `parallel_drafting`:
one forward a step): the verified slots as EAGLE-3 writes them (slot s from (embed(x_{s+1}), fc(g_s)) at
position s), then K - 1 slots of (embed(mask_token_id), fc(mask_hidden)) at positions t .. t + K - 2
after slot t - 1, causal; the outputs of slot t - 1 and of the K - 1 mask slots are drafts 1..K.
speculators' training forward is the same attention (models/peagle/attention.py: a mask slot sees
the verified slots up to its anchor and the earlier mask slots of its own anchor).

Offline it is the step chain (proposers/toolkit/step_chain.py): the context pass once, then the
mask slots of every anchor step by step, each seeing the context before its anchor and the mask
slots before it, which is the causal pass above computed one query at a time. Only `feedback`
differs from EAGLE-3: a mask slot reads the projected mask hidden state, never an earlier draft.
"""

from __future__ import annotations

import torch
from torch import nn

from proposers.toolkit.config import DrafterConfig
from proposers.toolkit.eagle.decoder import EagleDrafter


class PEagleDrafter(EagleDrafter):
    # P-EAGLE trains its own embedding, the mask token's row included: the target's is no stand-in
    optional_weights = ()

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, len(config.target_layer_ids) * config.hidden_size))

    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        """[R, H] what a mask slot reads as its hidden input: fc of the mask hidden state, after the
        configured norms as the target's features (vLLM's `combine_hidden_states` of it), for every
        row; the previous step's state h is not read."""
        return self.project(self.mask_hidden[0].to(h.dtype)).expand(h.shape[0], -1)
