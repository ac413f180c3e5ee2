"""Kimi K3's DSpark drafter (`K3DSparkModel`, k3_layout.py): its config read into a DrafterConfig, and the
DSpark drafter on dense MLA layers (proposers/toolkit/mla/attention.py). The rule, as vLLM runs it
(vllm/models/kimi_k3/nvidia/dspark_mla.py, v1/worker/gpu/spec_decode/dspark/speculator.py):
- context `c = context_norm(context_proj(features))` (dspark_mla.py:150-160, 214-215); each layer's
  context keys and values from c alone, through that layer's `kv_a_proj_with_mqa`, `kv_a_layernorm` and
  interleaved RoPE at the context positions (`_duplicate_context_kv_weights`, :39-57; :274-308);
- the block [x_t, mask, ...] embedded by the TARGET's embedding (:147-148, 210-212), each layer
  `h + attn(input_layernorm(h))`, then `h + mlp(post_attention_layernorm(h))` (:106-131; the fused
  norms add the residual first), MLA with q-LoRA (q_a_proj, q_a_layernorm, q_b_proj), scale
  qk_head_dim^-0.5, every block query seeing the whole block (`non_causal_multi_token_decode`, :87-88)
  and the context before the anchor; a SiLU-gated MLP (kimi_k3/nvidia/model.py:201-296);
- `final_norm`, the TARGET's lm_head (:472-474), the vanilla Markov bias (`DSparkMarkovHead`, :188-193;
  the file's `markov_head_type` is not read), the confidence head with a bias (:195-205).
"""

from __future__ import annotations

from dataclasses import asdict

from torch import nn
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3MLP,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)

from proposers.dspark.k3_layout import SOURCE, K3DSpark
from proposers.dspark.layout import resolve_heads
from proposers.dspark.model import DSparkDrafter
from proposers.fields.decoder_rules import shown
from proposers.fields.rules import check_target_width, dspark_from_anchor
from proposers.toolkit.config import DrafterConfig, DrafterConfigError
from proposers.toolkit.mla.attention import MlaAttention


def parse_k3(checked: K3DSpark, raw: dict, source: str, target_layers: int | None = None) -> DrafterConfig:
    """The DrafterConfig of a K3 DSpark config, once what vLLM refuses or runs otherwise is refused by name."""
    _check_decoder(checked, raw, source)
    confidence = bool(checked.enable_confidence_head)
    heads = resolve_heads(
        checked.markov_rank,
        "vanilla",
        confidence,
        confidence and bool(checked.confidence_head_with_markov),
        checked.confidence_threshold,
        "",
        "vLLM's K3DSparkModel",
        source,
    )
    key, mask = checked.mask
    if mask >= checked.vocab_size:
        _refuse(key, mask, f"outside the vocabulary of {checked.vocab_size}; set a token id below it", source)
    layers = checked.num_hidden_layers
    config = DrafterConfig(
        hidden_size=checked.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=checked.num_attention_heads,
        num_key_value_heads=checked.num_attention_heads,  # keys expanded per head from the latent
        head_dim=checked.qk_nope_head_dim + checked.qk_rope_head_dim,
        intermediate_size=checked.intermediate_size,
        vocab_size=checked.vocab_size,
        rms_norm_eps=float(checked.rms_norm_eps or 1e-6),
        block_size=checked.block,
        mask_token_id=mask,
        target_layer_ids=checked.feature_layers(source, target_layers),
        num_target_layers=None,  # the file's num_target_layers counts the ids, not the target's layers
        layer_types=["full_attention"] * layers,
        sliding_window=None,
        is_causal=False,  # the block bidirectional (dspark_mla.py:88)
        raw=raw,
        family="dspark",
        layout="k3",
        drafts_from_anchor=dspark_from_anchor(checked),
        family_options=asdict(heads) | {"decoder": "k3"},
    )
    check_target_width(checked.target_hidden_size, config, source)
    return config


def _refuse(field: str, value, why: str, source: str) -> None:
    raise DrafterConfigError(
        f"{source}: field '{field}' is {shown(value)}: {why}; refusing rather than scoring it wrong"
    )


