"""Which family scores a drafter checkpoint, from its config.json alone (or `--family NAME[:LAYOUT]`).

The layout is detected and the file validated against it by proposers/layouts.py (shared with
`extract --draft-config`); here a validated layout is handed to the family that reads it
(proposers/registry.py), whose config.py turns it into the config its model is built from.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.common.schema import SchemaError
from proposers.fields.known import refuse_unknown
from proposers.layouts import Override, read_detected
from proposers.registry import Family, families_of, family
from proposers.toolkit.config import DrafterConfig, DrafterConfigError


@dataclass(frozen=True)
class Parsed:
    """A drafter config in the project's terms, with how its family was found."""

    config: DrafterConfig
    family: Family
    assumed: str | None  # what detection assumed (proposers/layouts.py), None when the file said it


def _validated(raw: dict, source: str, override: Override | None):
    try:
        return read_detected(raw, source, override=override)
    except SchemaError as error:  # a drafter config error like every other, for the callers that sort them
        raise DrafterConfigError(str(error)) from None


def _family_of(checked, override: Override | None) -> str:
    """The family reading the validated layout: the one its fields name (z-lab's layout is read by
    DFlash and DFlash2), which must be the override's when one is given."""
    name = checked.family
    if name not in families_of(type(checked)):  # a layout that names a family not reading it: a registry slip
        raise RuntimeError(f"layout {type(checked).__name__} names family {name!r}, which does not list it")
    if override and name != override.family:
        raise DrafterConfigError(
            f"the config is a {name} drafter's ({checked.evidence}), not {override.family}'s: "
            f"--family {override.spelling} cannot read it"
        )
    return name


def detect_family(raw: dict, source: str = "config", override: Override | None = None) -> str:
    """The registry name of the family that reads the config `raw`; DrafterConfigError otherwise."""
    return _family_of(_validated(raw, source, override)[0], override)


def parse_config(
    raw: dict, source: str = "config", target_layers: int | None = None, override: Override | None = None
) -> Parsed:
    """The config in the project's terms, parsed by its family; errors name the field and the file.
    `target_layers`: the target's layer count, which tells a before-layer id L (the final hidden
    state before the norm, stored as id L) from the others (output of layer s - 1), and resolves
    the layouts whose default feature layers depend on it (EAGLE-3)."""
    checked, detected = _validated(raw, source, override)
    record = family(_family_of(checked, override))
    refuse_unknown(checked, raw, source)
    config = record.parse_config(checked, raw, source, target_layers)
    config.family = record.name
    if checked.CONVENTION == "before" and target_layers is not None:
        config.target_layer_ids = checked.feature_layers(source, target_layers)
    return Parsed(config, record, detected.assumed)


def parse_drafter_config(
    raw: dict, source: str = "config", target_layers: int | None = None, override: Override | None = None
) -> DrafterConfig:
    """`parse_config`'s config alone."""
    return parse_config(raw, source, target_layers, override).config


def build_drafter(config: DrafterConfig):
    """The family's model for `config`, weights not loaded (proposers/checkpoints/load.py loads them);
    None for a family without weights."""
    model = family(config.family).model
    return None if model is None else model(config)
