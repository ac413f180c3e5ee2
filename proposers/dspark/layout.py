"""The DSpark family's config layouts, torch-free:

* speculators (`speculators_model_type: "dspark"`): the block fields every speculators block
  drafter has (proposers/toolkit/speculators_layout.py), `sample_from_anchor` true by default, and
  the heads' fields;

* SpecForge (`"architectures": ["DSparkDraftModel"]`, `dflash_config.projector_type: "dspark"`): a
  z-lab-style Qwen3 config whose DSpark fields all sit in `dflash_config`, read there only
  (SpecForge specforge/modeling/draft/dflash.py:355-375, dspark.py:254-364); `block_size` and
  `num_target_layers` at the top level. Layer ids count the output of layer i.
* DeepSpec (`"architectures": ["Qwen3DSparkModel"]`): a copy of the TARGET's config with the draft
  fields at the top level (DeepSpec deepspec/modeling/dspark/qwen3/config.py:9-56). Layer ids count
  the output of layer i, -1 being the embedding output (deepspec/modeling/dspark/common.py:52-75).
* DeepSpec's Gemma 4 (`"architectures": ["Gemma4DSparkModel"]`): gemma4_layout.py.
* DeepSeek-V4's (`"architectures": ["DeepseekV4DSparkModel"]`): dsv4_layout.py.
* vLLM's Qwen3-Omni (`"architectures": ["Qwen3OmniDSparkModel"]`): omni_layout.py.
* Kimi K3's (`"architectures": ["K3DSparkModel"]`): k3_layout.py.

Both resolve their head settings to `DSparkHeads`, with the defaults each reference applies. A
`confidence_threshold` field is this project's, not the references': DeepSpec takes the threshold
from its evaluator's `--confidence-threshold` flag (eval.py:36-41, default 0 = never cut), and no
config of any layout carries one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from pipeline.common.layer_ids import build_target_layer_ids
from pipeline.common.schema import LARGEST, Count, Number, Positive, SchemaError, wrong
from proposers.dspark.dsv4_layout import DeepseekV4DSpark
from proposers.dspark.gemma4_layout import DeepSpecGemma4DSpark
from proposers.dspark.k3_layout import K3DSpark
from proposers.dspark.omni_layout import Qwen3OmniDSpark
from proposers.toolkit.layout_fields import REQUIRED_SHAPE, BlockDecoderFields, DrafterNamespace, LayerIds, unique_ids
from proposers.toolkit.speculators_layout import SpeculatorsBlock

LABEL = "DSpark"
HEAD_TYPES = ("vanilla", "gated", "rnn")
# DeepSpec's ids: the output of layer i, or -1 for the embedding output
DeepSpecIds = Annotated[list[Annotated[int, Field(ge=-1, le=LARGEST)]], Field(min_length=1)]
Threshold = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]


@dataclass(frozen=True)
class DSparkHeads:
    """The Markov and confidence heads a DSpark config describes, resolved with its layout's defaults."""

    markov_rank: int  # 0: no Markov head
    markov_head_type: str | None  # vanilla, gated or rnn; None without a Markov head
    confidence_head: bool
    confidence_head_with_markov: bool  # the head reads [h ; W1[prev]]; False without a confidence head
    confidence_threshold: float  # cut a proposal at the first slot whose sigmoid(confidence) is below; 0: never


def head_type(value):
    """As SpecForge's and DeepSpec's build_markov_head: lower-cased, one of HEAD_TYPES."""
    if value is None:
        return value
    if value.lower() not in HEAD_TYPES:
        raise wrong(value, f"one of {', '.join(map(repr, HEAD_TYPES))}")
    return value.lower()


