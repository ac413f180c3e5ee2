"""Kimi K3's DSpark layout (`"architectures": ["K3DSparkModel"]`), torch-free: vLLM's `K3DSparkConfig`
(`model_type: "k3_dspark"`, a DeepseekV3Config: vllm/transformers_utils/configs/k3_dspark.py) with the
DSpark fields at the top level; vLLM runs it as `K3DSparkForCausalLM` (vllm/models/kimi_k3/nvidia/
dspark_mla.py; registry.py:688-691): dense MLA layers. SGLang and llama.cpp have no reader for it.

Read: `target_layer_ids` (output of layer i: vLLM captures aux layer i + 1, eagle3_utils.py:136-140, and
the K3 target stores layer i's output there, kimi_k3/nvidia/model.py:1178-1189) with `num_target_layers`
their COUNT (the context projection's input is target_hidden_size x num_target_layers, dspark_mla.py:
149-155; k3_dspark.py:69-77 refuses another count); the block from `block_size`, else
`dspark_block_size` (speculative.py:1597-1599); the mask token as vLLM's speculator resolves it
(v1/worker/gpu/spec_decode/utils.py:92-115).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import field_validator

from pipeline.common.schema import Count, Number, Positive, SchemaError
from proposers.toolkit.layout_fields import ArchitectureFields, LayerIds, unique_ids

ARCHITECTURE = "K3DSparkModel"
REQUIRED = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "intermediate_size", "vocab_size", "target_hidden_size", "num_target_layers",
    "target_layer_ids", "markov_rank",
)  # fmt: skip
MASK_KEYS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")
SOURCE = (
    "vLLM's K3DSparkConfig and K3DSparkModel (transformers_utils/configs/k3_dspark.py, kimi_k3/nvidia/dspark_mla.py)"
)


class K3DSpark(ArchitectureFields):
    LAYOUT: ClassVar[str] = "k3"
    CONVENTION: ClassVar[str] = "output"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = (ARCHITECTURE,)
    FAMILY: ClassVar[str] = "dspark"
    DECODER_CLASS: ClassVar[str] = "DeepseekV3Config"

    architectures: list[str]
    model_type: str | None = None
    # the MLA decoder (DeepseekV3Config's names; its defaults fill the rest)
    hidden_size: Positive | None = None
    num_hidden_layers: Positive | None = None
    num_attention_heads: Positive | None = None
    num_key_value_heads: Positive | None = None
    q_lora_rank: Positive | None = None
    kv_lora_rank: Positive | None = None
    qk_nope_head_dim: Positive | None = None
    qk_rope_head_dim: Positive | None = None
    v_head_dim: Positive | None = None
    intermediate_size: Positive | None = None
    hidden_act: str | None = None
    rms_norm_eps: Number | None = None
    vocab_size: Positive | None = None
    max_position_embeddings: Positive | None = None
    rope_theta: Number | None = None  # K3DSparkConfig's default 50000 (k3_dspark.py:16-37)
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool | None = None  # refused when false: vLLM's MLA RoPE is interleaved (mla.py:174-179)
    attention_bias: bool | None = None  # refused when true: vLLM's projections have no bias
    n_routed_experts: Count | None = None  # refused above 0: the draft is dense (k3_dspark.py:22-26)
    n_shared_experts: Count | None = None
    num_experts_per_tok: Count | None = None
    mla_use_nope: bool | None = None  # these four refused when true, as K3DSparkConfig (k3_dspark.py:43-58)
    mla_use_output_gate: bool | None = None
    mla_use_qk_norm: bool | None = None
    dspark_bonus_anchor: bool | None = None
    logit_scale: Number | None = None  # refused unless 1: vLLM scales the draft logits (dspark_mla.py:459-462)
    # the DSpark fields
    target_hidden_size: Positive | None = None
    num_target_layers: Positive | None = None
    target_layer_ids: LayerIds | None = None
    block_size: Positive | None = None
    dspark_block_size: Positive | None = None
    mask_token_id: Count | None = None
    dspark_noise_token_id: Count | None = None
    pard_token: Count | None = None
    ptd_token_id: Count | None = None
    markov_rank: Count | None = None
    enable_confidence_head: bool | None = None  # absent: false (dspark_mla.py:191-201)
    confidence_head_with_markov: bool | None = None
    confidence_threshold: Any = None  # this project's (config.py checks it)
    sample_from_anchor: bool | None = None  # absent: true (spec_decode/dspark/speculator.py:49-51)
    draft_vocab_size: Positive | None = None  # refused unless vocab_size (k3_dspark.py:60-67)

    _unique = field_validator("target_layer_ids")(unique_ids)

    def namespaces(self) -> dict:
        """DeepseekV3Config's keys at the top level (K3DSparkConfig is one), whatever model_type says."""
        return {"": (self.DECODER_CLASS, type(self))}

    @property
    def block(self) -> int | None:
        return self.block_size if self.block_size is not None else self.dspark_block_size

    @property
    def mask(self) -> tuple[str | None, int | None]:
        """(the key, its value) of the first mask token vLLM's speculator reads."""
        return next(((n, getattr(self, n)) for n in MASK_KEYS if getattr(self, n) is not None), (None, None))

    def check_complete(self, source: str) -> None:
        missing = [name for name in REQUIRED if getattr(self, name) is None]
        if self.block is None:
            missing.append("block_size")
        if self.mask[1] is None:
            missing.append("mask_token_id")
        if missing:
            raise SchemaError(f"{source}: missing field {missing[0]!r}; {SOURCE} need it")

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        """target_layer_ids (output of layer i), as many as num_target_layers (k3_dspark.py:69-77); the
        target's last layer is refused (vLLM feeds it before the final norm, specreplay stores it after)."""
        ids = self.target_layer_ids
        if ids is None:
            raise SchemaError(f"{source}: missing field 'target_layer_ids'; the feature layers are unknown")
        if self.num_target_layers is not None and self.num_target_layers != len(ids):
            raise SchemaError(
                f"{source}: field 'num_target_layers' is {self.num_target_layers}: K3's DSpark reads it as the "
                f"COUNT of target_layer_ids ({len(ids)}), and vLLM's K3DSparkConfig refuses another "
                f"(k3_dspark.py:69-77); set {len(ids)}"
            )
        for i in ids:
            if num_target_layers is not None and i >= num_target_layers - 1:
                raise SchemaError(
                    f"{source}: field 'target_layer_ids' lists {i}, "
                    + (
                        f"past the target's {num_target_layers} layers"
                        if i >= num_target_layers
                        else "the target's last layer"
                    )
                    + " (vLLM feeds that layer before the final norm, specreplay stores it after); list layers before it"
                )
        return list(ids)
