"""The Qwen3 decoder every block drafter is built on (DFlash, DFlash2, DSpark), as the references
resolve it from a config.json: transformers' Qwen3Config (RoPE, the MLP activation, the effective
sliding window, default layer types and head_dim), the decoder fields of a `DrafterConfig`, and the
fields the block families' layouts state alike (a speculators `transformer_layer_config`, the
feature layer ids as stated, a reduced draft vocabulary)."""

from __future__ import annotations

from transformers import Qwen3Config

from proposers.fields.decoder_rules import check_block_decoder, refuse
from proposers.toolkit.config import DrafterConfig, DrafterConfigError, decoder_shape, transformers_config


def qwen3_config(raw: dict, source: str = "config") -> Qwen3Config:
    """The Qwen3Config the reference builds from config.json (drives RoPE, the MLP activation,
    the effective sliding window and default layer types)."""
    return transformers_config(Qwen3Config, raw, source, drop=("architectures", "auto_map", "dflash_config"))


def decoder_hf_config(config: DrafterConfig) -> Qwen3Config:
    """The Qwen3Config of the decoder (`config.raw` holds its fields in every layout: the top
    level of a z-lab config.json, `transformer_layer_config` of a speculators one)."""
    hf = qwen3_config(config.raw)
    hf.head_dim = config.head_dim
    return hf


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


def checked_decoder_fields(decoder: dict, source: str, where: str = "", own_model_type: bool = False) -> dict:
    """`decoder_fields`, once the decoder's fields the replay does not implement are refused by
    name (proposers/fields/decoder_rules.py); `where` prefixes the names ('transformer_layer_config.')."""
    fields = decoder_fields(decoder, source)
    check_block_decoder(decoder, qwen3_config(decoder, source), where, source, own_model_type)
    return fields


def zlab_attention(checked) -> dict:
    """The attention fields of a z-lab config as vLLM and llama.cpp read them: `is_causal`, else
    `dflash_config.causal`, for every layer; `dflash_config.attention_value_scale` on every value."""
    options = checked.dflash_config
    causal = checked.is_causal if checked.is_causal is not None or options is None else options.causal
    scale = None if options is None else options.attention_value_scale
    return {"is_causal": causal, "attention_value_scale": 1.0 if scale is None else float(scale)}


def zlab_windows(checked, raw: dict, decoder: dict, source: str) -> dict:
    """`dflash_config.use_swa` and `swa_window_size` as vLLM (qwen3_dflash.py:96-156) and llama.cpp
    (conversion/qwen.py:740-747) both read them: swa_window_size, else sliding_window, windows the
    sliding layers; use_swa over layer_types without a sliding layer windows every layer, whose
    causality layer_types still decides. Where the two engines part, refused by name."""
    options = checked.dflash_config
    use_swa = bool(options is not None and options.use_swa)
    size = None if options is None else options.swa_window_size
    types = decoder["layer_types"]
    sliding = types.count("sliding_attention")
    if use_swa and 0 < sliding < len(types):
        refuse(
            source,
            "dflash_config.use_swa",
            True,
            "with layer_types mixing sliding and full layers vLLM windows its sliding layers only and llama.cpp "
            "every layer; set every layer_types entry to sliding_attention, or use_swa to false",
        )
    if use_swa and size is None and not (raw.get("use_sliding_window") and raw.get("sliding_window")):
        refuse(
            source,
            "dflash_config.use_swa",
            True,
            f"without dflash_config.swa_window_size vLLM takes Qwen3Config's sliding_window (dropped unless "
            f"use_sliding_window is true) and llama.cpp the file's ({raw.get('sliding_window')!r}); "
            f"set dflash_config.swa_window_size",
        )
    windowed = use_swa or sliding > 0
    window = int(size) if windowed and size is not None else decoder["sliding_window"]
    return {"sliding_window": window, "window_every_layer": use_swa and not sliding}


def zlab_block_fields(checked, raw: dict, source: str) -> dict:
    """The DrafterConfig fields a z-lab DFlash or DFlash2 config shares: the checked decoder, the
    block fields read from dflash_config first, then the top level, and the attention fields."""
    softcap = checked.value("final_logit_softcapping")
    decoder = checked_decoder_fields(raw, source, own_model_type=True)
    return dict(
        **decoder | zlab_windows(checked, raw, decoder, source),
        block_size=checked.value("block_size", 16),
        mask_token_id=checked.value("mask_token_id"),
        target_layer_ids=checked.feature_layers(source),
        num_target_layers=checked.value("num_target_layers"),
        **zlab_attention(checked),
        input_embedding_scale=float(checked.value("input_embedding_scale", 1.0)),
        output_multiplier=float(checked.value("output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap is None or softcap <= 0 else float(softcap),
        raw=raw,
    )


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


def draft_vocab(draft_vocab_size: int, vocab_size: int, source: str) -> int | None:
    """speculators' `draft_vocab_size`: None when it is the target's whole vocabulary."""
    if draft_vocab_size > vocab_size:
        raise DrafterConfigError(
            f"{source}: field 'draft_vocab_size' is {draft_vocab_size}, larger than transformer_layer_config."
            f"vocab_size {vocab_size}; a draft vocabulary is a subset of the target's"
        )
    return draft_vocab_size if draft_vocab_size < vocab_size else None


def speculators_block(
    checked, raw: dict, source: str, family: str, label: str, *, full_vocab: bool = True, **fields
) -> DrafterConfig:
    """A speculators block drafter's config (DFlash, DFlash2, XPress: `transformer_layer_config`,
    `block_size`, `mask_token_id`, before-layer ids, `sliding_window_non_causal`); `fields` the
    family's own. A reduced `draft_vocab_size` is the config's `draft_vocab_size`, or, `full_vocab`,
    refused (`label` names the family there)."""
    decoder = speculators_decoder(raw, source, label)
    shape = checked_decoder_fields(decoder, source, "transformer_layer_config.")
    if full_vocab and checked.draft_vocab_size != shape["vocab_size"]:
        raise DrafterConfigError(
            f"{source}: field 'draft_vocab_size' is {checked.draft_vocab_size}, not transformer_layer_config."
            f"vocab_size {shape['vocab_size']}; specreplay scores {label} drafters over the full target vocabulary"
        )
    config = DrafterConfig(
        **shape,
        block_size=checked.block_size,
        mask_token_id=checked.mask_token_id,
        target_layer_ids=checked.feature_layers(source),
        num_target_layers=None,
        is_causal=checked.transformer_layer_config.is_causal,
        raw=decoder,  # what the backbone builds its Qwen3Config from, as for every speculators family
        family=family,
        layout="speculators",
        sliding_non_causal=checked.sliding_window_non_causal,
        **fields,
        **stated_layers(checked),
    )
    if not full_vocab:
        config.draft_vocab_size = draft_vocab(checked.draft_vocab_size, config.vocab_size, source)
    return config