def resolve_heads(rank, kind, confidence, with_markov, threshold, where: str, reference: str, source: str):
    """DSparkHeads from resolved values; refuses a confidence head over a missing Markov head
    as the reference does (`where` prefixes the field names in the message)."""
    if with_markov and rank == 0:
        raise SchemaError(
            f"{source}: field '{where}confidence_head_with_markov' is true but '{where}markov_rank' is 0: the "
            f"confidence head reads the Markov head's embedding of the previous token, and {reference} refuses "
            f"it without one; set {where}confidence_head_with_markov false or {where}markov_rank > 0"
        )
    return DSparkHeads(
        markov_rank=rank,
        markov_head_type=kind if rank > 0 else None,
        confidence_head=confidence,
        confidence_head_with_markov=confidence and with_markov,
        confidence_threshold=float(threshold or 0.0),
    )


class SpecForgeOptions(DrafterNamespace):
    """`dflash_config` of a SpecForge DSpark drafter (its DSparkDraftModel reads them there only)."""

    projector_type: Literal["dspark"]
    mask_token_id: Count | None = None
    target_layer_ids: LayerIds | None = None
    markov_rank: Count | None = None  # absent or null: 0 (no Markov head)
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool | None = None  # absent: confidence_head_alpha > 0
    confidence_head_alpha: Number | None = None
    confidence_head_with_markov: bool | None = None
    attention_mode: str = "gqa"
    confidence_threshold: Threshold | None = None
    shift_label: Any = None  # SpecForge's DFlashDraftModel reads these two for training only
    pure_draft_prefix_len: Any = None

    _unique = field_validator("target_layer_ids")(unique_ids)
    _head_type = field_validator("markov_head_type")(head_type)

    @field_validator("attention_mode")
    @classmethod
    def _attention_mode(cls, value):
        if value.lower() not in ("gqa", "mha"):
            raise wrong(value, "'gqa' or 'mha'")
        return value.lower()


class SpeculatorsDSpark(SpeculatorsBlock):
    FAMILY: ClassVar[str] = "dspark"

    speculators_model_type: Literal["dspark"]
    sample_from_anchor: bool = True
    markov_rank: Count = 256
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    use_aux_hidden_state: bool | None = None  # vLLM forwards it; refused when false
    confidence_threshold: Any = None  # this project's (config.py checks it): cut proposals below it


class SpecForgeDSpark(BlockDecoderFields):
    LAYOUT: ClassVar[str] = "specforge"
    CONVENTION: ClassVar[str] = "output"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("DSparkDraftModel",)  # speculators' saves carry it too

    architectures: list[str] | None = None
    num_target_layers: Positive | None = None
    block_size: Positive | None = None
    sample_from_anchor: bool | None = None  # every engine reads absent as true
    target_hidden_size: Positive | None = None  # vLLM's fc width; refused unless hidden_size
    dflash_config: SpecForgeOptions

    @property
    def family(self) -> str:
        return "dspark"

    @property
    def evidence(self) -> str:
        return "dflash_config.projector_type 'dspark'"

    def check_complete(self, source: str) -> None:
        missing = self.require(REQUIRED_SHAPE) + self.require(("block_size",))
        if self.dflash_config.mask_token_id is None:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise SchemaError(f"{source}: missing field {missing[0]!r}; SpecForge's DSparkDraftModel needs it")

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        """dflash_config.target_layer_ids (output of layer i), else SpecForge's default formula
        over num_target_layers (the config's, else the target's when the caller has it)."""
        ids = self.dflash_config.target_layer_ids
        if ids is not None:
            return list(ids)
        layers = self.num_target_layers or num_target_layers
        if layers is None or self.num_hidden_layers is None:
            raise SchemaError(
                f"{source}: neither dflash_config.target_layer_ids nor num_target_layers and num_hidden_layers "
                f"are set, so the feature layers are unknown"
            )
        return build_target_layer_ids(layers, self.num_hidden_layers)

    def heads(self, source: str) -> DSparkHeads:
        """SpecForge's defaults: no Markov head, a confidence head iff confidence_head_alpha > 0."""
        options = self.dflash_config
        alpha = options.confidence_head_alpha or 0.0
        if "enable_confidence_head" in options.model_fields_set:
            confidence = bool(options.enable_confidence_head)
        else:
            confidence = alpha > 0.0
        return resolve_heads(
            options.markov_rank or 0,
            options.markov_head_type,
            confidence,
            bool(options.confidence_head_with_markov),
            options.confidence_threshold,
            "dflash_config.",
            "SpecForge's DSparkDraftModel",
            source,
        )


