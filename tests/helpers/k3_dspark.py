"""Kimi K3's DSpark drafter (`K3DSparkModel`) written rule by rule from vLLM's
vllm/models/kimi_k3/nvidia/dspark_mla.py on transformers' own DeepSeek-V3 modules, a tiny Kimi target,
and what tests/parity/test_dspark_k3_parity.py needs around them. Nothing here imports specreplay.

The target: transformers 5.25 has no Kimi K3 class; its nearest is `KimiLinearForCausalLM` (Kimi's KDA
+ MLA hybrid, the layer kinds vLLM's kimi_k3 model runs: kimi_k3/nvidia/kda.py, mla.py), tiny, here.
The drafter reads only the target's layer outputs (vLLM's aux layer i + 1 = hidden + residual after
layer i: kimi_k3/nvidia/model.py:1178-1189, transformers' hidden_states[i + 1]), its embedding and its
lm_head, so any target with those shapes exercises the rule.

The reference, per block at anchor t (x_t the anchor token, context = positions < t):
- c = context_norm(context_proj(features[:t]))                                  dspark_mla.py:150-160, 214-215
- per layer, context latent kv = kv_a_proj_with_mqa(c) (the duplicated weights), kv_c =
  kv_a_layernorm(kv_c) (eps rms_norm_eps, mla.py:287), k_pe rotated at 0..t-1          dspark_mla.py:39-57, 274-308
- RoPE: vLLM's non-neox rotary (mla.py:174-179: is_neox_style False): pairs (2i, 2i + 1) rotated by
  theta^(-2i/d) -- written out here, not transformers' interleave permutation
- block h = target_embed([x_t, mask, ...]) at positions t.., each layer (dspark_mla.py:106-131):
  residual add then RMSNorm (fused_allreduce_rms_norm), MLA with q-LoRA (q_a_proj, q_a_layernorm,
  q_b_proj), keys k = [kv_b_proj(kv_c)_nope ; k_pe], values kv_b_proj(kv_c)_v, scale qk_head_dim^-0.5
  (mla.py:161), every block query seeing the context and the whole block (non_causal_multi_token_decode);
  the MLP SiLU(gate) * up -> down (KimiMLP, model.py:241-296)
- final_norm; logits h @ target lm_head^T (dspark_mla.py:472-474, 507-508); Markov bias
  markov_w2(markov_w1[prev]) (qwen3_dspark.py DSparkMarkovHead, dspark_mla.py:188-193)
- the greedy chain: prev_0 = x_t, draft_k = argmax(logits_k + bias(prev_k)), prev_{k+1} = draft_k.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tests.helpers.models import save_target, seeded

HIDDEN, VOCAB, MASK = 32, 64, 60
TARGET_LAYERS = 6
FEATURES = [0, 2, 4]  # output of layer i
BLOCK = 4
RANK = 16
DECODER = dict(
    hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, intermediate_size=48, hidden_act="silu",
    rms_norm_eps=1e-5, vocab_size=VOCAB, max_position_embeddings=512, rope_theta=50000.0,
)  # fmt: skip


def build_target(save_dir) -> str:
    """A tiny KimiLinearForCausalLM: one KDA layer (its reference PyTorch fallback is slow on CPU), five MLA."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    config = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, linear_head_dim=8, linear_num_heads=4, rms_norm_eps=1e-6, max_position_embeddings=512,
        initializer_range=0.5, layer_types=["linear_attention"] + ["full_attention"] * (TARGET_LAYERS - 1),
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    with seeded(0):
        model = KimiLinearForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return save_target(model, save_dir)


def drafter_config(**changes) -> dict:
    """vLLM's K3DSparkConfig as a config.json: DeepseekV3Config's names, the DSpark fields."""
    raw = dict(
        architectures=["K3DSparkModel"], model_type="k3_dspark", **DECODER, target_hidden_size=HIDDEN,
        num_target_layers=len(FEATURES), target_layer_ids=list(FEATURES), block_size=BLOCK, mask_token_id=MASK,
        markov_rank=RANK, enable_confidence_head=False,
    )  # fmt: skip
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


def hf_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**DECODER, n_routed_experts=0, n_shared_experts=0, num_experts_per_tok=0)