# (field, the values vLLM runs, the file's value, why the others are refused)
def _decoder_rules(checked: K3DSpark, raw: dict) -> list[tuple[str, tuple, object, str]]:
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return [
        ("mla_use_nope", (False, None), checked.mla_use_nope, f"{SOURCE} refuse it (k3_dspark.py:43-58)"),
        ("mla_use_output_gate", (False, None), checked.mla_use_output_gate, f"{SOURCE} refuse it"),
        ("mla_use_qk_norm", (False, None), checked.mla_use_qk_norm, f"{SOURCE} refuse it"),
        ("dspark_bonus_anchor", (False, None), checked.dspark_bonus_anchor, f"{SOURCE} refuse it"),
        ("draft_vocab_size", (None, checked.vocab_size), checked.draft_vocab_size,
         f"vLLM's K3DSparkConfig requires the full vocabulary (k3_dspark.py:60-67); give {checked.vocab_size}"),
        ("hidden_act", ("silu", None), checked.hidden_act, "vLLM's KimiMLP runs silu or situ (kimi_k3/nvidia/"
         "model.py:275-286); specreplay runs silu only"),
        ("rope_interleave", (True, None), checked.rope_interleave, "vLLM's MLA rotates interleaved pairs whatever "
         "it says (kimi_k3/nvidia/mla.py:174-179); remove it"),
        ("attention_bias", (False, None), checked.attention_bias, "vLLM's MLA projections have no bias"),
        ("n_routed_experts", (0, None), checked.n_routed_experts, "the K3 DSpark draft is dense (k3_dspark.py:20-26)"),
        ("rope_parameters.rope_type", ("default", None), rope.get("rope_type"), "vLLM would run DeepSeek's YaRN "
         "(kimi_k3/nvidia/mla.py:166-189), which specreplay does not read for this layout; use default"),
        ("logit_scale", (1, 1.0, None), checked.logit_scale, "vLLM scales the draft logits (dspark_mla.py:475)"),
    ]  # fmt: skip


def _check_decoder(checked: K3DSpark, raw: dict, source: str) -> None:
    for field, served, value, why in _decoder_rules(checked, raw):
        if value not in served:
            _refuse(field, value, why, source)
    if not checked.markov_rank:
        _refuse("markov_rank", checked.markov_rank, "vLLM's K3DSparkModel always builds a Markov head", source)


def k3_config(config: DrafterConfig) -> DeepseekV3Config:
    """transformers' DeepseekV3Config of the drafter (K3DSparkConfig's RoPE default: theta 50000)."""
    raw = {k: v for k, v in config.raw.items() if k not in ("architectures", "model_type")}
    if "rope_parameters" not in raw and "rope_scaling" not in raw:
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(raw.get("rope_theta", 50000.0))}
    raw.update(n_routed_experts=0, n_shared_experts=0, num_experts_per_tok=0, rope_interleave=True)  # dense, pairs
    return DeepseekV3Config(**raw)


class K3Layer(nn.Module):
    """One K3 DSpark decoder layer (dspark_mla.py:60-131): MLA, then a SiLU-gated MLP, pre-norm residuals."""

    def __init__(self, config: DrafterConfig, hf: DeepseekV3Config):
        super().__init__()
        self.self_attn = MlaAttention(config, hf)
        self.mlp = DeepseekV3MLP(hf, intermediate_size=hf.intermediate_size)
        self.input_layernorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


# checkpoint names (vLLM's K3DSparkModel, before its stacking) -> the block drafter's
RENAMED = {"context_proj.": "fc.", "context_norm.": "hidden_norm.", "final_norm.": "norm."}


def k3_names(state: dict) -> dict:
    """The checkpoint's tensors under the block drafter's names; `embed_tokens` and `lm_head` dropped, as
    vLLM drops them for the target's (dspark_mla.py:437-446)."""
    out = {}
    for name, tensor in state.items():
        if name.startswith(("embed_tokens.", "lm_head.")):
            continue
        own = next((p for p in RENAMED if name.startswith(p)), None)
        out[RENAMED[own] + name[len(own) :] if own else name] = tensor
    return out


class K3DSparkDrafter(DSparkDrafter):
    """DSpark's heads over K3's dense MLA layers; the target's embedding and lm_head."""

    layer_class = K3Layer
    decoder_config = staticmethod(k3_config)
    norm_class = DeepseekV3RMSNorm
    rotary_class = DeepseekV3RotaryEmbedding
    canonical_names = staticmethod(k3_names)

    @property
    def optional_weights(self) -> tuple[str, ...]:
        """vLLM keeps the confidence head only when the checkpoint has it (dspark_mla.py:459-464)."""
        if self.confidence_head is None:
            return ()
        return ("confidence_head.proj.weight", "confidence_head.proj.bias")
