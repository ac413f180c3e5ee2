"""The z-lab DFlash v1 family (`DFlashDraftModel`): its config.json in the project's terms.

Config: Qwen3 fields (hidden_size, num_hidden_layers, heads, head_dim, intermediate_size,
vocab_size, rms_norm_eps, layer_types, sliding_window) plus `block_size`, `num_target_layers`
and `dflash_config = {mask_token_id, target_layer_ids}`; the reference reads each DFlash field
from `dflash_config` first, then the top level. Layer ids are already in this project's
convention (the output of layer i). The model is dflash_model.py's; the inference rule is
docs/drafter-families.md's and docs/anchors-and-blocks.md's.
"""

from __future__ import annotations

from pipeline.common.layer_ids import drafter_layer_ids
from scoring.drafters.base import DrafterConfig, DrafterConfigError, Family
from scoring.drafters.dflash_model import DFlashDrafter, qwen3_config

# Fields the DFlash family uses that this implementation does not; a config carrying any of
# them is a variant we refuse by name rather than score wrong.
UNSUPPORTED_VARIANT_FIELDS = {
    "conv_kernel_size": "DFlash2 (grouped dynamic convolutions)",
    "conv_group_size": "DFlash2 (grouped dynamic convolutions)",
    "selector_rank": "DFlash2 (candidate selector)",
    "selector_top_k": "DFlash2 (candidate selector)",
}
ARCHITECTURE = "DFlashDraftModel"


def _dflash_value(raw: dict, name: str, default=None):
    """The reference reads `dflash_config[name]` first, then the top-level field."""
    return (raw.get("dflash_config") or {}).get(name, raw.get(name, default))


def check_supported(raw: dict, source: str) -> None:
    """Refuse variants this implementation would score wrong, and configs missing the fields
    every DFlash drafter has."""
    for name, variant in UNSUPPORTED_VARIANT_FIELDS.items():
        if _dflash_value(raw, name) is not None:
            raise DrafterConfigError(
                f"{source}: field {name!r} belongs to the {variant} variant, which specreplay does not "
                f"implement; refusing rather than scoring it wrong"
            )
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if name not in raw:
            raise DrafterConfigError(f"{source}: missing field {name!r}; is this a DFlash drafter config.json?")
    if _dflash_value(raw, "mask_token_id") is None:
        raise DrafterConfigError(f"{source}: missing dflash_config.mask_token_id")


def attention_layout(raw: dict, source: str) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) as the reference sees them: through Qwen3Config, which
    drops `sliding_window` unless `use_sliding_window` is true and derives missing layer_types."""
    num_layers = int(raw["num_hidden_layers"])
    try:
        hf = qwen3_config(raw)
    except (TypeError, ValueError) as error:
        raise DrafterConfigError(f"{source}: not a valid Qwen3-style config ({error})") from error
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


# The fields parse_drafter_config reads, and what each must hold when present (None: absent).
INTEGER, NUMBER, FLAG = (int,), (int, float), (bool,)
TOP_FIELDS = {
    "hidden_size": INTEGER,
    "num_hidden_layers": INTEGER,
    "num_attention_heads": INTEGER,
    "num_key_value_heads": INTEGER,
    "head_dim": INTEGER,
    "intermediate_size": INTEGER,
    "vocab_size": INTEGER,
    "num_target_layers": INTEGER,
    "rms_norm_eps": NUMBER,
    "is_causal": FLAG,
    "attention_bias": FLAG,
}
DFLASH_FIELDS = {
    "block_size": INTEGER,
    "mask_token_id": INTEGER,
    "input_embedding_scale": NUMBER,
    "output_multiplier": NUMBER,
    "final_logit_softcapping": NUMBER,
}
KIND_NAMES = {INTEGER: "an integer", NUMBER: "a number", FLAG: "true or false"}


def _wrong_type(value, kinds: tuple) -> bool:
    # JSON true/false are Python bools, which are ints too: only FLAG fields take them
    return value is not None and (isinstance(value, bool) != (kinds is FLAG) or not isinstance(value, kinds))


def check_field_types(raw: dict, source: str) -> None:
    """Every field this family reads holds what it must, before anything converts it: one line
    naming the file, the field (with its place in dflash_config), what was found and what is expected."""
    found = [(name, raw.get(name), kinds) for name, kinds in TOP_FIELDS.items()]
    nested = raw.get("dflash_config") or {}
    for name, kinds in DFLASH_FIELDS.items():
        found.append((f"dflash_config.{name}" if name in nested else name, _dflash_value(raw, name), kinds))
    for field_name, value, kinds in found:
        if _wrong_type(value, kinds):
            raise DrafterConfigError(f"{source}: field {field_name!r} is {value!r}; expected {KIND_NAMES[kinds]}")


def parse_drafter_config(raw: dict, source: str = "config") -> DrafterConfig:
    """Validate and parse a z-lab DFlash config dict; errors name the field and the file."""
    check_supported(raw, source)
    check_field_types(raw, source)
    layer_types, sliding_window = attention_layout(raw, source)
    softcap = _dflash_value(raw, "final_logit_softcapping")
    heads = int(raw["num_attention_heads"])
    num_target_layers = raw.get("num_target_layers")
    return DrafterConfig(
        hidden_size=int(raw["hidden_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        intermediate_size=int(raw["intermediate_size"]),
        vocab_size=int(raw["vocab_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        block_size=int(_dflash_value(raw, "block_size", 16)),
        mask_token_id=int(_dflash_value(raw, "mask_token_id")),
        target_layer_ids=drafter_layer_ids(raw, source),
        num_target_layers=None if num_target_layers is None else int(num_target_layers),
        layer_types=layer_types,
        sliding_window=sliding_window,
        is_causal=raw.get("is_causal"),
        input_embedding_scale=float(_dflash_value(raw, "input_embedding_scale", 1.0)),
        output_multiplier=float(_dflash_value(raw, "output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap is None or float(softcap) <= 0 else float(softcap),
        attention_bias=bool(raw.get("attention_bias", False)),
        raw=raw,
    )


# Blockwise attention (the CPU path): the context part of the blocks' attention is computed in
# tiles of neighbouring anchors of one sample, over chunks of only the keys they see, with a
# running softmax, then merged with each block's own keys. The dense path's masked fp32 scores
# [A, heads, b, T] over every key (and their copies) make its cost grow faster than its FLOPs
# with the context length T; here one step's scores are [kv, rows, KEY_CHUNK], a few MB.
# Sizes (bench section `length`, SmolLM2 shapes): smaller tiles and chunks keep the scores in
# cache but each chunk is a dozen tensor ops, and on a busy 2-core machine every op waits at an
# OpenMP barrier; these were the fastest of the sizes tried there, within its noise.


FAMILY = Family("z-lab DFlash v1", parse_drafter_config, DFlashDrafter)
