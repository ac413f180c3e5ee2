"""A DeepSeek-V4 block as one step of a step chain (one query a row, its keys kept row by row): the
block of DeepSeek-V4's own MTP head (proposers/mtp/dsv4.py); neutral: any family whose chain runs
DeepSeek-V4 blocks uses it.

The block is transformers' DeepseekV4DecoderLayer (hyper-connections `attn_hc`/`ffn_hc`, its norms and
the sqrtsoftplus-routed MoE with the shared expert), its forward split where the chain needs it:
`enter` (the attention's hc_pre and input norm), the attention, `finish` (hc_post, then the MLP's
hc_pre, MoE and hc_post; modeling_deepseek_v4.py:1174-1198). The attention is DeepseekV4Attention's
arithmetic (decoder.py's DSV4BlockAttention) with the per-head sinks carried as one more key: every
query gets `heads` one-hot channels (its own head), every real key as many zero channels, and the
sink key `sinks / scale` there with a zero value, so that the shared attention kernels
(toolkit/attention.py) put exp(sink_h) in head h's softmax denominator as transformers'
eager_attention_forward does, over the one shared key/value head (K = V).
"""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, apply_rotary_pos_emb

from pipeline.common import timing
from proposers.toolkit.attention import attend
from proposers.toolkit.dsv4.decoder import DSV4BlockAttention


class ChainAttention(DSV4BlockAttention):
    """DeepseekV4Attention's weights for rows of one query each (module docstring)."""

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., T, H] -> (k, v) [..., 1, T, d + heads]: kv_norm(kv_proj(x)) roped, zero sink channels."""
        kv = apply_rotary_pos_emb(self.kv_norm(self.kv_proj(x))[..., None, :], cos, sin, unsqueeze_dim=-2)[..., 0, :]
        kv = torch.cat([kv, kv.new_zeros(*kv.shape[:-1], self.num_heads)], dim=-1).unsqueeze(-3)
        return kv, kv

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., T, H] -> [..., heads, T, d + heads]: DSV4BlockAttention's queries, each head's one-hot behind."""
        q = super().queries(x, cos, sin).transpose(-2, -3)
        own = torch.eye(self.num_heads, dtype=q.dtype, device=q.device)[:, None, :]
        return torch.cat([q, own.expand(*q.shape[:-1], self.num_heads)], dim=-1)

    def sink(self, rows: int, like: torch.Tensor):
        """The sink as a block key and value [rows, 1, 1, d + heads]."""
        k = like.new_zeros(rows, 1, 1, self.head_dim + self.num_heads)
        k[..., self.head_dim :] = (self.sinks / self.scaling).to(like)
        return k, torch.zeros_like(k)

    def attend_to(self, q, k, v, ctx_k, ctx_v, mask, cos, sin) -> torch.Tensor:
        """q [A, heads, 1, d + heads] to [context ; block keys (the sink first)] -> [A, 1, H]: the values'
        rope rotated back at the query's position (cos/sin [A, 1, .]), then the grouped output projection."""
        A = q.shape[0]
        with timing.stage("attention"):
            out = attend(q, k, v, ctx_k, ctx_v, mask, self.scaling)[..., : self.head_dim]  # [A, heads, 1, d]
        out = self.unrotated(out.transpose(1, 2), cos, sin)  # [A, 1, heads, d]
        grouped = self.o_a_proj(out.reshape(A, 1, self.config.o_groups, -1)).flatten(2)
        return self.o_b_proj(grouped)


class ChainLayer(DeepseekV4DecoderLayer):
    """transformers' DeepseekV4DecoderLayer split for the chain; streams [B, S, hc, H] throughout."""

    def __init__(self, hf):
        super().__init__(hf, 0)
        self.self_attn = ChainAttention(hf, 0)

    def enter(self, streams: torch.Tensor):
        """(what the attention reads [B, S, H], the residual the block's finish takes)."""
        post, comb, collapsed = self.attn_hc(streams)
        return self.input_layernorm(collapsed), (streams, post, comb)

    def finish(self, attended: torch.Tensor, residual) -> torch.Tensor:
        """The block's output streams from the attention's output [B, S, H] (modeling_deepseek_v4.py:1190-1198)."""
        streams, post, comb = residual
        h = _mixed(streams, attended, post, comb)
        post, comb, collapsed = self.ffn_hc(h)
        return _mixed(h, self.mlp(self.post_attention_layernorm(collapsed)), post, comb)


def _mixed(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """hc_post: post * out into each stream plus comb^T @ streams."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
