"""Which family a drafter checkpoint belongs to, from its config.json alone.

In this order (docs/drafter-families.md#detection): `speculators_model_type` (speculators
exports may carry z-lab's own `"architectures": ["DFlashDraftModel"]` with another layout and
another layer convention, so the architecture alone misleads), then `architectures`, then the
keys of `dflash_config`. A family this project does not score yet is refused by name.
"""

from __future__ import annotations

from torch import nn

from scoring.drafters import dflash
from scoring.drafters.base import DrafterConfig, DrafterConfigError, Family

FAMILIES: dict[str, Family] = {"dflash": dflash.FAMILY}

# Known to exist, not scored yet: refused by name rather than read in the wrong layout.
NOT_YET = "which specreplay does not score yet; refusing rather than scoring it wrong"
SPECULATORS_TYPES = {
    "dflash": "speculators-format DFlash",
    "dflash2": "speculators-format DFlash2",
    "dspark": "speculators-format DSpark",
    "eagle3": "speculators-format EAGLE-3",
    "mtp": "speculators-format MTP",
}
ARCHITECTURES = {"DFlashDraftModel": "dflash"}


def detect_family(raw: dict, source: str) -> str:
    """The FAMILIES key of the config `raw` (read from `source`); DrafterConfigError otherwise."""
    kind = raw.get("speculators_model_type")
    if kind is not None:
        name = SPECULATORS_TYPES.get(kind, f"speculators model type {kind!r}")
        raise DrafterConfigError(f"{source}: speculators_model_type {kind!r} is the {name} format, {NOT_YET}")
    architectures = raw.get("architectures") or ["DFlashDraftModel"]  # z-lab's, when unsaid
    for arch in architectures:
        if arch not in ARCHITECTURES:
            raise DrafterConfigError(
                f"{source}: architecture {arch!r} is not supported (specreplay implements "
                f"{sorted(ARCHITECTURES)}); refusing rather than scoring it wrong"
            )
    if (raw.get("dflash_config") or {}).get("projector_type") == "dspark":
        raise DrafterConfigError(f"{source}: dflash_config.projector_type 'dspark' is SpecForge's DSpark, {NOT_YET}")
    return ARCHITECTURES[architectures[0]]


def parse_drafter_config(raw: dict, source: str = "config") -> DrafterConfig:
    """The config in the project's terms, parsed by its family; errors name the field and the file."""
    family = detect_family(raw, source)
    config = FAMILIES[family].parse_config(raw, source)
    config.family = family
    return config


def build_drafter(config: DrafterConfig) -> nn.Module:
    """The family's model for `config`, weights not loaded (checkpoint.py loads them)."""
    return FAMILIES[config.family].build(config)
