"""The decoder pieces the neural drafters share: RoPE, Qwen3's attention over [context ; block]
(`DrafterAttention`, with the variants EAGLE-3 and the MTP heads need as parameters or subclasses)
and Qwen3's decoder layer (`DrafterLayer`). Norms and the MLP are transformers' own Qwen3 modules,
the ones the references use, so the arithmetic matches theirs."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from pipeline.common import timing
from proposers.toolkit.attention import attend
from proposers.toolkit.config import DrafterConfig


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
        self.value_scale = config.attention_value_scale

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
        if self.value_scale != 1.0:  # vLLM's and SGLang's v_scale: every value, context and block alike
            v = v * self.value_scale
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
