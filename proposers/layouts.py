"""Which declared layout a drafter config.json is in, and the file validated against it, torch-free.

Shared by both stages: `extract --draft-config` reads a drafter's feature layers through it, `score`
its whole config (proposers/detect.py then hands the validated layout to its family). The layouts
are the families' own (proposers/<family>/layout.py, listed by proposers/registry.py).

Detection, in this order (docs/drafter-families.md#detection): `speculators_model_type`
(speculators exports may carry z-lab's own `"architectures": ["DFlashDraftModel"]` with another
layout and another layer convention, so the architecture alone misleads), then an engine's
speculative `method` (vLLM's `speculative_config`, for proposers without weights), then a target's
own `model_type` (its native MTP head, unless `architectures` names a drafter layout), then `architectures`, then the keys of `dflash_config`. Two of
these are assumptions, said in `Detected.assumed`: a config without `architectures` is read as
z-lab's DFlash, and a Qwen3.5 / Qwen3-Next target config as its native MTP head. `score --family
NAME[:LAYOUT]` (an `Override`) replaces detection by the family's own layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.common.schema import SchemaError, found, validate
from proposers.registry import FAMILY_NAMES, families_of, layout_classes
from proposers.toolkit.speculators_layout import SpeculatorsFormat

# Architectures a drafter's config shares with plain models: read only by `--family`, said in the refusal
ONLY_BY_FAMILY = {
    "LlamaForCausalLM": "the EAGLE repository's EAGLE-1/2 (and HASS) drafters say it too: --family eagle reads one",
}
# the key of an engine's speculative config naming its method -> the layouts' class variable listing theirs
# (vLLM's `method`, llama-server's `spec-type`, SGLang's `speculative_algorithm`)
METHOD_KEYS = {"method": "METHODS", "spec-type": "SPEC_TYPES", "speculative_algorithm": "ALGORITHMS"}
# llama-server's other --spec-type values (common/speculative.cpp:33-45), and what to do instead
_WEIGHTED = "a drafter with weights: give its checkpoint directory (or its GGUF) as --ckpt, not a config of flags"
SPEC_TYPES_ELSEWHERE = {
    **{name: _WEIGHTED for name in ("draft-eagle3", "draft-dflash", "draft-dspark", "draft-mtp")},
}
UNSAID_ARCHITECTURE = "DFlashDraftModel"  # z-lab's DFlash v1 saves configs without `architectures`


@dataclass(frozen=True)
class Override:
    """`score --family NAME[:LAYOUT]`: read the config as this family's (and layout's), not as detected."""

    family: str
    layout: str | None = None

    @classmethod
    def parse(cls, text: str, option: str = "--family") -> Override:
        name, _, layout = text.partition(":")
        if name not in FAMILY_NAMES:
            raise SchemaError(f"{option} {text!r}: no family {name!r}; choose from {', '.join(FAMILY_NAMES)}")
        layouts = sorted({c.LAYOUT for c in layout_classes([name])})
        if layout and layout not in layouts:
            raise SchemaError(f"{option} {text!r}: {name} has no layout {layout!r}; its layouts: {', '.join(layouts)}")
        return cls(name, layout or None)

    @property
    def spelling(self) -> str:
        return self.family + (f":{self.layout}" if self.layout else "")


@dataclass(frozen=True)
class Detected:
    """A config's layout class, and the assumption detection made to pick it (None: the file said)."""

    layout: type
    assumed: str | None = None


def _tables(classes: list[type]) -> tuple[dict, dict, dict, dict]:
    """(speculators_model_type, an engine's speculative method, model_type, architecture) -> layout
    class, over `classes`: each layout declares how it is recognised. The methods are keyed by
    (the config's key naming them, its value): vLLM's `method`, llama-server's `spec-type`."""
    speculators = {c.FAMILY: c for c in classes if issubclass(c, SpeculatorsFormat)}
    methods = {(key, m): c for c in classes for key, names in METHOD_KEYS.items() for m in vars(c).get(names, ())}
    model_types = {t: c for c in classes for t in vars(c).get("MODEL_TYPES", ())}
    architectures = {a: c for c in classes for a in vars(c).get("ARCHITECTURES", ())}
    return speculators, methods, model_types, architectures


def detect_layout(raw: dict, source: str, override: Override | None = None) -> Detected:
    """The declared layout of the config `raw` (read from `source`): detected, or among the
    layouts of `override`'s family."""
    classes = layout_classes([override.family] if override else FAMILY_NAMES)
    if override and override.layout:
        classes = [c for c in classes if c.LAYOUT == override.layout]
    speculators, methods, model_types, architectures = _tables(classes)
    kind = raw.get("speculators_model_type")
    if kind is not None or (override and override.layout == "speculators"):
        return Detected(_speculators_layout(kind, speculators, source, override))
    for key in METHOD_KEYS:  # an engine's speculative config: a proposer with no weights
        if key in raw and (any(k == key for k, _ in methods) or not override):
            return Detected(_method_layout(raw[key], methods, source, key))
    if raw.get("model_type") in model_types and not _names_drafter(raw, architectures):
        return Detected(model_types[raw["model_type"]], _assumed_native(raw, override))
    return _by_architecture(raw, source, classes, architectures, override)


