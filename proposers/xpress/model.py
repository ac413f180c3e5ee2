"""The XPress drafter model (speculators `XPressDraftModel` semantics), for batched replay.

XPress is the block drafter (proposers/toolkit/block_drafter.py, DFlash's: fill-in layout, slot 0
the anchor x_t, slots 1..B-1 draft t+1..t+B-1) plus a causal refiner, `refiner_head.*` (speculators
models/xpress/model_definitions.py `XPressRefinerHead`, r = xpress_rank):

    token_embed [V, r], down_h, down_g [r, H], in_proj [r, 3r], mix_l [r, B, B],
    mlp_gate, mlp_up [r * ratio, r], mlp_down [r, r * ratio], readout [V, r]

For the block's post-norm hidden states h [B, H] (every slot, the anchor's included), g = their
mean over the B slots, and prev [B] the token before each slot:

    x   = in_proj([down_h(h) ; down_g(g) ; token_embed(prev)])
    x   = x + sum_{j <= k} (mix_l * tril)[:, k, j] x_j          (causal mixing along the block)
    x   = x + mlp_down(silu(mlp_gate(x)) * mlp_up(x))
    bias = readout(x);  logits = lm_head(h) + bias

Inference (speculators models/xpress/core.py: the consistency rounds of `forward`, the recurrence
its config calls inference-time Jacobi decoding, K = num_jacobi_passes): pred = argmax of the base
logits; K times, slot 0 of pred set to the anchor, prev = [x_{t-1}, pred_0 .. pred_{B-2}], pred =
argmax(base + bias(prev)). The drafts are the last pass's logits at slots 1..B-1 (K = 0: the base
logits). Each draft reads the drafter's own earlier drafts, never the stored tokens, so the block is
not teacher-forced and the replay's drafts at an anchor are the online ones; they are not
independent given the block (no DDTree). x_{t-1} at anchor 0 is the anchor itself, as speculators'
training reads it. The block is always B slots (`whole_block`): mix_l is B x B and g a mean over B.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pipeline.common import timing
from proposers.interface import Drafts
from proposers.toolkit.block_drafter import BlockDrafter
from proposers.toolkit.config import DrafterConfig
from proposers.toolkit.conventions import REFERENCE, Conventions


class XPressRefiner(nn.Module):
    """The refiner's weights under speculators' names (`refiner_head.*`) and its bias."""

    def __init__(self, vocab: int, hidden: int, block: int, rank: int, mlp_ratio: int):
        super().__init__()
        self.token_embed = nn.Embedding(vocab, rank)
        self.down_h = nn.Linear(hidden, rank, bias=False)
        self.down_g = nn.Linear(hidden, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(rank, block, block))
        self.mlp_gate = nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_up = nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_down = nn.Linear(rank * mlp_ratio, rank, bias=False)
        self.readout = nn.Linear(rank, vocab, bias=False)

    def hidden_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """[a, B, 2r]: [down_h(h) ; down_g(mean of h over the block)], the same for every pass."""
        hidden = hidden.to(self.down_h.weight.dtype)
        summary = hidden.mean(dim=1, keepdim=True).expand_as(hidden)
        return torch.cat([self.down_h(hidden), self.down_g(summary)], dim=-1)

    def mixed(self, previous: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[a, B, r] the refiner's state given `previous` [a, B], the token before each slot; its logit
        bias is readout of it."""
        x = self.in_proj(torch.cat([features, self.token_embed(previous).to(features.dtype)], dim=-1))
        causal = torch.tril(torch.ones(x.shape[1], x.shape[1], dtype=x.dtype, device=x.device))
        x = x + torch.einsum("ckj,ajc->akc", self.mix_l * causal, x)  # slot k mixes slots j <= k, per channel
        return x + self.mlp_down(F.silu(self.mlp_gate(x)) * self.mlp_up(x))

    def logits(self, base: torch.Tensor, previous: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[a, B, V] base + readout(mixed): one GEMM accumulating into a copy of the base logits (no
        separate bias tensor: the vocabulary-wide add is most of a pass's memory traffic)."""
        x = self.mixed(previous, features).to(base.dtype)
        out = torch.addmm(
            base.reshape(-1, base.shape[-1]), x.reshape(-1, x.shape[-1]), self.readout.weight.to(base.dtype).t()
        )
        return out.view(base.shape)


class XPressDrafter(BlockDrafter):
    rowwise_drafts = False  # each pass reads the previous pass's drafts: no shared lm_head GEMM

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        options = config.family_options
        self.refiner_head = XPressRefiner(
            config.vocab_size,
            config.hidden_size,
            config.block_size,
            options["xpress_rank"],
            options["xpress_mlp_ratio"],
        )

    @property
    def passes(self) -> int:
        """Jacobi refine passes K (`num_jacobi_passes`)."""
        return self.config.family_options["num_jacobi_passes"]

    @staticmethod
    def refiner_inputs(before: torch.Tensor, anchor: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """[a, B] the token before each slot: x_{t-1} before the anchor's slot, the anchor before slot 1,
        then the previous pass's drafts (fill-in layout: slot k's target is t + k, its predecessor t + k - 1)."""
        return torch.cat([before, anchor, pred[:, 1:-1]], dim=1)

    def drafts(self, hidden, lm_head, previous, conventions: Conventions = REFERENCE) -> Drafts:
        """The drafts at slots 1..B-1 from `hidden` [a, B, H] (every slot) and `previous` [a, B], the
        stored token before each slot (x_{t-1}, x_t, ...; only those two are read: the later slots
        read the drafter's own drafts)."""
        with timing.stage("xpress refiner", rows=hidden.shape[0] * hidden.shape[1]):
            base = self.head_logits(hidden, self.head_weight(lm_head), conventions)  # [a, B, V]
            features = self.refiner_head.hidden_features(hidden)
            before, anchor = previous[:, :1].long(), previous[:, 1:2].long()
            return Drafts(self.refined(base, features, before, anchor)[:, 1:])

    def refined(self, base, features, before, anchor) -> torch.Tensor:
        """[a, B, V] the logits after K passes. A row whose pass leaves its next pass's inputs as they
        were (the drafts it reads unchanged) would get the same logits from every later pass: it
        leaves the passes there (exact; the passes converge, so most rows stop early)."""
        logits, pred = base, base.argmax(dim=-1)
        active = torch.arange(base.shape[0], device=base.device)  # rows still refining
        inputs = self.refiner_inputs(before, anchor, pred)  # [a, B] what the next pass reads
        for index in range(self.passes):
            rows = self.refiner_head.logits(base[active], inputs[active], features[active])
            if index == 0:
                logits = rows  # every row takes at least one pass
            else:
                logits[active] = rows
            following = self.refiner_inputs(before[active], anchor[active], rows.argmax(dim=-1))
            moved = (following != inputs[active]).any(dim=-1)
            inputs[active] = following
            active = active[moved]
            if active.numel() == 0:
                break
        return logits
