"""Fields several drafter layouts declare, torch-free: a drafter's decoder layers (Qwen3-style, as
transformers' config classes name them: at the top level of a z-lab config, nested as
`transformer_layer_config` in a speculators one) and feature layer id lists. Only the fields the
replay reads are declared; the rest pass through to transformers' config class, which gives what
is absent its own default."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator

from pipeline.common.schema import Count, Positive, Schema, wrong

LayerIds = Annotated[list[Count], Field(min_length=1)]


def unique_ids(value):
    if value is not None and len(set(value)) != len(value):
        raise ValueError(f"lists a layer twice ({value}); expected each feature layer once")
    return value


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

    def require(self, names: tuple[str, ...], where: str = "") -> list[str]:
        """The names among `names` this config leaves unset (to refuse a file that is not a drafter's)."""
        return [f"{where}{name}" for name in names if getattr(self, name) is None]


# Fields every drafter config states: without them the file is not a drafter's config.json.
REQUIRED_SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
