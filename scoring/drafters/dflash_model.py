"""The DFlash drafter model (z-lab `DFlashDraftModel` semantics), written for batched replay.

Same weights and key names as the reference: `fc`, `hidden_norm`, `norm`,
`layers.{i}.self_attn.{q,k,v,o}_proj`, `layers.{i}.self_attn.{q,k}_norm`,
`layers.{i}.mlp.{gate,up,down}_proj`, `layers.{i}.{input,post_attention}_layernorm`.

The drafter has no embedding and no lm_head of its own: block inputs are the target's input
embeddings (times `input_embedding_scale`), logits come from the target's lm_head (times
`output_multiplier`, then optional tanh soft-capping).

Why a re-implementation instead of calling the reference module: the reference runs one block
at a time against a growing KV cache. Replay scores every response position as an anchor, so
here the context keys/values (a function of the target features alone: `k_proj(hidden_norm(
fc(features)))` per layer) are computed once per sample and shared by a batch of anchors, each
of which sees only the context before it (attention.py). Norms, MLP and RoPE are transformers'
Qwen3 modules, the same ones the reference uses, so the arithmetic matches.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from pipeline.common import timing
from scoring.drafters.attention import MASK_BUILDERS, attend
from scoring.drafters.base import DrafterConfig, transformers_config
from scoring.drafters.conventions import REFERENCE, Conventions
from scoring.drafters.head import DraftHead


def qwen3_config(raw: dict, source: str = "config") -> Qwen3Config:
    """The Qwen3Config the reference builds from config.json (drives RoPE, the MLP activation,
    the effective sliding window and default layer types)."""
    return transformers_config(Qwen3Config, raw, source, drop=("architectures", "auto_map", "dflash_config"))


def decoder_hf_config(config: DrafterConfig) -> Qwen3Config:
    """The Qwen3Config of the decoder (`config.raw` holds its fields in every layout: the top
    level of a z-lab config.json, `transformer_layer_config` of a speculators one)."""
    hf = qwen3_config(config.raw)
    hf.head_dim = config.head_dim
    return hf


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, T, d] with cos/sin [..., T, d] (broadcast over heads)."""
    return x * cos.unsqueeze(-3) + rotate_half(x) * sin.unsqueeze(-3)


