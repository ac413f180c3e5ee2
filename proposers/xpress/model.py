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

vLLM's XPress (its own layout, layout.py `VllmXPress`; v1/worker/gpu/spec_decode/xpress/
speculator.py and model_executor/models/qwen3_xpress.py `jacobi_refine_greedy`) runs the same
recurrence with two differences, both family options: slot 0 reads the anchor x_t itself (its
predecessor lives in the KV cache, out of the speculator's reach: speculator.py:86-91;
`slot0_reads`), and each pass's argmax runs over the top-C tokens of each slot's base logits only
(`top_c`, its `xpress_topc`, default 512; 0: the whole vocabulary). `diagnose`'s `xpress-slot0`
variant reads the other predecessor (Conventions.xpress_other_slot0).
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
from proposers.toolkit.head import renamed


class XPressRefiner(nn.Module):
    """The refiner's weights under speculators' names (`refiner_head.*`) and its bias."""

    def __init__(self, vocab: int, hidden: int, block: int, rank: int, mlp_hidden: int):
        super().__init__()
        self.token_embed = nn.Embedding(vocab, rank)
        self.down_h = nn.Linear(hidden, rank, bias=False)
        self.down_g = nn.Linear(hidden, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(rank, block, block))
        self.mlp_gate = nn.Linear(rank, mlp_hidden, bias=False)
        self.mlp_up = nn.Linear(rank, mlp_hidden, bias=False)
        self.mlp_down = nn.Linear(mlp_hidden, rank, bias=False)
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


# vLLM's checkpoint names of the refiner (qwen3_xpress.py `HYBRID_KEY_MAP`) -> speculators'
VLLM_NAMES = {
    "w1.": "token_embed.",
    "mix.L": "mix_l",
    "mlp.gate_proj.": "mlp_gate.",
    "mlp.up_proj.": "mlp_up.",
    "mlp.down_proj.": "mlp_down.",
    "w2.": "readout.",
}


def _speculators_name(name: str) -> str:
    """A vLLM-layout tensor name under speculators' (`xpress_head.w1.weight` ->
    `refiner_head.token_embed.weight`); the backbone's names are z-lab's in both."""
    if not name.startswith("xpress_head."):
        return name
    return "refiner_head." + renamed(name[len("xpress_head.") :], VLLM_NAMES)


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
            options["xpress_mlp_hidden"],
        )

    @staticmethod
    def canonical_names(state: dict) -> dict:
        return {_speculators_name(name): tensor for name, tensor in state.items()}

    @property
    def passes(self) -> int:
        """Jacobi refine passes K (`num_jacobi_passes`)."""
        return self.config.family_options["num_jacobi_passes"]

    @staticmethod
    def refiner_inputs(before: torch.Tensor, anchor: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """[a, B] the token before each slot: `before` before the anchor's slot (x_{t-1}, or vLLM's
        x_t: `slot0`), the anchor before slot 1, then the previous pass's drafts (fill-in layout:
        slot k's target is t + k, its predecessor t + k - 1)."""
        return torch.cat([before, anchor, pred[:, 1:-1]], dim=1)

    def slot0(self, previous: torch.Tensor, conventions: Conventions) -> torch.Tensor:
        """[a, 1] what the refiner's slot 0 reads: x_{t-1} (speculators) or the anchor x_t (vLLM),
        or the other one under `xpress_other_slot0`."""
        reads_anchor = self.config.family_options["slot0_reads"] == "anchor"
        column = 1 if reads_anchor != conventions.xpress_other_slot0 else 0
        return previous[:, column : column + 1].long()

    def drafts(self, hidden, lm_head, previous, conventions: Conventions = REFERENCE) -> Drafts:
        """The drafts at slots 1..B-1 from `hidden` [a, B, H] (every slot) and `previous` [a, B], the
        stored token before each slot (x_{t-1}, x_t, ...; only those two are read: the later slots
        read the drafter's own drafts)."""
        with timing.stage("xpress refiner", rows=hidden.shape[0] * hidden.shape[1]):
            base = self.head_logits(hidden, self.head_weight(lm_head), conventions)  # [a, B, V]
            features = self.refiner_head.hidden_features(hidden)
            outside = self.candidates(base)
            before, anchor = self.slot0(previous, conventions), previous[:, 1:2].long()
            return Drafts(self.refined(base, features, before, anchor, outside)[:, 1:])

    def candidates(self, base: torch.Tensor) -> torch.Tensor | None:
        """[a, B, V] bool, true outside each slot's top-C base-logit tokens (vLLM's `xpress_topc`: a
        pass's argmax never leaves them; a byte per logit, once per batch); None when C is 0 or the
        whole vocabulary."""
        top_c = self.config.family_options.get("top_c", 0)
        if not top_c or top_c >= base.shape[-1]:
            return None
        outside = torch.ones_like(base, dtype=torch.bool)
        return outside.scatter_(-1, base.topk(top_c, dim=-1).indices, False)

    def refined(self, base, features, before, anchor, outside=None) -> torch.Tensor:
        """[a, B, V] the logits after K passes (-inf `outside` each slot's candidates under top-C). A row
        whose pass leaves its next pass's inputs as they were (the drafts it reads unchanged) would
        get the same logits from every later pass: it leaves the passes there (exact; the passes
        converge, so most rows stop early)."""
        logits, pred = base, base.argmax(dim=-1)
        active = torch.arange(base.shape[0], device=base.device)  # rows still refining
        inputs = self.refiner_inputs(before, anchor, pred)  # [a, B] what the next pass reads
        for index in range(self.passes):
            rows = self.refiner_head.logits(base[active], inputs[active], features[active])
            if outside is not None:
                rows.masked_fill_(outside[active], float("-inf"))
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
