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
from proposers.toolkit.qwen3_decoder import speculators_block, zlab_block_fields
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
    config = speculators_block(checked, raw, source, "dflash", "DFlash", full_vocab=False)
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