class DeepSpecDSpark(BlockDecoderFields):
    LAYOUT: ClassVar[str] = "deepspec"
    CONVENTION: ClassVar[str] = "output"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("Qwen3DSparkModel",)

    architectures: list[str]
    num_target_layers: Positive | None = None
    block_size: Positive | None = None
    mask_token_id: Count | None = None
    target_layer_ids: DeepSpecIds
    num_anchors: Positive | None = None
    enable_confidence_head: bool | None = None
    confidence_head_with_markov: bool | None = None
    markov_rank: Count | None = None
    markov_head_type: str | None = None
    confidence_threshold: Threshold | None = None
    sample_from_anchor: bool | None = None  # every engine reads absent as true

    _unique = field_validator("target_layer_ids")(unique_ids)
    _head_type = field_validator("markov_head_type")(head_type)

    @field_validator("architectures")
    @classmethod
    def _qwen3(cls, value):
        if "Qwen3DSparkModel" not in value:
            raise wrong(value, "['Qwen3DSparkModel'] (specreplay reads DeepSpec's Qwen3 DSpark drafters)")
        return value

    @property
    def family(self) -> str:
        return "dspark"

    @property
    def evidence(self) -> str:
        return "architectures ['Qwen3DSparkModel']"

    def check_complete(self, source: str) -> None:
        """What DeepSpec's Qwen3DSparkModel asserts present (qwen3/modeling.py:207-224, 247)."""
        missing = self.require(REQUIRED_SHAPE)
        missing += self.require(("block_size", "mask_token_id", "num_anchors", "enable_confidence_head", "markov_rank"))
        if self.markov_rank and self.markov_head_type is None:
            missing.append("markov_head_type")
        if self.enable_confidence_head and self.confidence_head_with_markov is None:
            missing.append("confidence_head_with_markov")
        if missing:
            raise SchemaError(f"{source}: missing field {missing[0]!r}; DeepSpec's Qwen3DSparkModel requires it")

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        """target_layer_ids, already in this project's convention; -1 (the embedding output) and
        the target's last layer (which DeepSpec's evaluator refuses) are refused."""
        layers = self.num_target_layers or num_target_layers
        for i in self.target_layer_ids:
            if i == -1:
                raise SchemaError(
                    f"{source}: field 'target_layer_ids' lists -1, DeepSpec's embedding output, which specreplay "
                    f"does not store; only decoder layer outputs (ids 0 and up) can be scored"
                )
            if layers is not None and i >= layers:
                raise SchemaError(
                    f"{source}: field 'target_layer_ids' lists {i}, past the target's {layers} layers "
                    f"(ids count from 0)"
                )
            if layers is not None and i == layers - 1:
                raise SchemaError(
                    f"{source}: field 'target_layer_ids' lists {i}, the target's last layer, which DeepSpec's "
                    f"evaluator refuses (its cache holds that layer before the final norm, transformers after)"
                )
        return list(self.target_layer_ids)

    def heads(self, source: str) -> DSparkHeads:
        confidence = bool(self.enable_confidence_head)
        with_markov = confidence and bool(self.confidence_head_with_markov)
        return resolve_heads(
            self.markov_rank or 0,
            self.markov_head_type,
            confidence,
            with_markov,
            self.confidence_threshold,
            "",
            "DeepSpec's Qwen3DSparkModel",
            source,
        )


LAYOUTS = (
    SpeculatorsDSpark,
    SpecForgeDSpark,
    DeepSpecDSpark,
    DeepSpecGemma4DSpark,
    DeepseekV4DSpark,
    Qwen3OmniDSpark,
    K3DSpark,
)
