"""The Gemma 4 decoder a block drafter may be built on (DeepSpec's `Gemma4DSparkModel`), as both
engines run it; neutral: any family whose block decoder is Gemma 4's uses it.

Every layer is a full-attention Gemma 4 layer with `attention_k_eq_v` (vLLM
model_executor/models/gemma4_dspark.py:36-117, gemma4_mtp.py:255-331; llama.cpp
src/models/dflash.cpp:612-632 (context) and 690-791 (block)):

- queries `q_norm(q_proj(x))`, keys `k_norm(k_proj(x))`, values the same projection `k_proj(x)`
  RMS-normed without a weight (gemma4_dspark.py:94-104; dflash.cpp:620-627, 712-720), RoPE on
  queries and keys only;
- attention scale 1 (gemma4_mtp.py:181; the converter writes `attention.scale` 1,
  conversion/gemma.py:862, which dflash.cpp:590 reads);
- sandwich norms: `h + post_attention_layernorm(attn(input_layernorm(h)))`, then
  `h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))`, the sum times the layer's
  `layer_scalar` (gemma4_mtp.py:306-331; dflash.cpp:727-791); the MLP GELU-tanh gated
  (`hidden_activation` gelu_pytorch_tanh, conversion/gemma.py:824-825);
- proportional RoPE on full-attention layers: the first `partial_rotary_factor * head_dim / 2`
  frequency pairs rotate with `theta^(-2i/head_dim)`, the rest not at all (transformers
  modeling_rope_utils.py `_compute_proportional_rope_parameters`; llama.cpp keeps the unrotated
  pairs in place with frequency factors 1e30, conversion/gemma.py:897-911).

Norms, the MLP and the rotary frequencies are transformers' own Gemma 4 modules (Gemma4RMSNorm
computes in float32 as the engines' kernels do)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, Gemma4TextMLP, Gemma4TextRotaryEmbedding

from pipeline.common import timing
from proposers.toolkit.attention import attend
from proposers.toolkit.config import DrafterConfig, transformers_config
from proposers.toolkit.layers import DrafterAttention, apply_rope

FULL = "full_attention"
# keys of a Gemma 4 drafter's config.json that are not Gemma4TextConfig's (the block fields)
NOT_DECODER = (
    "architectures", "auto_map", "dflash_config", "block_size", "mask_token_id", "target_layer_ids",
    "num_target_layers", "num_anchors", "markov_rank", "markov_head_type", "enable_confidence_head",
    "confidence_head_with_markov", "confidence_threshold", "sample_from_anchor", "draft_vocab_size", "is_causal",
)  # fmt: skip


def gemma4_config(raw: dict, source: str = "config") -> Gemma4TextConfig:
    """transformers' Gemma4TextConfig of a Gemma 4 drafter's decoder fields: what its defaults fill
    (per_layer_config from `global_head_dim`, `num_global_key_value_heads`), per-layer embeddings and
    kv-shared layers off (neither engine's drafter layer has them: vLLM gemma4_dspark.py:66, gemma4_mtp.py:284-290)."""
    off = {"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0}  # per-layer inputs, shared KV: the target's
    fields = {k: v for k, v in raw.items() if k not in NOT_DECODER} | off
    return transformers_config(Gemma4TextConfig, fields, source)


def full_layer(hf: Gemma4TextConfig):
    """The per-layer config of a full-attention layer (head_dim, num_key_value_heads as resolved)."""
    return hf.per_layer_config[hf.layer_types.index(FULL)]


class ProportionalRotary(nn.Module):
    """transformers' Gemma 4 rotary embedding of the full-attention layers, called as the other
    drafters' (x, positions) -> cos, sin; built from `config` alone (the loader rebuilds it)."""

    def __init__(self, config: Gemma4TextConfig):
        super().__init__()
        self.config = config
        self.inner = Gemma4TextRotaryEmbedding(config)

    @property
    def inv_freq(self) -> torch.Tensor:
        return getattr(self.inner, f"{FULL}_inv_freq")

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        return self.inner(x, positions, FULL)


class Gemma4BlockAttention(DrafterAttention):
    """Gemma 4's attention over [context ; block]: V from K's projection, normed without a weight."""

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        d, eps = config.head_dim, config.rms_norm_eps
        self.v_proj = None  # attention_k_eq_v: no value projection of its own
        self.q_norm = Gemma4RMSNorm(d, eps=eps)
        self.k_norm = Gemma4RMSNorm(d, eps=eps)
        self.v_norm = Gemma4RMSNorm(d, eps=eps, with_scale=False)
        self.scale = 1.0  # the q/k norms keep the logits in range

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., T, H] -> roped, normed keys and values [..., kv_heads, T, d]."""
        projected = self.k_proj(x).view(*x.shape[:-1], self.kv_heads, self.head_dim)
        k = self.k_norm(projected).transpose(-2, -3)
        v = self.values_of(x, projected).transpose(-2, -3)
        return apply_rope(k, cos, sin), v

    def values_of(self, x: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        """V: K's projection RMS-normed without a weight (the rule both engines run)."""
        return self.v_norm(projected)

    def attend_to(self, q, k, v, ctx_k, ctx_v, mask) -> torch.Tensor:
        A, _, b, _ = q.shape
        with timing.stage("attention"):
            out = attend(q, k, v, ctx_k, ctx_v, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(A, b, -1))


class Gemma4BlockLayer(nn.Module):
    """A Gemma 4 decoder layer over [context ; block], its weights named as Gemma4TextDecoderLayer's."""

    def __init__(self, config: DrafterConfig, hf: Gemma4TextConfig):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4BlockAttention(config)
        self.mlp = Gemma4TextMLP(hf, hf.layer_types.index(FULL))
        self.input_layernorm = Gemma4RMSNorm(size, eps=eps)
        self.post_attention_layernorm = Gemma4RMSNorm(size, eps=eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(size, eps=eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(size, eps=eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # in the checkpoint (vLLM and llama.cpp: 1 if absent)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


def with_layer_scalars(state: dict) -> dict:
    """`state` with `layers.{i}.layer_scalar` = 1 for each layer the checkpoint has none of, as vLLM's
    buffer default (gemma4_mtp.py:304) and llama.cpp's optional tensor (dflash.cpp:238) read it."""
    layers = {name.split(".")[1] for name in state if name.startswith("layers.")}
    missing = {f"layers.{i}.layer_scalar" for i in layers} - set(state)
    return state | {name: torch.ones(1) for name in missing}
