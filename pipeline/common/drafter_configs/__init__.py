"""Drafter config.json layouts, declared: one module per layout (zlab.py, speculators.py, the other
projects' DSpark and EAGLE-3 layouts in dspark_layouts.py and eagle3_layouts.py), the
decoder fields they share (decoder.py), and `read_drafter_format`, which picks the layout and
validates the file against it before anything else reads it.

Shared by both stages and torch-free: `extract --draft-config` reads a drafter's feature layers
through it, `score` its whole config (scoring/drafters/ turns a validated layout into a model).

Detection, in this order (docs/drafter-families.md#detection): `speculators_model_type`
(speculators exports may carry z-lab's own `"architectures": ["DFlashDraftModel"]` with another
layout and another layer convention, so the architecture alone misleads), then `architectures`,
then the keys of `dflash_config`.
"""

from __future__ import annotations

from pipeline.common.drafter_configs.dspark_layouts import DeepSpecDSpark, SpecForgeDSpark
from pipeline.common.drafter_configs.eagle3_layouts import SpecForgeEagle3
from pipeline.common.drafter_configs.native_mtp import MTP_TARGET_TYPES, NativeMTP
from pipeline.common.drafter_configs.speculators import SPECULATORS_FORMATS, SpeculatorsFormat
from pipeline.common.drafter_configs.zlab import ZlabDFlash
from pipeline.common.schema import SchemaError, found, validate

ARCHITECTURES = {
    "DFlashDraftModel": ZlabDFlash,
    "DFlash2DraftModel": ZlabDFlash,
    "DSparkDraftModel": SpecForgeDSpark,  # speculators' saves carry it too, with speculators_model_type
    "Qwen3DSparkModel": DeepSpecDSpark,
    "LlamaForCausalLMEagle3": SpecForgeEagle3,
}
# Known layouts this version does not declare yet: refused by name rather than read wrong.
KNOWN_ELSEWHERE = {
    "Gemma4DSparkModel": "DeepSpec's Gemma 4 DSpark",
}
DrafterFormat = ZlabDFlash | SpeculatorsFormat | SpecForgeDSpark | DeepSpecDSpark | SpecForgeEagle3 | NativeMTP


def layout_of(raw: dict, source: str) -> type:
    """The declared layout class of the config `raw` (read from `source`)."""
    kind = raw.get("speculators_model_type")
    if kind is not None:
        if not isinstance(kind, str) or kind not in SPECULATORS_FORMATS:
            raise SchemaError(
                f"{source}: field 'speculators_model_type' is {found(kind)}; expected one of "
                f"{sorted(SPECULATORS_FORMATS)}"
            )
        return SPECULATORS_FORMATS[kind]
    if raw.get("model_type") in MTP_TARGET_TYPES:  # a target's own config: its native MTP head
        return NativeMTP
    architectures = raw.get("architectures") or ["DFlashDraftModel"]  # z-lab's, when unsaid
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise SchemaError(f"{source}: field 'architectures' is {found(architectures)}; expected a list of names")
    for arch in architectures:
        if arch in KNOWN_ELSEWHERE:
            raise SchemaError(
                f"{source}: architecture {arch!r} is {KNOWN_ELSEWHERE[arch]} layout, which specreplay does not "
                f"read yet; refusing rather than scoring it wrong"
            )
        if arch not in ARCHITECTURES:
            raise SchemaError(
                f"{source}: architecture {arch!r} is not a drafter layout specreplay reads (it reads "
                f"{sorted(ARCHITECTURES)} and speculators_model_type {sorted(SPECULATORS_FORMATS)}); "
                f"refusing rather than scoring it wrong"
            )
    dflash_config = raw.get("dflash_config")
    if isinstance(dflash_config, dict) and dflash_config.get("projector_type") == "dspark":
        return SpecForgeDSpark  # SpecForge's DSpark, whichever architecture it names
    return ARCHITECTURES[architectures[0]]


def read_drafter_format(raw, source: str, complete: bool = True) -> DrafterFormat:
    """The config `raw` validated against its layout; with `complete`, also complete enough to
    build a drafter from (extract, which reads only the feature layers, does not ask that)."""
    if not isinstance(raw, dict):
        raise SchemaError(f"{source}: the file holds {found(raw)}; expected a JSON object (a drafter config.json)")
    layout = layout_of(raw, source)
    checked = validate(layout, raw, source)
    if complete:
        checked.check_complete(source)
    return checked


def feature_layers_of(raw, source: str, num_target_layers: int | None = None) -> list[int]:
    """The feature layers a drafter config names, in this project's convention (output of layer
    i), whatever its layout's convention. `num_target_layers` is the target's, when the caller
    has it (extract does; a z-lab config without ids or num_target_layers needs it)."""
    return read_drafter_format(raw, source, complete=False).feature_layers(source, num_target_layers)
