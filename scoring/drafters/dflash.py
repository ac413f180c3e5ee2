"""The z-lab DFlash v1 family (`DFlashDraftModel`): its config.json in the project's terms.

Config: Qwen3 fields (hidden_size, num_hidden_layers, heads, head_dim, intermediate_size,
vocab_size, rms_norm_eps, layer_types, sliding_window) plus `block_size`, `num_target_layers`
and `dflash_config = {mask_token_id, target_layer_ids}`; the reference reads each DFlash field
from `dflash_config` first, then the top level. Layer ids are already in this project's
convention (the output of layer i). The model is dflash_model.py's; the inference rule is
docs/drafter-families.md's and docs/anchors-and-blocks.md's.
"""

from __future__ import annotations

from pipeline.common.drafter_configs.speculators import SpeculatorsDFlash
from pipeline.common.drafter_configs.zlab import ZlabDFlash
from scoring.drafters.base import DrafterConfig, DrafterConfigError, Family, decoder_shape
from scoring.drafters.dflash_model import DFlashDrafter, qwen3_config

ARCHITECTURE = "DFlashDraftModel"


def attention_layout(raw: dict, source: str) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) as the reference sees them: through Qwen3Config, which
    drops `sliding_window` unless `use_sliding_window` is true and derives missing layer_types."""
    num_layers = raw["num_hidden_layers"]
    hf = qwen3_config(raw, source)
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


def decoder_fields(decoder: dict, source: str) -> dict:
    """The DrafterConfig fields of the decoder, as the reference's Qwen3Config resolves them
    (its defaults included: head_dim 128, num_key_value_heads = heads)."""
    layer_types, sliding_window = attention_layout(decoder, source)
    hf = qwen3_config(decoder)
    return dict(**decoder_shape(hf), layer_types=layer_types, sliding_window=sliding_window)


def speculators_decoder(raw: dict, source: str, family: str) -> dict:
    """A speculators config's `transformer_layer_config`, which must be a Qwen3 decoder: the
    DFlash backbone's layers are Qwen3's."""
    decoder = raw["transformer_layer_config"]
    if decoder.get("model_type", "qwen3") != "qwen3":
        raise DrafterConfigError(
            f"{source}: field 'transformer_layer_config.model_type' is {decoder['model_type']!r}; specreplay "
            f"scores {family} drafters with a Qwen3 decoder (model_type 'qwen3') only"
        )
    return decoder


def stated_layers(checked) -> dict:
    """The feature layer ids as the checkpoint states them, and their convention (compatibility
    checks a before-layer id against the target's layer count)."""
    ids = checked.stored_layer_ids() if hasattr(checked, "stored_layer_ids") else None
    return {"stated_layer_ids": None if ids is None else list(ids), "layer_convention": checked.CONVENTION}


def parse_zlab(checked: ZlabDFlash, raw: dict, source: str) -> DrafterConfig:
    """A z-lab DFlash v1 config (validated against its declared layout) in the project's terms."""
    softcap = checked.value("final_logit_softcapping")
    return DrafterConfig(
        **decoder_fields(raw, source),
        block_size=checked.value("block_size", 16),
        mask_token_id=checked.value("mask_token_id"),
        target_layer_ids=checked.feature_layers(source),
        num_target_layers=checked.num_target_layers,
        is_causal=checked.is_causal,
        input_embedding_scale=float(checked.value("input_embedding_scale", 1.0)),
        output_multiplier=float(checked.value("output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap is None or softcap <= 0 else float(softcap),
        raw=raw,
    )


def parse_speculators(checked: SpeculatorsDFlash, raw: dict, source: str) -> DrafterConfig:
    """A speculators DFlash config: z-lab DFlash v1's inference (docs/drafter-families.md), its
    ids one layer higher, no scales, and maybe a reduced draft vocabulary."""
    if checked.sample_from_anchor:
        raise DrafterConfigError(
            f"{source}: field 'sample_from_anchor' is true: a DFlash drafter that drafts from the anchor's own "
            f"slot is DSpark's geometry, which no DFlash inference implements (vLLM refuses it too)"
        )
    decoder = speculators_decoder(raw, source, "DFlash")
    config = DrafterConfig(
        **decoder_fields(decoder, source),
        block_size=checked.block_size,
        mask_token_id=checked.mask_token_id,
        target_layer_ids=checked.feature_layers(source),
        num_target_layers=None,
        is_causal=None,
        raw=decoder,  # what the backbone builds its Qwen3Config from
        layout="speculators",
        sliding_non_causal=checked.sliding_window_non_causal,
        **stated_layers(checked),
    )
    config.draft_vocab_size = draft_vocab(checked.draft_vocab_size, config.vocab_size, source)
    return config


def draft_vocab(draft_vocab_size: int, vocab_size: int, source: str) -> int | None:
    """speculators' `draft_vocab_size`: None when it is the target's whole vocabulary."""
    if draft_vocab_size > vocab_size:
        raise DrafterConfigError(
            f"{source}: field 'draft_vocab_size' is {draft_vocab_size}, larger than transformer_layer_config."
            f"vocab_size {vocab_size}; a draft vocabulary is a subset of the target's"
        )
    return draft_vocab_size if draft_vocab_size < vocab_size else None


def parse_drafter_config(checked: ZlabDFlash | SpeculatorsDFlash, raw: dict, source: str = "config") -> DrafterConfig:
    """A DFlash (v1 semantics) config of either layout in the project's terms."""
    if isinstance(checked, SpeculatorsDFlash):
        return parse_speculators(checked, raw, source)
    return parse_zlab(checked, raw, source)


FAMILY = Family("DFlash", parse_drafter_config, DFlashDrafter)
