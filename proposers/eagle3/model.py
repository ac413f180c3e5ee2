"""The EAGLE-3 drafter model, written for batched teacher-forced replay of its chain.

Its decoder is the EAGLE-style one (proposers/toolkit/eagle/decoder.py: weights and names).
Inference (vLLM's EagleProposer): slot s of the draft KV is written from (embed(x_{s+1}),
fc(g_s)) at position s, target features g only. Step 1 at anchor t is slot t - 1 itself: its
last hidden state h_1 gives draft 1. Step j > 1 reads (embed(d_{j-1}), h_{j-1}) at position
t + j - 2 (h pre-norm, or post-norm with speculators' `norm_output`), attending to slots < t and
to its own earlier steps' keys at that anchor. Logits lm_head(norm(h)), mapped through d2t.

Offline the chain is the step-chain drafter's (proposers/toolkit/step_chain.py: the context pass
over every slot once, then steps 2.. for all anchors at once, teacher-forced); `feedback` is what
EAGLE-3 adds to the shared decoder.
"""

from __future__ import annotations

import torch

from proposers.toolkit.eagle.decoder import EagleDrafter


class Eagle3Drafter(EagleDrafter):
    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        """What the next step reads of this step's last hidden state h."""
        return self.norm(h) if self.config.family_options["feed_post_norm"] else h
