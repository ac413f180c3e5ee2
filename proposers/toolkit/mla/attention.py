"""DeepSeek-V3's multi-head latent attention (transformers' DeepseekV3Attention), shared by the MLA
drafters: the step chain of a NextN head (proposers/mtp/nextn.py) and Kimi K3's DSpark block
(proposers/dspark/k3.py). Queries through the q LoRA (or q_proj), keys and values expanded from
the compressed latent (kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj), RoPE on the last
qk_rope_head_dim dims of each query and on the one shared rope key (interleaved pairs when
`rope_interleave`), softmax scale qk_head_dim^-0.5 with YaRN's mscale (yarn_apply_mscale).

Why values are padded: the step chain keeps one head width for a layer's context keys and values
(step_chain.context_kv); MLA's values are v_head_dim wide, its keys qk_head_dim. The values are
zero-padded to the key width and the attention output cut back before o_proj: the weighted sum of
the padded dims is zero, the others are the values' own.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import yarn_apply_mscale
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3RMSNorm,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

from pipeline.common import timing
from proposers.toolkit.attention import attend


class MlaAttention(nn.Module):
    def __init__(self, config, hf):
        super().__init__()
        hidden, bias, heads = config.hidden_size, hf.attention_bias, hf.num_attention_heads
        self.heads, self.nope, self.rot, self.v_dim = heads, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim
        self.qk_dim, self.kv_rank = self.nope + self.rot, hf.kv_lora_rank
        if hf.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, hf.q_lora_rank, bias=bias)
            self.q_a_layernorm = DeepseekV3RMSNorm(hf.q_lora_rank, eps=hf.rms_norm_eps)
            self.q_b_proj = nn.Linear(hf.q_lora_rank, heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank + self.rot, bias=bias)
        # vLLM's latent norms use rms_norm_eps (deepseek_v2.py:501,525); transformers' 1e-6, DeepSeek-V3's value
        self.kv_a_layernorm = DeepseekV3RMSNorm(self.kv_rank, eps=hf.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)
        self.scaling = yarn_apply_mscale(hf.rope_parameters, self.qk_dim**-0.5)
        self.rotate = apply_rotary_pos_emb_interleave if hf.rope_interleave else apply_rotary_pos_emb

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., heads, T, rot] with cos/sin [..., T, rot] (transformers' function, on x alone)."""
        return self.rotate(x, x, cos, sin, unsqueeze_dim=-3)[0]

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., T, H] -> [..., heads, T, qk_dim]: the nope dims, then the roped ones."""
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(*x.shape[:-1], self.heads, self.qk_dim).transpose(-2, -3)
        q_nope, q_rot = q.split([self.nope, self.rot], dim=-1)
        return torch.cat([q_nope, self._rope(q_rot, cos, sin)], dim=-1)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., T, H] -> keys [..., heads, T, qk_dim] and values zero-padded to qk_dim."""
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rot], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(*x.shape[:-1], self.heads, self.nope + self.v_dim)
        k_nope, v = kv.transpose(-2, -3).split([self.nope, self.v_dim], dim=-1)
        k_rot = self._rope(k_rot.unsqueeze(-3), cos, sin).expand(*k_nope.shape[:-1], self.rot)
        padded = nn.functional.pad(v, (0, self.qk_dim - self.v_dim))
        return torch.cat([k_nope, k_rot], dim=-1), padded

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """Block queries x [A, b, H] attend to [context ; the block's own keys] (DrafterAttention's call)."""
        k, v = self.keys_values(x, cos, sin)
        return self.attend_to(self.queries(x, cos, sin), k, v, ctx_k, ctx_v, mask)

    def attend_to(self, q, k, v, ctx_k, ctx_v, mask) -> torch.Tensor:
        """Queries q [A, heads, b, qk_dim] to [context ; block keys] -> [A, b, H]."""
        A, _, b, _ = q.shape
        with timing.stage("attention"):
            out = attend(q, k, v, ctx_k, ctx_v, mask, self.scaling)[..., : self.v_dim]
        return self.o_proj(out.transpose(1, 2).reshape(A, b, -1))
