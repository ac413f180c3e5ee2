"""The DFlash2 drafter model (z-lab and speculators `DFlash2DraftModel` semantics), for batched replay.

DFlash2 is the block drafter (proposers/toolkit/block_drafter.py, DFlash's) plus two things:

- in every layer, a grouped dynamic depthwise convolution around the attention and around the
  MLP (`layers.{i}.{attention_conv,mlp_conv}.{base_kernel, kernel_projection.weight}`);
- a candidate selector that reranks the top `selector_top_k` tokens of the unary logits with a
  low-rank predecessor/successor score (`candidate_selector.{predecessor_codebook,
  successor_codebook}` [V, r], `candidate_selector.hidden_projection.weight` [r, H]).

The convolution. For a sublayer input x [b, H] (the block's queries; G = H / conv_group_size
groups, K = conv_kernel_size taps), one projection D = kernel_projection(x) viewed [b, 2, K, G]
gives an input-side kernel D[:, 0] and an output-side one D[:, 1]:

    conv(y, D_s, base_s)[p, c] = sum_tap [p - tap >= 0] (base_s[tap, c] + D_s[p, tap, g(c)]) y[p - tap, c]

p is the index inside the query block (0 = the anchor slot): taps never reach the context or
another anchor's block, which is why a batch of blocks [A, b, H] convolves along its own block
axis. A layer is

    x = input_layernorm(h);  D = kp_attn(x);  h = h + conv(attn(conv(x, D0, base0)), D1, base1)
    x = post_attention_layernorm(h);  D = kp_mlp(x);  h = h + conv(mlp(conv(x, D0, base0)), D1, base1)

so the block's keys and values come from the convolved x, while the context keys and values
(`context_kv`) are DFlash's, untouched.

The selector. At a draft slot with post-norm hidden h, unary scores u = the DFlash logits
(target lm_head, z-lab's output_multiplier and soft-capping), candidates C = top-K of u sorted
best first, and for predecessor token p

    S[c] = u[C[c]] + < A[p] * (W h), B[C[c]] >        (A, B the codebooks, W hidden_projection)

The draft is C[argmax_c S] (the first maximum: ties go to the better unary rank, as vLLM's
sorted top-k and first-index argmax). Served, p is the previous draft (x_t for the first);
offline a draft only matters while every earlier one matched the stored tokens, so the stored
token before each target is the exact predecessor (docs/drafter-families.md#dflash2).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import Qwen3Config

from pipeline.common.sampling import Sampling, token_logprob
from proposers.interface import Drafts
from proposers.toolkit.block_drafter import BlockDrafter
from proposers.toolkit.config import DrafterConfig
from proposers.toolkit.conventions import REFERENCE, Conventions
from proposers.toolkit.layers import DrafterLayer

# Names some savers give the codebooks: z-lab's module keeps them in nn.Embedding, so its own
# save_pretrained writes `.weight` (its from_pretrained maps the published names onto those).
SAVED_NAME_ALIASES = {
    f"candidate_selector.{name}.weight": f"candidate_selector.{name}"
    for name in ("predecessor_codebook", "successor_codebook")
}


def canonical_names(state: dict) -> dict:
    """`state` with the codebooks under the names this model (and speculators, vLLM and the
    published checkpoints) use."""
    return {SAVED_NAME_ALIASES.get(name, name): tensor for name, tensor in state.items()}


def grouped_dynamic_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [..., b, H] convolved along its block axis b; delta [..., b, K, G] (per position and
    group), base [K, H]. Taps before the block's first position read zeros."""
    *lead, b, hidden = x.shape
    groups = hidden // group_size
    y = x.view(*lead, b, groups, group_size)
    out = torch.zeros_like(y)
    for tap in range(min(base.shape[0], b)):
        shifted = y if tap == 0 else F.pad(y[..., : b - tap, :, :], (0, 0, 0, 0, tap, 0))
        kernel = base[tap].view(groups, group_size).to(x.dtype) + delta[..., tap, :, None]
        out = out + kernel * shifted
    return out.view_as(x)


class GroupedDynamicConv(nn.Module):
    """The pair of convolutions around one sublayer: `prepare` its input, `finish` its output."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [input side, output side]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x convolved, the output side's dynamic kernel): both kernels come from the input."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return grouped_dynamic_conv(x, delta[..., 0, :, :], self.base_kernel[0], self.group_size), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_conv(y, delta, self.base_kernel[1], self.group_size)


class DFlash2Layer(DrafterLayer):
    def __init__(self, config: DrafterConfig, hf_config: Qwen3Config):
        super().__init__(config, hf_config)
        kernel, group = config.family_options["conv_kernel_size"], config.family_options["conv_group_size"]
        self.attention_conv = GroupedDynamicConv(config.hidden_size, kernel, group)
        self.mlp_conv = GroupedDynamicConv(config.hidden_size, kernel, group)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        x, finish = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(x, cos, sin, ctx_k, ctx_v, mask), finish)
        x, finish = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), finish)


class CandidateSelector(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        rank = config.family_options["selector_rank"]
        self.top_k = config.family_options["selector_top_k"]
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def transition(self, hidden: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """[a, D, K] float32 pair scores < A[previous] * (W hidden), B[candidates] >, for the one
        predecessor of each slot (never the [K, K] table of every predecessor)."""
        context = self.predecessor_codebook[previous] * self.hidden_projection(hidden)  # [a, D, r]
        successors = self.successor_codebook[candidates]  # [a, D, K, r]
        return torch.einsum("adr,adkr->adk", context.float(), successors.float())


class DFlash2Drafter(BlockDrafter):
    rowwise_drafts = False  # each draft depends on its predecessor (the selector)

    layer_class = DFlash2Layer
    canonical_names = staticmethod(canonical_names)

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)

    def drafts(self, hidden, lm_head, previous, conventions: Conventions = REFERENCE) -> Drafts:
        """Selector scores S at each slot's candidates (-inf elsewhere) and the greedy drafts.

        Scores are summed in float32 (as vLLM does) so that the argmax does not turn on bf16
        rounding; they are stored in the logits' dtype, in the unary logits' own memory."""
        logits = self.logits(hidden, lm_head, conventions)  # [a, D, V] unary
        unary, candidates = torch.topk(logits, self.candidate_selector.top_k, dim=-1)  # sorted, best first
        previous = previous.long().clamp(min=0)  # padded rows hold -1; their drafts are never read
        scores = unary.float() + self.candidate_selector.transition(hidden, previous, candidates)
        tokens = candidates.gather(-1, scores.argmax(dim=-1, keepdim=True))[..., 0]
        logits.fill_(float("-inf")).scatter_(-1, candidates, scores.to(logits.dtype))
        return Drafts(logits, tokens)

    def draft_logprob(self, logits: torch.Tensor, tokens: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """log softmax(S / T) over the candidates (-inf elsewhere): the reference samples the
        selector with the temperature alone, no top-p or top-k (z-lab `CandidateSelector.select`)."""
        return token_logprob(logits, tokens, Sampling(temperature=sampling.temperature))
