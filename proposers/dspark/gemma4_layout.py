"""DeepSpec's Gemma 4 DSpark layout (`"architectures": ["Gemma4DSparkModel"]`), torch-free: a Gemma 4
text config (transformers' Gemma4TextConfig fields) with the DSpark fields at the top level, the
mask token and feature layers also in `dflash_config` (llama.cpp reads `dflash_config` first,
conversion/gemma.py:846-852, 866-868; vLLM the top level, gemma4_dspark.py:150-152). Layer ids
count the output of layer i, as the Qwen 3 DeepSpec layout's.

What both engines refuse or do not run is refused by name here or in gemma4.py: what llama.cpp's
converter refuses (conversion/gemma.py:819-872: no `attention_k_eq_v`, a sliding layer, another
activation, attention bias, MoE, a reduced vocabulary, a non-vanilla Markov head, RoPE other than
default or proportional, missing `mask_token_id` or `target_layer_ids`, logit soft-capping), and what
vLLM reads otherwise (an attention logit soft-cap, kv-shared layers).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import field_validator

from pipeline.common.schema import Count, Number, Positive, SchemaError
from proposers.toolkit.layout_fields import REQUIRED_SHAPE, ArchitectureFields, DrafterNamespace, LayerIds, unique_ids

ARCHITECTURE = "Gemma4DSparkModel"


class Gemma4DSparkOptions(DrafterNamespace):
    """`dflash_config` of a Gemma 4 DSpark drafter: what llama.cpp's converter reads there first."""

    mask_token_id: Count | None = None
    target_layer_ids: LayerIds | None = None
    markov_head_type: str | None = None
    use_swa: bool | None = None  # refused when true: a window neither engine's Gemma 4 DSpark runs alike
    swa_window_size: Positive | None = None

    _unique = field_validator("target_layer_ids")(unique_ids)


class DeepSpecGemma4DSpark(ArchitectureFields):
    LAYOUT: ClassVar[str] = "deepspec"
    CONVENTION: ClassVar[str] = "output"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = (ARCHITECTURE,)
    FAMILY: ClassVar[str] = "dspark"
    DECODER_CLASS: ClassVar[str] = "Gemma4TextConfig"

    architectures: list[str]
    model_type: str | None = None
    # the Gemma 4 decoder (Gemma4TextConfig's; its defaults fill the rest)
    hidden_size: Positive | None = None
    num_hidden_layers: Positive | None = None
    num_attention_heads: Positive | None = None
    intermediate_size: Positive | None = None
    vocab_size: Positive | None = None
    global_head_dim: Positive | None = None
    num_global_key_value_heads: Positive | None = None
    layer_types: list[str] | None = None
    attention_k_eq_v: bool | None = None
    hidden_activation: str | None = None
    attention_bias: bool | None = None
    enable_moe_block: bool | None = None
    final_logit_softcapping: Number | None = None
    attn_logit_softcapping: Number | None = None
    num_kv_shared_layers: Count | None = None
    rope_parameters: dict[str, Any] | None = None
    tie_word_embeddings: bool | None = None
    # the DSpark fields
    num_target_layers: Positive | None = None
    block_size: Positive | None = None
    mask_token_id: Count | None = None
    target_layer_ids: LayerIds | None = None
    num_anchors: Positive | None = None
    markov_rank: Count | None = None
    markov_head_type: str | None = None
    enable_confidence_head: bool | None = None
    confidence_head_with_markov: bool | None = None
    confidence_threshold: Number | None = None
    sample_from_anchor: bool | None = None
    draft_vocab_size: Positive | None = None
    is_causal: bool | None = None
    dflash_config: Gemma4DSparkOptions | None = None

    _unique = field_validator("target_layer_ids")(unique_ids)

    def namespaces(self) -> dict:
        """Gemma4TextConfig's keys at the top level, whatever model_type says."""
        return {"": (self.DECODER_CLASS, type(self))}

    def option(self, name: str, source: str = "config"):
        """`dflash_config.<name>` when set, else the top level's (llama.cpp's order); both set and
        different is refused, as vLLM reads only the top level."""
        nested = None if self.dflash_config is None else getattr(self.dflash_config, name)
        top = getattr(self, name)
        if nested is not None and top is not None and nested != top:
            raise SchemaError(
                f"{source}: field 'dflash_config.{name}' is {nested!r}: llama.cpp reads it, vLLM the top-level "
                f"'{name}' ({top!r}); give one value"
            )
        return top if nested is None else nested

    def check_complete(self, source: str) -> None:
        """What llama.cpp's converter and vLLM's Gemma4DSparkModel need present."""
        missing = [name for name in REQUIRED_SHAPE if getattr(self, name) is None]
        missing += [
            n for n in ("global_head_dim", "num_global_key_value_heads", "block_size") if getattr(self, n) is None
        ]
        missing += [n for n in ("mask_token_id", "target_layer_ids") if self.option(n, source) is None]
        if not self.markov_rank:
            missing.append("markov_rank")
        if missing:
            raise SchemaError(
                f"{source}: missing field {missing[0]!r}; llama.cpp's converter and vLLM's Gemma4DSparkModel "
                f"need it (conversion/gemma.py:846-868, vllm gemma4_dspark.py:150-190)"
            )

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        """target_layer_ids (output of layer i); the target's last layer is refused (llama.cpp reads
        layer inputs, and the Gemma 4 graph records none after its last layer: src/models/gemma4.cpp:196)."""
        ids = self.option("target_layer_ids", source)
        if ids is None:
            raise SchemaError(f"{source}: missing field 'target_layer_ids'; the feature layers are unknown")
        layers = self.num_target_layers or num_target_layers
        for i in ids:
            if layers is not None and i >= layers - 1:
                raise SchemaError(
                    f"{source}: field 'target_layer_ids' lists {i}, "
                    + (f"past the target's {layers} layers" if i >= layers else "the target's last layer")
                    + " (llama-server feeds the input of layer i + 1, which the target's last layer has none of); "
                    "list layers before it"
                )
        return list(ids)


def head_type_of(checked: DeepSpecGemma4DSpark) -> Literal["vanilla"] | str:
    """The Markov head type (dflash_config first), lower-cased; absent: vanilla (llama.cpp's default)."""
    kind = checked.option("markov_head_type")
    return "vanilla" if kind is None else kind.lower()