class DrafterAttention(nn.Module):
    """Qwen3's attention; `in_features` other than hidden_size for a layer whose q/k/v read a wider
    input (EAGLE-3's first layer: [embedding ; hidden]), `qk_norm` False for Llama's (no q/k norm)."""

    def __init__(self, config: DrafterConfig, in_features: int | None = None, qk_norm: bool = True):
        super().__init__()
        d, bias = config.head_dim, config.attention_bias
        width = in_features or config.hidden_size
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(width, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(width, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(width, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps) if qk_norm else None
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps) if qk_norm else None

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., T, in] -> roped, normed queries [..., heads, T, d]."""
        q = self.q_proj(x).view(*x.shape[:-1], self.heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q.transpose(-2, -3), cos, sin)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., T, in] -> roped, normed keys and values [..., kv_heads, T, d]."""
        shape = (*x.shape[:-1], self.kv_heads, self.head_dim)
        k = self.k_proj(x).view(shape)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).view(shape).transpose(-2, -3)
        return apply_rope(k.transpose(-2, -3), cos, sin), v

    def attend_to(self, q, k, v, ctx_k, ctx_v, mask) -> torch.Tensor:
        """Queries q [A, heads, b, d] to [context ; block keys k, v [A, kv_heads, m, d]] under
        `mask`, through o_proj -> [A, b, H]."""
        A, _, b, _ = q.shape
        with timing.stage("attention"):
            out = attend(q, k, v, ctx_k, ctx_v, mask, self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(A, b, -1))

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """Block queries attend to [context ; block].

        x [A, b, H]; cos/sin [A, b, d]; ctx_k/ctx_v [kv_heads, T, d] shared by all anchors;
        mask is a `DenseMask` (explicit boolean masks, the reference path), a `BlockwisePlan`
        (context keys in chunks, CPU) or a flex_attention BlockMask (CUDA).
        """
        q = self.queries(x, cos, sin)
        k, v = self.keys_values(x, cos, sin)  # [A, kv_heads, b, d]
        return self.attend_to(q, k, v, ctx_k, ctx_v, mask)


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig, hf_config: Qwen3Config):
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = Qwen3MLP(hf_config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(DraftHead):
    layer_class = DrafterLayer  # a family with other decoder layers (DFlash2) names its own

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        hf = decoder_hf_config(config)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(config, hf) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(hf)  # buffers only, not in the state dict
        self.add_draft_vocab(config)

    def context_kv(
        self,
        features: torch.Tensor,
        dtype: torch.dtype | None = None,
        chunk_rows: int | None = None,
        *,
        tokens=None,
        embed=None,
        attention="dense",
        conventions=None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [kv_heads, T, d] of context positions 0..T-1 from target features [T, n*H]
        (alone: `tokens`, `embed`, `attention` and `conventions` are for families whose context reads
        more, base.py).

        `features` may be in their stored dtype and on another device: they are moved and cast
        to `dtype` (default: their own) `chunk_rows` positions at a time (all at once when None
        or T <= chunk_rows), and each chunk goes through fc, hidden_norm and every layer's keys
        and values before the next, so a long sample never holds a cast copy of its features or
        its whole fc output, only the keys and values themselves. Every step acts on each
        position alone (RoPE of position p is the same in any batch), so chunking changes no
        value beyond the GEMMs' own rounding."""
        device = self.fc.weight.device
        dtype = dtype or features.dtype
        total = features.shape[0]
        if chunk_rows is None or total <= chunk_rows:
            ctx = self.hidden_norm(self.fc(features.to(device=device, dtype=dtype, non_blocking=True)))
            cos, sin = self.rope(ctx, torch.arange(total, device=device))
            return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]
        shape = (self.config.num_key_value_heads, total, self.config.head_dim)
        out = [
            (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            for _ in self.layers
        ]
        for start in range(0, total, chunk_rows):
            end = min(total, start + chunk_rows)
            ctx = self.hidden_norm(self.fc(features[start:end].to(device=device, dtype=dtype, non_blocking=True)))
            cos, sin = self.rope(ctx, torch.arange(start, end, device=device))
            for (keys, values), layer in zip(out, self.layers):
                k, v = layer.self_attn.keys_values(ctx, cos, sin)
                keys[:, start:end] = k
                values[:, start:end] = v
        return out

    def forward(
        self,
        block_embeds: torch.Tensor,
        anchors: torch.Tensor,
        context: list,
        attention: str = "dense",
        ctx_starts: torch.Tensor | None = None,
        conventions: Conventions = REFERENCE,
    ) -> torch.Tensor:
        """Drafter hidden states [A, b, H] (after the final norm) for blocks at `anchors`.

        block_embeds [A, b, H] are the (scaled) target embeddings of [x_anchor, mask, ...];
        `context` is `context_kv(features)`; each anchor sees only context before it.
        attention: "dense" (explicit boolean masks, the reference path), "blockwise" (context keys
        in chunks with a running softmax; CPU) or "flex" (block-sparse flex_attention; CUDA).
        ctx_starts: where each anchor's sample starts in a packed multi-sample context.
        conventions: the reference's (score) or one changed on purpose (diagnose).
        """
        with timing.stage("drafter layers", anchors=block_embeds.shape[0], block=block_embeds.shape[1]):
            return self._layers(block_embeds, anchors, context, attention, ctx_starts, conventions)

    def _layers(self, block_embeds, anchors, context, attention, ctx_starts, conventions) -> torch.Tensor:
        make_mask = MASK_BUILDERS[attention]
        A, b, _ = block_embeds.shape
        first = anchors + conventions.block_position_offset  # [A] the block's first position id
        positions = first[:, None] + torch.arange(b, device=anchors.device)[None, :]  # [A, b]
        cos, sin = self.rope(block_embeds, positions)
        ctx_len = context[0][0].shape[-2]
        masks = {}
        h = block_embeds
        for index, layer in enumerate(self.layers):
            kind = self.config.layer_mask_kind(index, conventions)
            if kind not in masks:
                with timing.stage("masks"):
                    masks[kind] = make_mask(anchors, b, ctx_len, *kind, ctx_starts, conventions.context_offset)
            ctx_k, ctx_v = context[index]
            h = layer(h, cos, sin, ctx_k, ctx_v, masks[kind])
        return self.norm(h)
