"""z-lab's layout (`"architectures": ["DFlashDraftModel"]`, or `DFlash2DraftModel`), shared by the
DFlash and DFlash2 families: the config.json is the drafter's Qwen3 config with the DFlash fields
beside it; the reference reads each DFlash field from `dflash_config` first, then from the top
level. Layer ids count the output of layer i, this project's own convention
(docs/layer-numbering.md). A `dflash_config` holding DFlash2's convolution or selector keys is
DFlash2 in this layout; one whose `projector_type` is "dspark" is SpecForge's DSpark
(proposers/dspark/layout.py)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import field_validator

from pipeline.common.layer_ids import build_target_layer_ids
from pipeline.common.schema import Count, Number, Positive, Schema, SchemaError
from proposers.toolkit.layout_fields import REQUIRED_SHAPE, DecoderFields, LayerIds, unique_ids

DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


class DFlashOptions(Schema):
    """`dflash_config`: z-lab's DFlash fields (each may also sit at the top level)."""

    mask_token_id: Count | None = None
    target_layer_ids: LayerIds | None = None
    block_size: Positive | None = None
    input_embedding_scale: Number | None = None
    output_multiplier: Number | None = None
    final_logit_softcapping: Number | None = None
    conv_kernel_size: Positive | None = None
    conv_group_size: Positive | None = None
    selector_rank: Positive | None = None
    selector_top_k: Positive | None = None
    projector_type: str | None = None

    _unique = field_validator("target_layer_ids")(unique_ids)


class ZlabDFlash(DecoderFields):
    LAYOUT: ClassVar[str] = "z-lab"
    CONVENTION: ClassVar[str] = "output"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("DFlashDraftModel", "DFlash2DraftModel")

    architectures: list[str] | None = None
    num_target_layers: Positive | None = None
    is_causal: bool | None = None
    block_size: Positive | None = None
    mask_token_id: Count | None = None
    target_layer_ids: LayerIds | None = None
    input_embedding_scale: Number | None = None
    output_multiplier: Number | None = None
    final_logit_softcapping: Number | None = None
    conv_kernel_size: Positive | None = None
    conv_group_size: Positive | None = None
    selector_rank: Positive | None = None
    selector_top_k: Positive | None = None
    dflash_config: DFlashOptions | None = None

    _unique = field_validator("target_layer_ids")(unique_ids)

    def value(self, name: str, default=None):
        """As the reference reads a DFlash field: `dflash_config[name]`, else the top level."""
        nested = None if self.dflash_config is None else getattr(self.dflash_config, name)
        if nested is not None:
            return nested
        top = getattr(self, name, None)
        return default if top is None else top

    def field_name(self, name: str) -> str:
        """Where `name` was read from, for messages."""
        nested = self.dflash_config is not None and getattr(self.dflash_config, name) is not None
        return f"dflash_config.{name}" if nested else name

    @property
    def family(self) -> str:
        return "dflash2" if self.evidence != "architectures ['DFlashDraftModel']" else "dflash"

    @property
    def evidence(self) -> str:
        """What in the file says which family it is, for messages."""
        if "DFlash2DraftModel" in (self.architectures or []):
            return "architectures ['DFlash2DraftModel']"
        key = next((key for key in DFLASH2_KEYS if self.value(key) is not None), None)
        return f"field {self.field_name(key)!r}" if key else "architectures ['DFlashDraftModel']"

    def check_complete(self, source: str) -> None:
        """The fields every DFlash drafter states (the shapes, the mask token)."""
        missing = self.require(REQUIRED_SHAPE)
        if self.value("mask_token_id") is None:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise SchemaError(f"{source}: missing field {missing[0]!r}; is this a DFlash drafter config.json?")

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        """Feature layer ids in this project's convention, as the reference resolves them:
        target_layer_ids, else the default formula over the config's num_target_layers (or
        `num_target_layers`, the target's, when the caller has it) and the drafter's layers."""
        ids = self.value("target_layer_ids")
        if ids is not None:
            return list(ids)
        layers = self.num_target_layers or num_target_layers
        if layers is None:
            raise SchemaError(
                f"{source}: neither dflash_config.target_layer_ids nor num_target_layers is set, so the "
                f"feature layers are unknown"
            )
        if self.num_hidden_layers is None:
            raise SchemaError(
                f"{source}: has neither dflash_config.target_layer_ids nor num_hidden_layers; pass --layer-ids explicitly"
            )
        return build_target_layer_ids(layers, self.num_hidden_layers)
