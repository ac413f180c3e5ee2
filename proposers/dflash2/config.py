"""The DFlash2 family (`DFlash2DraftModel`), in z-lab's and in speculators' layout.

z-lab: DFlash v1's config (dflash.py) plus `conv_kernel_size`, `conv_group_size`,
`selector_rank`, `selector_top_k`, each read from `dflash_config` first, then the top level;
none has a default in the reference. Layer ids count the output of layer i (ours).

speculators (`speculators_model_type: "dflash2"`): the decoder's Qwen3 fields nested as
`transformer_layer_config`, the DFlash2 fields at the top level (defaults 2, 16, 256, 16),
`aux_hidden_state_layer_ids` counted before layer i (ours + 1), `sliding_window_non_causal`
(default true) and `sample_from_anchor`. Its reference has no input_embedding_scale,
output_multiplier or soft-capping: the weights were trained without them, so they stay neutral
here whatever the file says.

Both references refuse a convolution group that does not divide hidden_size, a kernel longer
than the block, more selector candidates than the vocabulary and a reduced draft vocabulary;
so does this module, naming the field. The model is model.py's.
"""

from __future__ import annotations

from proposers.dflash2.layout import SpeculatorsDFlash2
from proposers.dflash2.model import DFlash2Drafter
from proposers.fields.rules import check_speculators_block, check_zlab
from proposers.registry import Family
from proposers.toolkit.config import DrafterConfig, DrafterConfigError
from proposers.toolkit.qwen3_decoder import speculators_block, zlab_block_fields
from proposers.toolkit.zlab_layout import DFLASH2_KEYS, ZlabDFlash


def parse_zlab(checked: ZlabDFlash, raw: dict, source: str) -> DrafterConfig:
    missing = [checked.field_name(key) for key in DFLASH2_KEYS if checked.value(key) is None]
    if missing:
        raise DrafterConfigError(
            f"{source}: DFlash2 field dflash_config.{missing[0]} is missing; z-lab's DFlash2DraftModel has no "
            f"default for it. Add it to dflash_config (conv_kernel_size, conv_group_size, selector_rank, "
            f"selector_top_k)"
        )
    config = DrafterConfig(
        **zlab_block_fields(checked, raw, source),
        family="dflash2",
        layout="z-lab",
        family_options={key: int(checked.value(key)) for key in DFLASH2_KEYS},
    )
    check_options(config, source, {key: checked.field_name(key) for key in DFLASH2_KEYS})
    check_zlab(checked, config, source)
    return config


def parse_speculators(checked: SpeculatorsDFlash2, raw: dict, source: str) -> DrafterConfig:
    config = speculators_block(
        checked,
        raw,
        source,
        "dflash2",
        "DFlash2",  # speculators refuses a reduced vocabulary for DFlash2 too
        drafts_from_anchor=checked.sample_from_anchor,
        family_options={key: int(getattr(checked, key)) for key in DFLASH2_KEYS},
    )
    check_options(config, source, {key: key for key in DFLASH2_KEYS})
    check_speculators_block(checked, config, source)
    return config


def check_options(config: DrafterConfig, source: str, names: dict[str, str]) -> None:
    """What both references refuse (speculators' DFlash2 classes check each; z-lab's would fail
    mid-run or silently drop taps), named as the file names the field."""
    options = config.family_options
    vocab_field = "transformer_layer_config.vocab_size" if config.layout == "speculators" else "vocab_size"
    if config.hidden_size % options["conv_group_size"]:
        raise DrafterConfigError(
            f"{source}: {names['conv_group_size']} {options['conv_group_size']} does not divide hidden_size "
            f"{config.hidden_size}; the convolution groups hidden channels, so it must"
        )
    if options["conv_kernel_size"] > config.block_size:
        raise DrafterConfigError(
            f"{source}: {names['conv_kernel_size']} {options['conv_kernel_size']} exceeds block_size "
            f"{config.block_size}; the convolution runs inside one block"
        )
    if options["selector_top_k"] > config.vocab_size:
        raise DrafterConfigError(
            f"{source}: {names['selector_top_k']} {options['selector_top_k']} exceeds {vocab_field} "
            f"{config.vocab_size}; the selector picks its candidates among the vocabulary"
        )


def parse_drafter_config(
    checked: ZlabDFlash | SpeculatorsDFlash2, raw: dict, source: str = "config", target_layers: int | None = None
) -> DrafterConfig:
    """A DFlash2 config (validated against its declared layout) in the project's terms."""
    if checked.LAYOUT == "speculators":
        return parse_speculators(checked, raw, source)
    return parse_zlab(checked, raw, source)


FAMILY = Family("dflash2", parse_drafter_config, DFlash2Drafter, independent_drafts=False)
