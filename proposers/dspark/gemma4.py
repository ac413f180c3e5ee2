"""DeepSpec's Gemma 4 DSpark drafter (`Gemma4DSparkModel`): its config read into a DrafterConfig, and
the DSpark drafter on Gemma 4 block layers (proposers/toolkit/gemma4/decoder.py).

The rule, as vLLM (model_executor/models/gemma4_dspark.py) and llama.cpp (conversion/gemma.py:813-911,
src/models/dflash.cpp) both run it; they agree on every point below:

- context keys/values per layer from `hidden_norm(fc(features))`: K = RoPE(k_norm(k_proj(c))),
  V = rms_norm(k_proj(c)) without a weight, no RoPE (gemma4_dspark.py:242-265; dflash.cpp:612-632);
- block queries [x_t, mask, ...] embedded by the drafter's own `embed_tokens` times sqrt(hidden_size)
  (gemma4_dspark.py:161-166, 209-210; the converter's `embedding_scale`, gemma.py:861, dflash.cpp:677-680);
- Gemma 4 block layers (the toolkit module), every one full attention, bidirectional in the block
  unless `is_causal` (qwen3_dflash.py:62-73; dflash.cpp's DFlash default);
- `norm`, then the drafter's own `lm_head` (its embedding when tied: dflash.cpp:169-171), plus the
  vanilla Markov bias; greedy drafts argmax, the predecessor chain and the confidence cut DSpark's
  (proposers/dspark/model.py).

vLLM applies `final_logit_softcapping` to the draft logits (gemma4_dspark.py:304-307) and an attention
logit soft-cap (gemma4_mtp.py:167); llama.cpp refuses the first (gemma.py:871-872) and does not read
the second: both are refused. vLLM keeps sqrt(hidden_size) in the model dtype (a bf16 run rounds it);
the replay multiplies in its compute dtype, as llama.cpp's F32 scale.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

from proposers.dspark.gemma4_layout import DeepSpecGemma4DSpark, head_type_of
from proposers.dspark.layout import resolve_heads
from proposers.dspark.model import DSparkDrafter, rename_legacy_keys
from proposers.fields.decoder_rules import shown
from proposers.fields.rules import dspark_from_anchor
from proposers.toolkit.config import DrafterConfig, DrafterConfigError, refuse_field
from proposers.toolkit.gemma4.decoder import (
    FULL,
    Gemma4BlockLayer,
    ProportionalRotary,
    full_layer,
    gemma4_config,
    with_layer_scalars,
)


def parse_gemma4(checked: DeepSpecGemma4DSpark, raw: dict, source: str) -> DrafterConfig:
    """The DrafterConfig of a Gemma 4 DSpark config, once what the engines refuse is refused by name."""
    hf = gemma4_config(raw, source)
    _check_decoder(checked, hf, source)
    heads = resolve_heads(
        checked.markov_rank or 0,
        head_type_of(checked),
        bool(checked.enable_confidence_head),
        bool(checked.enable_confidence_head and checked.confidence_head_with_markov),
        checked.confidence_threshold,
        "",
        "DeepSpec's Gemma4DSparkModel",
        source,
    )
    layer = full_layer(hf)
    mask = checked.option("mask_token_id", source)
    if mask >= hf.vocab_size:
        refuse_field(
            source, "mask_token_id", mask, f"outside the vocabulary of {hf.vocab_size}; set a token id below it"
        )
    return DrafterConfig(
        hidden_size=hf.hidden_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=layer.num_key_value_heads,
        head_dim=layer.head_dim,
        intermediate_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        rms_norm_eps=float(hf.rms_norm_eps),
        block_size=checked.block_size,
        mask_token_id=mask,
        target_layer_ids=checked.feature_layers(source),
        num_target_layers=checked.num_target_layers,
        layer_types=list(hf.layer_types),
        sliding_window=None,
        is_causal=checked.is_causal,
        input_embedding_scale=float(hf.hidden_size**0.5),
        raw=raw,
        family="dspark",
        layout="deepspec",
        drafts_from_anchor=dspark_from_anchor(checked),
        family_options=asdict(heads) | {"decoder": "gemma4", "tied": bool(hf.tie_word_embeddings)},
    )


# (field, the value the engines run, its value in transformers' resolved config, why the others are refused)
def _decoder_rules(checked: DeepSpecGemma4DSpark, hf) -> list[tuple[str, object, object, str]]:
    full = [FULL] * hf.num_hidden_layers
    rope = (hf.rope_parameters or {}).get(FULL, hf.rope_parameters or {})
    return [
        ("attention_k_eq_v", True, hf.attention_k_eq_v, "both engines take V from K's projection (llama.cpp's converter refuses false); set it true"),
        ("layer_types", full, list(hf.layer_types), "llama.cpp's converter takes full_attention layers only "
         "(Gemma4TextConfig makes five of six sliding when the field is absent); list full_attention for each layer"),
        ("hidden_activation", "gelu_pytorch_tanh", hf.hidden_activation, "llama.cpp's converter takes gelu_pytorch_tanh only; set it"),
        ("attention_bias", False, bool(hf.attention_bias), "llama.cpp's converter refuses attention biases; set it false"),
        ("enable_moe_block", False, bool(hf.enable_moe_block), "llama.cpp's converter refuses a mixture-of-experts drafter; set it false"),
        ("draft_vocab_size", hf.vocab_size, checked.draft_vocab_size or hf.vocab_size,
         f"llama.cpp's converter takes the full vocabulary ({hf.vocab_size}) only; remove it"),
        ("markov_head_type", "vanilla", head_type_of(checked), "llama.cpp's converter and vLLM run the vanilla Markov head only; set vanilla"),
        ("rope_parameters.full_attention.rope_type", ("default", "proportional"), rope.get("rope_type", "default"),
         "llama.cpp's converter takes default or proportional RoPE only; set one"),
        ("final_logit_softcapping", None, hf.final_logit_softcapping or None,
         "vLLM caps the draft logits and llama.cpp's converter refuses it; remove it"),
        ("attn_logit_softcapping", None, checked.attn_logit_softcapping, "vLLM caps the attention logits and "
         "llama.cpp does not read it; remove it"),
        ("dflash_config.use_swa", None, (checked.dflash_config and checked.dflash_config.use_swa) or None,
         "vLLM's Gemma 4 DSpark applies no window where llama.cpp would; remove it"),
    ]  # fmt: skip


def _check_decoder(checked: DeepSpecGemma4DSpark, hf, source: str) -> None:
    for field, served, value, why in _decoder_rules(checked, hf):
        allowed = served if isinstance(served, tuple) else (served,)
        if value not in allowed:
            raise DrafterConfigError(
                f"{source}: field '{field}' is {shown(value)}: {why}; refusing rather than scoring it wrong"
            )


def _decoder_config(config: DrafterConfig):
    return gemma4_config(config.raw)


class Gemma4DSparkDrafter(DSparkDrafter):
    """DSpark's heads over Gemma 4 block layers; its own embedding and lm_head (a self-contained
    checkpoint, gemma4_dspark.py:268-272)."""

    layer_class = Gemma4BlockLayer
    decoder_config = staticmethod(_decoder_config)
    norm_class = Gemma4RMSNorm
    rotary_class = ProportionalRotary

    @staticmethod
    def canonical_names(state: dict) -> dict:
        return with_layer_scalars(rename_legacy_keys(state))

    @property
    def optional_weights(self) -> tuple[str, ...]:
        """A tied drafter may leave out lm_head: its embedding is the head (llama.cpp dflash.cpp:169-171)."""
        return ("lm_head.weight",) if self.config.family_options["tied"] else ()

    def head_weight(self, lm_head: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head.weight
        return self.embed_tokens.weight


def build(config: DrafterConfig) -> DSparkDrafter:
    """The DSpark drafter of `config`: on Gemma 4 layers for a Gemma4DSparkModel, else on Qwen 3's."""
    if config.family_options.get("decoder") == "gemma4":
        return Gemma4DSparkDrafter(config)
    return DSparkDrafter(config)