def _names_drafter(raw: dict, architectures: dict) -> bool:
    """Whether the config's first architecture is a drafter layout's: DeepSeek's own config.json with
    `DeepseekV4DSparkModel` keeps the target's model_type, and is the DSpark stages', not its MTP head."""
    said = raw.get("architectures")
    return isinstance(said, list) and bool(said) and said[0] in architectures


def _speculators_layout(kind, speculators: dict, source: str, override: Override | None) -> type:
    if override and (kind is None or kind not in speculators):
        return next(iter(speculators.values()))  # validation names the field and what the family expects
    if not isinstance(kind, str) or kind not in speculators:
        raise SchemaError(
            f"{source}: field 'speculators_model_type' is {found(kind)}; expected one of {sorted(speculators)}"
        )
    return speculators[kind]


def _method_layout(method, methods: dict, source: str, key: str) -> type:
    """The layout of an engine's speculative method named by field `key`."""
    if key == "spec-type" and method in SPEC_TYPES_ELSEWHERE:
        raise SchemaError(f"{source}: field {key!r} is {method!r}: {SPEC_TYPES_ELSEWHERE[method]}")
    if not isinstance(method, str) or (key, method) not in methods:
        expected = sorted(m for k, m in methods if k == key)
        raise SchemaError(f"{source}: field {key!r} is {found(method)}; expected one of {expected}")
    return methods[key, method]


def _assumed_native(raw: dict, override: Override | None) -> str | None:
    if override:
        return None
    return (
        f"a target's config.json (model_type {raw['model_type']!r}): scored as its native MTP head; "
        "--family NAME to read it as another family's"
    )


def _by_architecture(raw: dict, source: str, classes, architectures: dict, override: Override | None) -> Detected:
    said, assumed = raw.get("architectures"), None
    if not said:
        said = [UNSAID_ARCHITECTURE]
        assumed = "no 'architectures' field: read as z-lab's DFlash layout (DFlashDraftModel)"
    if not isinstance(said, list) or not all(isinstance(a, str) for a in said):
        raise SchemaError(f"{source}: field 'architectures' is {found(said)}; expected a list of names")
    for arch in said:
        _check_known(arch, source, architectures, override)
    dflash_config = raw.get("dflash_config")
    dspark = [c for c in classes if c.LAYOUT == "specforge" and "dspark" in families_of(c)]
    if isinstance(dflash_config, dict) and dflash_config.get("projector_type") == "dspark" and dspark:
        return Detected(dspark[0])  # SpecForge's DSpark, whichever architecture it names
    if said[0] not in architectures:  # an override whose family has none of these architectures
        return Detected(next(c for c in classes if not issubclass(c, SpeculatorsFormat)))
    return Detected(architectures[said[0]], None if override else assumed)


def _check_known(arch: str, source: str, architectures: dict, override: Override | None) -> None:
    if arch not in architectures and override is None:
        speculators = sorted(c.FAMILY for c in layout_classes() if issubclass(c, SpeculatorsFormat))
        raise SchemaError(
            f"{source}: architecture {arch!r} is not a drafter layout specreplay reads (it reads "
            f"{sorted(architectures)} and speculators_model_type {speculators}); "
            + (f"{ONLY_BY_FAMILY[arch]}; " if arch in ONLY_BY_FAMILY else "")
            + "refusing rather than scoring it wrong"
        )


def read_drafter_format(raw, source: str, complete: bool = True, override: Override | None = None):
    """The config `raw` validated against its layout; with `complete`, also complete enough to
    build a drafter from (extract, which reads only the feature layers, does not ask that)."""
    return read_detected(raw, source, complete, override)[0]


def read_detected(raw, source: str, complete: bool = True, override: Override | None = None):
    """(the validated layout, the Detected it was validated against)."""
    if not isinstance(raw, dict):
        raise SchemaError(f"{source}: the file holds {found(raw)}; expected a JSON object (a drafter config.json)")
    detected = detect_layout(raw, source, override)
    checked = validate(detected.layout, raw, source)
    if complete:
        checked.check_complete(source)
    return checked, detected


def feature_layers_of(raw, source: str, num_target_layers: int | None = None) -> list[int]:
    """The feature layers a drafter config names, in this project's convention (output of layer
    i), whatever its layout's convention. `num_target_layers` is the target's, when the caller
    has it (extract does; a z-lab config without ids or num_target_layers needs it)."""
    return read_drafter_format(raw, source, complete=False).feature_layers(source, num_target_layers)
