"""Which family scores a drafter checkpoint, from its config.json alone.

The layout is detected and the file validated against it by pipeline/common/drafter_configs/
(shared with `extract --draft-config`); here a validated layout is matched with the family that
scores it. A layout that exists but is not scored yet is refused by name, after validation, so
a broken file is told as broken first.
"""

from __future__ import annotations

from torch import nn

from pipeline.common.drafter_configs import read_drafter_format
from pipeline.common.schema import SchemaError
from scoring.drafters import dflash, dflash2, dspark, eagle3, mtp
from scoring.drafters.base import DrafterConfig, DrafterConfigError, Family
from scoring.results import FAMILY_NAMES, LAYOUT_NAMES

FAMILIES: dict[str, Family] = {
    "dflash": dflash.FAMILY,
    "dflash2": dflash2.FAMILY,
    "dspark": dspark.FAMILY,
    "eagle3": eagle3.FAMILY,
    "mtp": mtp.FAMILY,
}
# (layout, family) -> the FAMILIES key that scores it
SCORED = {
    ("z-lab", "dflash"): "dflash",
    ("speculators", "dflash"): "dflash",
    ("z-lab", "dflash2"): "dflash2",
    ("speculators", "dflash2"): "dflash2",
    ("speculators", "dspark"): "dspark",
    ("specforge", "dspark"): "dspark",
    ("deepspec", "dspark"): "dspark",
    ("speculators", "eagle3"): "eagle3",
    ("specforge", "eagle3"): "eagle3",
    ("native", "mtp"): "mtp",
    ("speculators", "mtp"): "mtp",
}


NOT_YET = "which specreplay does not score yet; refusing rather than scoring it wrong"


def detect_family(raw: dict, source: str) -> str:
    """The FAMILIES key of the config `raw` (read from `source`); DrafterConfigError otherwise."""
    return _family_of(_validated(raw, source), source)


def _validated(raw: dict, source: str):
    try:
        return read_drafter_format(raw, source)
    except SchemaError as error:  # a drafter config error like every other, for the callers that sort them
        raise DrafterConfigError(str(error)) from None


def _family_of(checked, source: str) -> str:
    key = SCORED.get((checked.LAYOUT, checked.family))
    if key is None:  # validated, so a broken file was told as broken first
        raise DrafterConfigError(
            f"{source}: a {FAMILY_NAMES[checked.family]} drafter in {possessive(LAYOUT_NAMES[checked.LAYOUT])} layout ({checked.evidence}), {NOT_YET}"
        )
    return key


def possessive(name: str) -> str:
    return name + ("'" if name.endswith("s") else "'s")


def parse_drafter_config(raw: dict, source: str = "config", target_layers: int | None = None) -> DrafterConfig:
    """The config in the project's terms, parsed by its family; errors name the field and the file.
    `target_layers`: the target's layer count, which tells a before-layer id L (the final hidden
    state before the norm, stored as id L) from the others (output of layer s - 1)."""
    checked = _validated(raw, source)
    family = _family_of(checked, source)
    parse = FAMILIES[family].parse_config
    config = (
        parse(checked, raw, source, target_layers)
        if FAMILIES[family].reads_target_layers
        else parse(checked, raw, source)
    )
    config.family = family
    if checked.CONVENTION == "before" and target_layers is not None:
        config.target_layer_ids = checked.feature_layers(source, target_layers)
    return config


def supports_trees(config: DrafterConfig) -> bool:
    """Whether DDTree applies to the family of `config` (Family.trees)."""
    return FAMILIES[config.family].trees


def supports_eagle_trees(config: DrafterConfig) -> bool:
    """Whether sglang's EAGLE dynamic tree applies to the family of `config` (Family.eagle_trees)."""
    return FAMILIES[config.family].eagle_trees


def build_drafter(config: DrafterConfig) -> nn.Module:
    """The family's model for `config`, weights not loaded (checkpoint.py loads them)."""
    return FAMILIES[config.family].build(config)
