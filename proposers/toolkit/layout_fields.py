"""Fields several drafter layouts declare, torch-free: a drafter's decoder layers (Qwen3-style, as
transformers' config classes name them: at the top level of a z-lab config, nested as
`transformer_layer_config` in a speculators one) and feature layer id lists. The fields the replay
reads, and those an engine reads that transformers' config class does not declare, are declared
here; the rest pass through to transformers' config class, which gives what is absent its own
default. A key neither declares is refused by name (proposers/fields/known.py, stage 2), as is a
key a `DrafterNamespace` (`dflash_config`, `eagle_config`, `speculators_config`) does not name
(here, at validation). docs/config-fields.md lists every field, its status and its readers."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator

from pipeline.common.schema import ClosedNamespace, Count, Number, Positive, Schema, SchemaError, wrong

LayerIds = Annotated[list[Count], Field(min_length=1)]
# The refusal of a key specreplay does not know, in a namespace it enumerates and in a decoder's
UNKNOWN_KEY = "is not a field specreplay knows; refusing rather than scoring the drafter as something it is not"


class DrafterNamespace(ClosedNamespace):
    """A drafter config's namespace whose every key (each engine's and trainer's) is declared."""

    UNKNOWN_KEY: ClassVar[str] = UNKNOWN_KEY


def unique_ids(value):
    if value is not None and len(set(value)) != len(value):
        raise ValueError(f"lists a layer twice ({value}); expected each feature layer once")
    return value


class ArchitectureFields(Schema):
    """A layout told apart by one architecture name (the first of ARCHITECTURES) of family FAMILY."""

    ARCHITECTURES: ClassVar[tuple[str, ...]]
    FAMILY: ClassVar[str]

    @field_validator("architectures", check_fields=False)
    @classmethod
    def _named(cls, value):
        if cls.ARCHITECTURES[0] not in value:
            raise wrong(value, f"['{cls.ARCHITECTURES[0]}']")
        return value

    @property
    def family(self) -> str:
        return self.FAMILY

    @property
    def evidence(self) -> str:
        return f"architectures ['{self.ARCHITECTURES[0]}']"


LayerType = Literal["full_attention", "sliding_attention"]
# transformers' activation names (ACT2FN), which the MLP looks its function up by; declared here so
# a typo is refused with the config, not as a KeyError once the model is built (a test checks the
# list against transformers').
Activation = Literal[
    "gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_python_tanh",
    "gelu_pytorch_tanh", "hardswish", "laplace", "leaky_relu", "linear", "mish", "prelu", "quick_gelu",
    "relu", "relu2", "relu6", "sigmoid", "silu", "sqrtsoftplus", "swish", "tanh", "xielu",
]  # fmt: skip


def _a_float(value):
    # transformers' config dataclasses take only a float where they declare one (1 is refused)
    if value is not None and not isinstance(value, float):
        raise wrong(value, "a number with a decimal point or exponent, like 1e-06")
    return value


PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False), BeforeValidator(_a_float)]
Float = Annotated[float, Field(allow_inf_nan=False), BeforeValidator(_a_float)]
# Fields transformers' config classes refuse as null, though absent is fine (their default).
NOT_NULL = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "intermediate_size", "vocab_size",
    "rms_norm_eps", "max_position_embeddings", "use_sliding_window", "attention_bias", "hidden_act",
    "initializer_range", "max_window_layers", "tie_word_embeddings",
)  # fmt: skip


class DecoderFields(Schema):
    model_type: str | None = None
    hidden_size: Positive | None = None
    num_hidden_layers: Positive | None = None
    num_attention_heads: Positive | None = None
    num_key_value_heads: Positive | None = None
    head_dim: Positive | None = None
    intermediate_size: Positive | None = None
    vocab_size: Positive | None = None
    rms_norm_eps: PositiveFloat | None = None
    rope_theta: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    max_position_embeddings: Positive | None = None
    layer_types: Annotated[list[LayerType], Field(min_length=1)] | None = None
    sliding_window: Positive | None = None
    use_sliding_window: bool | None = None
    attention_bias: bool | None = None
    hidden_act: Activation | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    initializer_range: Float | None = None
    max_window_layers: Count | None = None
    tie_word_embeddings: bool | None = None

    @field_validator(*NOT_NULL, mode="before")
    @classmethod
    def _not_null(cls, value):
        if value is None:  # absent takes the config class's default; an explicit null is refused there
            raise ValueError("is null; leave it out for the default, or give a value")
        return value

    @field_validator("layer_types")
    @classmethod
    def _one_type_per_layer(cls, value, info: ValidationInfo):
        layers = info.data.get("num_hidden_layers")
        if value is not None and layers is not None and len(value) != layers:
            raise ValueError(f"has {len(value)} entries for num_hidden_layers {layers}; expected one per layer")
        return value

    # transformers' config class the reference builds from this namespace (by name: torch-free)
    DECODER_CLASS: ClassVar[str] = "Qwen3Config"

    def namespaces(self) -> dict[str, tuple[str | None, type[Schema]]]:
        """Each namespace of the file that is a transformers config ('' the top level): the name
        of transformers' class whose attributes it may hold beside what `schema` declares, None
        when another check refuses the namespace by name (its model_type). Keys neither knows are
        refused by name (proposers/fields/known.py)."""
        kind = self.model_type
        return {"": (self.DECODER_CLASS if kind in (None, "qwen3") else None, type(self))}

    def require(self, names: tuple[str, ...], where: str = "") -> list[str]:
        """The names among `names` this config leaves unset (to refuse a file that is not a drafter's)."""
        return [f"{where}{name}" for name in names if getattr(self, name) is None]


