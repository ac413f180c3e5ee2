"""vLLM speculators' layout (PyPI `speculators`): `speculators_model_type` names the algorithm,
the draft decoder's config is nested as `transformer_layer_config`, and feature layers are
`aux_hidden_state_layer_ids` (EAGLE-3: `eagle_aux_hidden_state_layer_ids`) counted BEFORE layer
i, the residual entering it, one more than this project's id for the same tensor
(docs/layer-numbering.md). `speculators_config.verifier.name_or_path` names the target on the
training machine: informative, never required to exist. Defaults are the reference classes'."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.common.drafter_configs.decoder import REQUIRED_SHAPE, DecoderFields
from pipeline.common.drafter_configs.zlab import unique_ids
from pipeline.common.schema import Count, Number, Positive, Schema, SchemaError

LayerIds = Annotated[list[Count], Field(min_length=1)]


class ProposalMethod(Schema):
    proposal_type: str | None = None
    speculative_tokens: Positive | None = None


class Verifier(Schema):
    name_or_path: str | None = None
    architectures: list[str] | None = None


class SpeculatorsSettings(Schema):
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
        if 0 in ids:
            raise SchemaError(
                f"{source}: {self.IDS_FIELD} lists 0, the embedding output (before layer 0), which specreplay "
                f"does not store"
            )
        return [s if s == num_target_layers else s - 1 for s in ids]


class SpeculatorsDFlash(SpeculatorsFormat):
    FAMILY: ClassVar[str] = "dflash"

    speculators_model_type: Literal["dflash"]
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


class SpeculatorsDFlash2(SpeculatorsDFlash):
    FAMILY: ClassVar[str] = "dflash2"

    speculators_model_type: Literal["dflash2"]
    sliding_window_non_causal: bool = True
    conv_kernel_size: Positive = 2
    conv_group_size: Positive = 16
    selector_rank: Positive = 256
    selector_top_k: Positive = 16
    input_embedding_scale: Number | None = None
    output_multiplier: Number | None = None
    final_logit_softcapping: Number | None = None


class SpeculatorsDSpark(SpeculatorsDFlash):
    FAMILY: ClassVar[str] = "dspark"

    speculators_model_type: Literal["dspark"]
    sample_from_anchor: bool = True
    markov_rank: Count = 256
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True


class SpeculatorsEagle3(SpeculatorsFormat):
    """speculators' EAGLE-3 (models/eagle3/config.py): without ids, its default is [2, L // 2, L - 3]
    before-layer ids of an L-layer target (utils.resolve_target_layer_ids), so reading them needs L."""

    FAMILY: ClassVar[str] = "eagle3"
    IDS_FIELD: ClassVar[str] = "eagle_aux_hidden_state_layer_ids"

    speculators_model_type: Literal["eagle3"]
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


class SpeculatorsMTP(SpeculatorsFormat):
    """speculators' MTP export (models/mtp/config.py): `transformer_layer_config` is the verifier's
    own decoder config, and the head reads its final hidden state before the norm (its
    `target_layer_ids` is [num_hidden_layers], a before-layer id L: this project's id L)."""

    FAMILY: ClassVar[str] = "mtp"

    speculators_model_type: Literal["mtp"]
    num_nextn_predict_layers: Literal[1] = 1

    def stored_layer_ids(self) -> list[int] | None:
        layers = self.decoder.num_hidden_layers
        return None if layers is None else [layers]

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        layers = num_target_layers or self.decoder.num_hidden_layers
        if layers is None:
            raise SchemaError(f"{source}: missing field 'transformer_layer_config.num_hidden_layers'")
        return [layers]


SPECULATORS_FORMATS = {
    cls.FAMILY: cls
    for cls in (SpeculatorsDFlash, SpeculatorsDFlash2, SpeculatorsDSpark, SpeculatorsEagle3, SpeculatorsMTP)
}
