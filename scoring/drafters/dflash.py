"""The z-lab DFlash v1 family (`DFlashDraftModel`): its config.json in the project's terms.

Config: Qwen3 fields (hidden_size, num_hidden_layers, heads, head_dim, intermediate_size,
vocab_size, rms_norm_eps, layer_types, sliding_window) plus `block_size`, `num_target_layers`
and `dflash_config = {mask_token_id, target_layer_ids}`; the reference reads each DFlash field
from `dflash_config` first, then the top level. Layer ids are already in this project's
convention (the output of layer i). The model is dflash_model.py's; the inference rule is
docs/drafter-families.md's and docs/anchors-and-blocks.md's.
"""

from __future__ import annotations

from huggingface_hub.errors import StrictDataclassError

from pipeline.common.drafter_configs.zlab import ZlabDFlash
from scoring.drafters.base import DrafterConfig, DrafterConfigError, Family
from scoring.drafters.dflash_model import DFlashDrafter, qwen3_config

ARCHITECTURE = "DFlashDraftModel"


def attention_layout(raw: dict, source: str) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) as the reference sees them: through Qwen3Config, which
    drops `sliding_window` unless `use_sliding_window` is true and derives missing layer_types."""
    num_layers = raw["num_hidden_layers"]
    try:
        hf = qwen3_config(raw)
    except (TypeError, ValueError, StrictDataclassError) as error:  # what the schema does not declare
        said = " ".join(str(error).split())
        raise DrafterConfigError(f"{source}: transformers' Qwen3Config refuses it: {said}") from None
    layer_types = list(hf.layer_types or ["full_attention"] * num_layers)
    if len(layer_types) != num_layers:
        raise DrafterConfigError(f"{source}: layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise DrafterConfigError(f"{source}: layer_types {unknown} not supported (full_attention, sliding_attention)")
    if "sliding_attention" in layer_types and not hf.sliding_window:
        raise DrafterConfigError(
            f"{source}: layer_types has sliding_attention but the effective sliding_window is unset "
            f"(sliding_window={raw.get('sliding_window')!r}, use_sliding_window={raw.get('use_sliding_window')!r}; "
            f"Qwen3Config drops the window unless use_sliding_window is true, and the reference cannot run "
            f"such a drafter). Set use_sliding_window: true and sliding_window in config.json"
        )
    return layer_types, None if hf.sliding_window is None else int(hf.sliding_window)


def parse_drafter_config(checked: ZlabDFlash, raw: dict, source: str = "config") -> DrafterConfig:
    """A z-lab DFlash v1 config (validated against its declared layout) in the project's terms."""
    layer_types, sliding_window = attention_layout(raw, source)
    softcap = checked.value("final_logit_softcapping")
    heads = checked.num_attention_heads
    return DrafterConfig(
        hidden_size=checked.hidden_size,
        num_hidden_layers=checked.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=checked.num_key_value_heads or heads,
        head_dim=checked.head_dim or checked.hidden_size // heads,
        intermediate_size=checked.intermediate_size,
        vocab_size=checked.vocab_size,
        rms_norm_eps=float(checked.rms_norm_eps or 1e-6),
        block_size=checked.value("block_size", 16),
        mask_token_id=checked.value("mask_token_id"),
        target_layer_ids=checked.feature_layers(source),
        num_target_layers=checked.num_target_layers,
        layer_types=layer_types,
        sliding_window=sliding_window,
        is_causal=checked.is_causal,
        input_embedding_scale=float(checked.value("input_embedding_scale", 1.0)),
        output_multiplier=float(checked.value("output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap is None or softcap <= 0 else float(softcap),
        attention_bias=bool(checked.attention_bias),
        raw=raw,
    )


FAMILY = Family("z-lab DFlash v1", parse_drafter_config, DFlashDrafter)