class DraftDecoderFields(DecoderFields):
    """A drafter's own decoder (block drafters, EAGLE-3) with the keys an engine reads there that
    transformers' Qwen3Config / LlamaConfig do not declare."""

    partial_rotary_factor: Number | None = None  # refused unless 1: engines rotate part of each head
    logit_scale: Number | None = None  # refused unless 1: vLLM scales the draft logits


class BlockDecoderFields(DraftDecoderFields):
    """The decoder of a block drafter (DFlash, DFlash2, DSpark) with the keys the engines' DFlash
    layers read beside transformers' Qwen3Config ones (vLLM qwen3_dflash.py, sglang dflash.py,
    llama.cpp conversion/qwen.py)."""

    is_causal: bool | None = None  # every layer causal (or not) inside the block
    is_neox_style: bool | None = None  # refused when false: interleaved RoPE
    rope_is_neox_style: bool | None = None  # the same, as llama.cpp and sglang spell it
    use_gemma_norm: bool | None = None  # refused when true: sglang's (1 + w) norms


# Fields every drafter config states: without them the file is not a drafter's config.json.
REQUIRED_SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


class EagleOptions(DrafterNamespace):
    """`eagle_config`: which target layers feed `fc`, and whether any do (sglang and vLLM read
    `norm_before_fc` here first, then at the top level)."""

    eagle_aux_hidden_state_layer_ids: LayerIds | None = None
    use_aux_hidden_state: bool = True
    norm_before_fc: bool | None = None  # refused when true: SpecForge never trains it

    _unique = field_validator("eagle_aux_hidden_state_layer_ids")(unique_ids)


class SpecForgeEagleFields(ArchitectureFields, DraftDecoderFields):
    """What SpecForge's EAGLE-style configs share (EAGLE-3's `LlamaForCausalLMEagle3`, P-EAGLE's
    `PEagleDraftModel`): the draft decoder's LlamaConfig at the top level, `draft_vocab_size`
    beside it, the feature ids in `eagle_config`, and the keys an engine reads that SpecForge's
    trainer never writes. A subclass names its `ARCHITECTURES` (the first is the one it says) and
    `FAMILY`, and reads the ids in its own convention (`feature_layers`)."""

    LAYOUT: ClassVar[str] = "specforge"
    IDS_FIELD: ClassVar[str] = "eagle_config.eagle_aux_hidden_state_layer_ids"
    DECODER_CLASS: ClassVar[str] = "LlamaConfig"

    architectures: list[str]
    draft_vocab_size: Positive | None = None
    target_hidden_size: Positive | None = None
    eagle_config: EagleOptions | None = None
    num_speculative_tokens: Positive | None = None  # this project's: the engines take it from their flags
    norm_before_fc: bool | None = None
    num_aux_hidden_states: Positive | None = None
    target_model_type: str | None = None  # which target SpecForge trains against: training-only
    decoder_sparse_step: Any = None  # copied from a MoE target's config; no Llama layer reads it

    def namespaces(self) -> dict:
        """LlamaConfig's keys whatever model_type says: SpecForge's EAGLE-style drafters are Llama layers."""
        return {"": (self.DECODER_CLASS, type(self))}

    @property
    def options(self) -> EagleOptions:
        return self.eagle_config or EagleOptions()

    def check_complete(self, source: str) -> None:
        """What SpecForge's model class reads without a default."""
        missing = self.require(REQUIRED_SHAPE) + self.require(("draft_vocab_size",))
        if missing:
            raise SchemaError(f"{source}: missing field {missing[0]!r}; SpecForge's {self.ARCHITECTURES[0]} needs it")

    def stored_layer_ids(self) -> list[int] | None:
        return self.options.eagle_aux_hidden_state_layer_ids
