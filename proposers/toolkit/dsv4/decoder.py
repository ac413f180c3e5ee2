"""The DeepSeek-V4 block a block drafter may be built on (DeepSeek-V4's DSpark stages `mtp.{i}.*`), as
both engines run it; neutral: any family whose block decoder is DeepSeek-V4's uses it.

Each stage is a full DeepSeek-V4 block on transformers' own modules (DeepseekV4DecoderLayer: its
hyper-connections `attn_hc`/`ffn_hc` with the Sinkhorn-projected residual mix, DeepseekV4RMSNorm, the
sqrtsoftplus-routed DeepseekV4SparseMoeBlock with its shared expert), with the attention over
[context ; block] written here (vLLM deepseek_v4/nvidia/dspark.py:193-277; llama.cpp
src/models/dflash.cpp:857-1031):

- queries `q_b_norm(q_b_proj(q_a_norm(q_a_proj(x))))`, one shared key/value head
  `kv_norm(kv_proj(x))` (K = V), interleaved RoPE on the trailing `qk_rope_head_dim` channels;
- the context's keys `kv_norm(kv_proj(main_norm(main_proj(features))))` at their own positions
  (vLLM dspark.py:185-224; dflash.cpp:885-902);
- per-head attention sinks in the softmax's denominator, scale head_dim^-0.5, the output's rope
  channels rotated back by the query's position, then the grouped output projection
  (transformers' DeepseekV4Attention, modeling_deepseek_v4.py:811-881);
- the block bidirectional; a sliding window over the context: vLLM's is anchored at the block, every
  query seeing the `sliding_window` context positions before the anchor
  (vllm/v1/attention/backends/mla/sparse_swa.py:1268-1300), llama.cpp's per query, query t + i seeing
  the context keys p with t + i - p < sliding_window (src/llama-hparams.h:475-487; dflash.cpp:83-88
  makes every stage windowed). `--walk-rule llama.cpp` runs the second.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RotaryEmbedding,
    apply_rotary_pos_emb,
)

from pipeline.common import timing

MAIN = "main"  # transformers' rope label of the uncompressed (sliding) layers: plain RoPE at rope_theta
SLIDING = "sliding_attention"


class WindowMask(NamedTuple):
    """The context keys each anchor gathers and what its queries see of them and of the block."""

    index: torch.Tensor  # [A, W] rows of the packed context each anchor gathers
    ctx_visible: torch.Tensor  # [A, b or 1, W] bool
    block_visible: torch.Tensor  # [b, b] bool


def window_mask(anchors, block_len, ctx_starts, causal, window, per_query, context_offset=0) -> WindowMask:
    """The context window of blocks at `anchors` (sample positions; their samples start at
    `ctx_starts` in the packed context): vLLM's, anchored at the block (the `window` positions before
    the anchor, sparse_swa.py:1293-1296), or llama.cpp's `per_query` (query t + i sees p when
    t + i - p < window); no window: every context position before the anchor."""
    device = anchors.device
    ends = anchors + context_offset  # the first context position an anchor does not see
    starts = torch.zeros_like(anchors) if ctx_starts is None else ctx_starts
    width = int(window) if window is not None else max(1, int(ends.max()))
    positions = ends[:, None] - width + torch.arange(width, device=device)  # [A, W]
    visible = (positions >= 0)[:, None, :]
    i = torch.arange(block_len, device=device)
    if per_query and window is not None:
        visible = visible & ((ends[:, None, None] + i[None, :, None] - positions[:, None, :]) < window)
    block = torch.ones(block_len, block_len, dtype=torch.bool, device=device)
    if causal:
        block = torch.tril(block)
    if per_query and window is not None:
        block &= (i[:, None] - i[None, :]) < window
    return WindowMask((starts[:, None] + positions).clamp(min=0), visible, block)


def dsv4_config(raw: dict, stages: int) -> DeepseekV4Config:
    """transformers' DeepseekV4Config of the drafter's stages: `stages` uncompressed (sliding) layers
    routed by top-k (no hash layers: llama.cpp's converter zeroes both, conversion/deepseek.py:949-950)."""
    keep = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads", "head_dim",
            "q_lora_rank", "num_experts_per_tok", "n_routed_experts", "n_shared_experts", "scoring_func",
            "norm_topk_prob", "routed_scaling_factor", "rope_theta", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
            "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank", "rms_norm_eps", "hidden_act",
            "max_position_embeddings")  # fmt: skip
    fields = {k: raw[k] for k in keep if k in raw}
    rope = {"rope_type": "default", "rope_theta": float(raw.get("rope_theta", 10000.0))}
    config = DeepseekV4Config(
        **fields,
        num_hidden_layers=stages,
        qk_rope_head_dim=raw["qk_rope_head_dim"],
        layer_types=[SLIDING] * stages,
        mlp_layer_types=["moe"] * stages,
        rope_parameters={MAIN: rope, "compress": dict(rope)},
    )
    config._attn_implementation = "eager"
    return config


