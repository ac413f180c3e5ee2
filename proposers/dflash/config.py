"""The z-lab DFlash v1 family (`DFlashDraftModel`): its config.json in the project's terms.

Config: Qwen3 fields (hidden_size, num_hidden_layers, heads, head_dim, intermediate_size,
vocab_size, rms_norm_eps, layer_types, sliding_window) plus `block_size`, `num_target_layers`
and `dflash_config = {mask_token_id, target_layer_ids}`; the reference reads each DFlash field
from `dflash_config` first, then the top level. Layer ids are already in this project's
convention (the output of layer i). The model is model.py's; the inference rule is
docs/drafter-families.md's and docs/anchors-and-blocks.md's.
"""

from __future__ import annotations

from proposers.dflash.layout import SpeculatorsDFlash
from proposers.dflash.model import DFlashDrafter
from proposers.fields.rules import check_speculators_block, check_zlab
from proposers.registry import Family
from proposers.toolkit.config import DrafterConfig, DrafterConfigError
from proposers.toolkit.qwen3_decoder import (
    checked_decoder_fields,
    draft_vocab,
    speculators_decoder,
    stated_layers,
    zlab_block_fields,
)
from proposers.toolkit.zlab_layout import ZlabDFlash


def parse_zlab(checked: ZlabDFlash, raw: dict, source: str) -> DrafterConfig:
    """A z-lab DFlash v1 config (validated against its declared layout) in the project's terms."""
    config = DrafterConfig(**zlab_block_fields(checked, raw, source))
    check_zlab(checked, config, source)
    return config


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
        **checked_decoder_fields(decoder, source, "transformer_layer_config."),
        block_size=checked.block_size,
        mask_token_id=checked.mask_token_id,
        target_layer_ids=checked.feature_layers(source),
        num_target_layers=None,
        is_causal=checked.transformer_layer_config.is_causal,
        raw=decoder,  # what the backbone builds its Qwen3Config from
        layout="speculators",
        sliding_non_causal=checked.sliding_window_non_causal,
        **stated_layers(checked),
    )
    config.draft_vocab_size = draft_vocab(checked.draft_vocab_size, config.vocab_size, source)
    check_speculators_block(checked, config, source)
    return config


def parse_drafter_config(
    checked: ZlabDFlash | SpeculatorsDFlash, raw: dict, source: str = "config", target_layers: int | None = None
) -> DrafterConfig:
    """A DFlash (v1 semantics) config of either layout in the project's terms."""
    if isinstance(checked, SpeculatorsDFlash):
        return parse_speculators(checked, raw, source)
    return parse_zlab(checked, raw, source)


FAMILY = Family("dflash", parse_drafter_config, DFlashDrafter)
