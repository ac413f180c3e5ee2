"""The block drafter every block-diffusion family is built on (DFlash, DFlash2, DSpark): z-lab
`DFlashDraftModel` semantics, written for batched replay.

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

A family subclasses `BlockDrafter` with its own decoder layer (`layer_class`) and what it adds
after the last hidden state (proposers/toolkit/head.py's hooks).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from pipeline.common import timing
from proposers.toolkit.attention import MASK_BUILDERS
from proposers.toolkit.config import DrafterConfig
from proposers.toolkit.conventions import REFERENCE, Conventions
from proposers.toolkit.head import DraftHead
from proposers.toolkit.layers import DrafterLayer
from proposers.toolkit.qwen3_decoder import decoder_hf_config


class BlockDrafter(DraftHead):
    layer_class = DrafterLayer  # a family with other decoder layers (DFlash2) names its own
    # a drafter of another decoder (Gemma 4's, toolkit/gemma4/decoder.py) names its own config, norm and RoPE
    decoder_config = staticmethod(decoder_hf_config)
    norm_class = Qwen3RMSNorm
    rotary_class = Qwen3RotaryEmbedding

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        hf = self.decoder_config(config)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(config, hf) for _ in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = self.rotary_class(hf)  # buffers only, not in the state dict
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
                causal, window, both_ways = kind
                with timing.stage("masks"):
                    masks[kind] = make_mask(
                        anchors, b, ctx_len, causal, window, ctx_starts, conventions.context_offset, both_ways=both_ways
                    )
            ctx_k, ctx_v = context[index]
            h = layer(h, cos, sin, ctx_k, ctx_v, masks[kind])
        return self.norm(h)