class MainRotary(nn.Module):
    """transformers' DeepSeek-V4 rotary embedding of the uncompressed layers, called as the other
    drafters' (x, positions) -> cos, sin (one entry per interleaved pair); built from `config` alone."""

    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        self.config = config
        self.inner = DeepseekV4RotaryEmbedding(config)

    @property
    def inv_freq(self) -> torch.Tensor:
        return getattr(self.inner, f"{MAIN}_inv_freq")

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        return self.inner(x, positions, MAIN)


class DSV4BlockAttention(DeepseekV4Attention):
    """DeepseekV4Attention's weights over [context window ; block] (module docstring)."""

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, H] -> the shared key/value head [1, T, d], normed and roped (K = V)."""
        kv = apply_rotary_pos_emb(self.kv_norm(self.kv_proj(x))[..., None, :], cos, sin, unsqueeze_dim=-2)
        kv = kv[..., 0, :].unsqueeze(0)
        return kv, kv

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [A, b, H] -> [A, b, heads, d], each head RMS-normed without weight, then roped."""
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))).unflatten(-1, (self.num_heads, self.head_dim))
        return apply_rotary_pos_emb(self.q_b_norm(q), cos, sin, unsqueeze_dim=2)

    def forward(self, x, cos=None, sin=None, ctx_k=None, ctx_v=None, mask: WindowMask = None, **_):
        A, b, _ = x.shape
        q = self.queries(x, cos, sin)
        block = self.keys_values(x, cos, sin)[0][0]  # [A, b, d]
        keys = torch.cat([ctx_k[0][mask.index], block], dim=1)  # [A, W + b, d]
        with timing.stage("attention"):
            scores = torch.einsum("abhd,akd->ahbk", q, keys) * self.scaling
            width = mask.index.shape[1]
            visible = torch.cat([mask.ctx_visible.expand(A, b, width), mask.block_visible.expand(A, b, b)], dim=-1)
            scores = scores.masked_fill(~visible[:, None], float("-inf"))
            out = torch.einsum("ahbk,akd->abhd", self.with_sinks(scores), keys)
        grouped = self.o_a_proj(self.unrotated(out, cos, sin).reshape(A, b, self.config.o_groups, -1)).flatten(2)
        return self.o_b_proj(grouped), None

    def unrotated(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The values' rope (K = V) rotated back at the query's position (modeling_deepseek_v4.py:873-879)."""
        return apply_rotary_pos_emb(out, cos, -sin, unsqueeze_dim=2)

    def with_sinks(self, scores: torch.Tensor) -> torch.Tensor:
        """softmax over [scores ; sink] per head, the sink's share dropped (eager_attention_forward)."""
        sinks = self.sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        logits = torch.cat([scores, sinks], dim=-1)
        return torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]


class DSV4BlockLayer(DeepseekV4DecoderLayer):
    """transformers' DeepseekV4DecoderLayer (hyper-connections, norms, MoE) with the block attention;
    the hidden state [A, b, hc_mult, H] throughout."""

    def __init__(self, config, hf: DeepseekV4Config):
        super().__init__(hf, 0)
        self.self_attn = DSV4BlockAttention(hf, 0)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        return super().forward(h, cos=cos, sin=sin, ctx_k=ctx_k, ctx_v=ctx_v, mask=mask)


class HyperHead(DeepseekV4HyperHead):
    """transformers' final hyper-connection collapse [.., hc, H] -> [.., H] (its weights `hc_head.*`)."""
