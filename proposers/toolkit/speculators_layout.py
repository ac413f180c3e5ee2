"""vLLM speculators' layout (PyPI `speculators`): `speculators_model_type` names the algorithm,
the draft decoder's config is nested as `transformer_layer_config`, and feature layers are
`aux_hidden_state_layer_ids` (EAGLE-3: `eagle_aux_hidden_state_layer_ids`) counted BEFORE layer
i, the residual entering it, one more than this project's id for the same tensor
(docs/layer-numbering.md). `speculators_config.verifier.name_or_path` names the target on the
training machine: informative, never required to exist. Defaults are the reference classes'.

This module holds what the families' speculators layouts share (each family's layout.py declares
its own class): the base, the block drafters' fields (DFlash, DFlash2, DSpark) and the EAGLE-style
drafters' (EAGLE-3, P-EAGLE)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import field_validator, model_validator

from pipeline.common.schema import Count, Number, Positive, Schema, SchemaError
from proposers.toolkit.layout_fields import (
    REQUIRED_SHAPE,
    BlockDecoderFields,
    DecoderFields,
    DraftDecoderFields,
    DrafterNamespace,
    LayerIds,
    unique_ids,
)


class ProposalMethod(DrafterNamespace):
    """One of `speculators_config.proposal_methods` (speculators proposals/greedy.py)."""

    proposal_type: str | None = None
    speculative_tokens: Positive | None = None  # vLLM's num_speculative_tokens
    verifier_accept_k: Positive | None = None  # training-only: no engine relaxes verification
    accept_tolerance: Number | None = None  # training-only, with verifier_accept_k


class Verifier(DrafterNamespace):
    """`speculators_config.verifier`: the target it was trained against (training-only)."""

    name_or_path: str | None = None
    architectures: list[str] | None = None


class SpeculatorsSettings(DrafterNamespace):
    """`speculators_config`: the algorithm, its proposal methods (how many tokens a step
    drafts) and the verifier it was trained for."""

    algorithm: str | None = None
    proposal_methods: list[ProposalMethod] | None = None
    default_proposal_method: str | None = None
    verifier: Verifier | None = None


class SpeculatorsFormat(Schema):
    LAYOUT: ClassVar[str] = "speculators"
    CONVENTION: ClassVar[str] = "before"
    FAMILY: ClassVar[str]
    IDS_FIELD: ClassVar[str] = "aux_hidden_state_layer_ids"

    speculators_model_type: str
    speculators_version: str | None = None  # bookkeeping
    architectures: list[str] | None = None
    transformer_layer_config: DecoderFields
    speculators_config: SpeculatorsSettings | None = None
    draft_vocab_size: Positive = 32000
    target_hidden_size: Positive | None = None

    @property
    def family(self) -> str:
        return self.FAMILY

    @property
    def evidence(self) -> str:
        return f"speculators_model_type {self.speculators_model_type!r}"

    @property
    def decoder(self) -> DecoderFields:
        return self.transformer_layer_config

    # transformers' config class of `transformer_layer_config`, by its model_type (absent: None's)
    DECODER_CLASSES: ClassVar[dict[str | None, str]] = {None: "Qwen3Config", "qwen3": "Qwen3Config"}

    def namespaces(self) -> dict[str, tuple[str | None, type[Schema]]]:
        """The top level (a PretrainedConfig of speculators' class) and `transformer_layer_config`
        (see DecoderFields.namespaces)."""
        decoder = self.DECODER_CLASSES.get(self.decoder.model_type)
        return {"": ("PretrainedConfig", type(self)), "transformer_layer_config": (decoder, type(self.decoder))}

    @property
    def speculative_tokens(self) -> int | None:
        """Tokens a step drafts, as the first proposal method says (vLLM reads it there)."""
        methods = (self.speculators_config and self.speculators_config.proposal_methods) or []
        return methods[0].speculative_tokens if methods else None

    def check_complete(self, source: str) -> None:
        missing = self.decoder.require(REQUIRED_SHAPE, "transformer_layer_config.")
        if missing:
            raise SchemaError(f"{source}: missing field {missing[0]!r}; is this a speculators drafter config.json?")

    def stored_layer_ids(self) -> list[int] | None:
        """The feature layer ids as the checkpoint states them (before-layer numbering)."""
        return getattr(self, self.IDS_FIELD)

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        """Feature layer ids in this project's convention: a before-layer id s is the output of
        layer s - 1, except s = L (the target's layer count: the residual after the last layer,
        before the final norm), which is this project's id L (layer_ids.final_prenorm_id); telling
        it apart needs `num_target_layers`. The embedding output (s = 0) is never stored."""
        ids = self.stored_layer_ids()
        if ids is None:
            raise SchemaError(f"{source}: {self.IDS_FIELD} is not set, so the feature layers are unknown")
        return from_before_layer(ids, num_target_layers, source, self.IDS_FIELD)


def from_before_layer(ids: list[int], num_target_layers: int | None, source: str, field: str) -> list[int]:
    """Before-layer ids (speculators', vLLM's) in this project's convention: s is the output of
    layer s - 1, except s = L (the target's layer count), this project's id L
    (layer_ids.final_prenorm_id). The embedding output (s = 0) is never stored."""
    if 0 in ids:
        raise SchemaError(
            f"{source}: {field} lists 0, the embedding output (before layer 0), which specreplay does not store"
        )
    return [s if s == num_target_layers else s - 1 for s in ids]


class SpeculatorsBlock(SpeculatorsFormat):
    """The fields speculators' block drafters share (DFlash, DFlash2, DSpark: a block [x_t, mask, ...]
    over the target's aux hidden states); each family's class narrows `speculators_model_type`."""

    transformer_layer_config: BlockDecoderFields
    block_size: Positive = 8
    aux_hidden_state_layer_ids: LayerIds | None = None
    mask_token_id: Count | None = None
    sliding_window_non_causal: bool = False
    sample_from_anchor: bool = False

    _unique = field_validator("aux_hidden_state_layer_ids")(unique_ids)

    def check_complete(self, source: str) -> None:
        super().check_complete(source)
        if self.mask_token_id is None:
            raise SchemaError(f"{source}: missing field 'mask_token_id'; a DFlash drafter needs its mask token")


class SpeculatorsEagle(SpeculatorsFormat):
    """The fields speculators' EAGLE-style drafters share (models/eagle3/config.py; P-EAGLE's config
    extends it): without ids, the default is [2, L // 2, L - 3] before-layer ids of an L-layer
    target (utils.resolve_target_layer_ids), so reading them needs L. Each family's class narrows
    `speculators_model_type`."""

    IDS_FIELD: ClassVar[str] = "eagle_aux_hidden_state_layer_ids"

    DECODER_CLASSES: ClassVar[dict[str | None, str]] = {
        None: "Qwen3Config",
        "qwen3": "Qwen3Config",
        "llama": "LlamaConfig",
    }

    transformer_layer_config: DraftDecoderFields
    eagle_aux_hidden_state_layer_ids: LayerIds | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    embed_requires_grad: bool = False

    _unique = field_validator("eagle_aux_hidden_state_layer_ids")(unique_ids)

    @model_validator(mode="after")
    def _one_fc_norm(self):
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("fields 'norm_before_fc' and 'fc_norm' are both true; they are exclusive, set one of them")
        return self

    def stored_layer_ids(self) -> list[int] | None:
        return self.eagle_aux_hidden_state_layer_ids

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        if self.eagle_aux_hidden_state_layer_ids is not None:
            return super().feature_layers(source, num_target_layers)
        ids = default_eagle_ids((2, 0, -3), num_target_layers, source, "eagle_aux_hidden_state_layer_ids")
        return [s if s == num_target_layers else s - 1 for s in ids]


def default_eagle_ids(
    offsets: tuple[int, int, int], num_target_layers: int | None, source: str, field: str
) -> list[int]:
    """An EAGLE-3 layout's default aux ids for an L-layer target, [a, L // 2 + b, L + c] for
    `offsets` (a, b, c): speculators' (2, 0, -3) and SpecForge's (1, -1, -4) name the same three
    layers, each in its own numbering. Refused when L is unknown or the ids collide (a target too
    shallow for the default; speculators refuses it too)."""
    if num_target_layers is None:
        raise SchemaError(
            f"{source}: {field} is not set, so the feature layers are the layout's default for the target's "
            f"layer count, which is unknown here"
        )
    first, middle, last = offsets
    ids = [first, num_target_layers // 2 + middle, num_target_layers + last]
    if len(set(ids)) != 3 or min(ids) < 0:
        raise SchemaError(
            f"{source}: {field} is not set and its default {ids} for a {num_target_layers}-layer target names a "
            f"layer twice; set {field} explicitly"
        )
    return ids