def vllm_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """vLLM's non-neox rotary on x [..., T, d]: pairs (x_2i, x_2i+1) rotated by position * theta^(-2i/d)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = positions.float()[:, None] * inv[None, :]  # [T, d/2]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


class Layer(nn.Module):
    def __init__(self, config, index: int):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3Attention,
            DeepseekV3MLP,
            DeepseekV3RMSNorm,
        )

        super().__init__()
        self.self_attn = DeepseekV3Attention(config, index)  # its projections and norms, not its forward
        self.self_attn.kv_a_layernorm.variance_epsilon = config.rms_norm_eps  # vLLM's latent norms (mla.py:252, 287)
        self.self_attn.q_a_layernorm.variance_epsilon = config.rms_norm_eps
        self.mlp = DeepseekV3MLP(config, intermediate_size=config.intermediate_size)
        self.input_layernorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class ReferenceK3DSpark(nn.Module):
    def __init__(self):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        super().__init__()
        self.config = config = hf_config()
        self.context_proj = nn.Linear(HIDDEN * len(FEATURES), HIDDEN, bias=False)
        self.context_norm = DeepseekV3RMSNorm(HIDDEN, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = DeepseekV3RMSNorm(HIDDEN, eps=config.rms_norm_eps)
        self.markov_head = nn.Module()
        self.markov_head.markov_w1 = nn.Embedding(VOCAB, RANK)
        self.markov_head.markov_w2 = nn.Linear(RANK, VOCAB, bias=False)

    def _latent(self, attn, x: torch.Tensor, positions: torch.Tensor):
        """(k [heads, T, qk], v [heads, T, v]) from x [T, H]: the latent, normed, expanded by kv_b_proj."""
        cfg = self.config
        kv_c, k_pe = attn.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = attn.kv_b_proj(attn.kv_a_layernorm(kv_c)).view(x.shape[0], cfg.num_attention_heads, -1)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k_pe = vllm_rope(k_pe, positions, cfg.rope_parameters["rope_theta"])[:, None].expand(-1, k_nope.shape[1], -1)
        return torch.cat([k_nope, k_pe], dim=-1).transpose(0, 1), v.transpose(0, 1)

    def _attention(self, attn, x, positions, ctx_k, ctx_v):
        cfg = self.config
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(x.shape[0], cfg.num_attention_heads, -1)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q = torch.cat(
            [q_nope, vllm_rope(q_pe.transpose(0, 1), positions, cfg.rope_parameters["rope_theta"]).transpose(0, 1)], -1
        )
        k, v = self._latent(attn, x, positions)
        k, v = torch.cat([ctx_k, k], dim=1), torch.cat([ctx_v, v], dim=1)
        scores = q.transpose(0, 1) @ k.transpose(-1, -2) * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        out = scores.softmax(dim=-1) @ v  # [heads, b, v]: the whole context and block, no mask
        return attn.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))

    def block(self, features, ids, anchor: int, queries: int, embed, head, mask: int = MASK):
        """(hidden [queries, H] after final_norm, base logits [queries, V]) of the block at `anchor`."""
        c = self.context_norm(self.context_proj(features[:anchor]))
        ctx_pos, pos = torch.arange(anchor), torch.arange(anchor, anchor + queries)
        tokens = torch.full((queries,), mask, dtype=torch.long)
        tokens[0] = ids[anchor]
        h = embed[tokens]
        for layer in self.layers:
            ctx_k, ctx_v = self._latent(layer.self_attn, c, ctx_pos)
            h = h + self._attention(layer.self_attn, layer.input_layernorm(h), pos, ctx_k, ctx_v)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.final_norm(h)
        return h, h @ head.T

    def bias(self, previous: torch.Tensor) -> torch.Tensor:
        return self.markov_head.markov_w2(self.markov_head.markov_w1(previous))

    @torch.no_grad()
    def chain(self, features, ids, anchor: int, queries: int, embed, head) -> tuple[list[int], list[int]]:
        """(the greedy chain, the teacher-forced drafts given the stored predecessors) at `anchor`."""
        _, base = self.block(features, ids, anchor, queries, embed, head)
        previous, drafts = int(ids[anchor]), []
        for k in range(queries):
            previous = int((base[k] + self.bias(torch.tensor(previous))).argmax())
            drafts.append(previous)
        stored = ids[anchor : anchor + queries]
        stored = torch.cat([stored, stored.new_zeros(queries - stored.numel())])
        return drafts, (base + self.bias(stored)).argmax(dim=-1).tolist()

    def block_loss(self, features, ids, anchor: int, embed, head) -> torch.Tensor:
        queries = min(BLOCK, ids.numel() - 1 - anchor)
        _, base = self.block(features, ids, anchor, queries, embed, head)
        logits = base + self.bias(ids[anchor : anchor + queries])
        return nn.functional.cross_entropy(logits, ids[anchor + 1 : anchor + 1 + queries])


def target_features(target, ids: torch.Tensor) -> torch.Tensor:
    """[T, n H]: transformers' hidden_states[i + 1] (the output of layer i) of FEATURES."""
    states = target(ids[None], output_hidden_states=True, use_cache=False).hidden_states
    return torch.cat([states[i + 1][0] for i in FEATURES], dim=-1)


def fit(drafter: ReferenceK3DSpark, target, sequences, steps: int, lr: float, seed: int = 0) -> float:
    """A short Adam fit of the reference's own block loss on random response anchors (the target's
    embedding and lm_head frozen, as vLLM shares them); the last loss."""
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    with torch.no_grad():
        data = [(target_features(target, ids), ids, prompt) for ids, prompt in sequences if ids.numel() - 1 > prompt]
    optimizer = torch.optim.Adam(drafter.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = 0.0
        for features, ids, prompt in data:
            anchor = int(torch.randint(prompt, ids.numel() - 1, (1,), generator=gen))
            loss = loss + drafter.block_loss(features, ids, anchor, embed, head)
        (loss / len(data)).backward()
        optimizer.step()
    return float(loss.detach()) / len(data)


def save(drafter: ReferenceK3DSpark, raw: dict, out_dir) -> str:
    """config.json and model.safetensors under the reference's names, which are vLLM's checkpoint names
    before its stacking (dspark_mla.py:437-453)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone().contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    return str(out)


def with_seed(seed: int):
    return seeded(seed)
