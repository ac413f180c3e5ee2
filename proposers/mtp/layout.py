"""The MTP family's config layouts, torch-free: speculators' MTP export (`speculators_model_type:
"mtp"`, `SpeculatorsMTP`), and a target's own config.json (`NativeMTP`): Qwen3-Next (`model_type: "qwen3_next"`)
and Qwen3.5 (`"qwen3_5"`, the decoder's fields in `text_config`, or a bare `"qwen3_5_text"`)
checkpoints carry a native multi-token-prediction head (`mtp.*` tensors) beside the target's
weights; `score --ckpt <target dir>` scores it (proposers/mtp/config.py). The head reads the
target's final hidden state before the final norm, this project's id L (layer_ids.final_prenorm_id),
with the norm's weight from the target head. GLM-4.5 (`"glm4_moe"`, `NativeNextN`) and DeepSeek-V3
(`"deepseek_v3"`) carry DeepSeek-style NextN heads instead, `model.layers.{num_hidden_layers + i}.*` (proposers/mtp/nextn.py). Qwen3.5-MoE (`"qwen3_5_moe"`, `"qwen3_5_moe_text"`)
and a Qwen3-Next whose config makes the MTP layer MoE give it a sparse MoE MLP; its expert fields
are declared here (`MoeKeys`) so that a type error in one is one line naming it."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pipeline.common.layer_ids import final_prenorm_id
from pipeline.common.schema import Count, Positive, Schema, SchemaError
from proposers.toolkit.layout_fields import DecoderFields
from proposers.toolkit.speculators_layout import SpeculatorsFormat

LABEL = "MTP"

# the target kinds whose checkpoints hold `mtp.*` heads, by config.json model_type
MTP_TARGET_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# transformers' config class of each kind (by name: torch-free), and of its text_config when it nests one
CONFIG_CLASSES = {
    "qwen3_next": ("Qwen3NextConfig", None),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5TextConfig"),
    "qwen3_5_text": ("Qwen3_5TextConfig", None),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeTextConfig"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", None),
}

# targets whose checkpoints hold DeepSeek-style NextN heads (`model.layers.{L + i}.*`), by model_type
NEXTN_TARGET_TYPES = ("glm4_moe", "deepseek_v3")
NEXTN_CONFIG_CLASSES = {"glm4_moe": "Glm4MoeConfig", "deepseek_v3": "DeepseekV3Config"}


class MoeKeys(Schema):
    """The expert fields of an MoE text config (Qwen3-Next's, Qwen3.5-MoE's; docs/config-fields.md),
    typed. Whether the MTP layer is MoE is decided from the resolved config (decoder_rules.
    mtp_layer_is_moe); a dense kind's MLP stays dense whatever these say, as in every engine."""

    num_experts: Count | None = None  # routed experts (Qwen3-Next: 0 makes every layer dense)
    num_experts_per_tok: Positive | None = None  # top-k
    moe_intermediate_size: Positive | None = None  # each routed expert's width
    shared_expert_intermediate_size: Count | None = None  # refused at 0: vLLM then builds no shared expert
    norm_topk_prob: bool | None = None  # Qwen3-Next: implemented; Qwen3.5-MoE: refused when false
    decoder_sparse_step: Positive | None = None  # Qwen3-Next: with mlp_only_layers, which layers are MoE
    mlp_only_layers: list[Count] | None = None
    router_aux_loss_coef: float | None = None  # the load-balancing loss of training: bookkeeping
    output_router_logits: bool | None = None  # training-time outputs: bookkeeping


class MtpKeys(MoeKeys):
    """Keys of a Qwen3.5 / Qwen3-Next text config that an engine reads for the MTP head (or that
    real checkpoints carry) and transformers' config classes do not declare (docs/config-fields.md)."""

    mtp_num_hidden_layers: Count | None = None  # refused above 1: vLLM cycles steps through the layers
    num_nextn_predict_layers: Count | None = None  # Qwen3-Next's name for it
    mtp_use_dedicated_embeddings: bool | None = None  # refused when true: the head's own embedding
    attn_output_gate: bool | None = None  # refused when false: specreplay's MTP attention is gated
    layer_scale: bool | None = None  # refused when true: vLLM's per-layer residual scales
    qkv_bias: bool | None = None  # refused when true: vLLM's q/k/v bias
    mamba_ssm_dtype: Any = None  # the target's linear-attention layers: bookkeeping
    full_attention_interval: Any = None  # transformers derives the target's layer_types from it


class TextFields(MtpKeys):
    model_type: str | None = None
    num_hidden_layers: Positive | None = None


class MtpDecoderFields(DecoderFields, MtpKeys):
    """speculators' `transformer_layer_config` of an MTP export: the verifier's text config."""


class NativeMTP(MtpKeys):
    LAYOUT: ClassVar[str] = "native"
    CONVENTION: ClassVar[str] = "output"
    MODEL_TYPES: ClassVar[tuple[str, ...]] = MTP_TARGET_TYPES  # detected by model_type, not an architecture

    model_type: Literal[MTP_TARGET_TYPES]
    num_hidden_layers: Positive | None = None
    text_config: TextFields | None = None

    def namespaces(self) -> dict:
        """The top level and, for a wrapper, `text_config`, each with transformers' class of its kind."""
        top, text = CONFIG_CLASSES[self.model_type]
        found = {"": (top, type(self))}
        if text is not None:
            found["text_config"] = (text, TextFields)
        return found

    @property
    def family(self) -> str:
        return "mtp"

    @property
    def evidence(self) -> str:
        return f"a target's config.json, model_type {self.model_type!r}"

    @property
    def layers(self) -> int | None:
        """The target's decoder layer count (text_config's for a Qwen3.5 wrapper)."""
        nested = self.text_config.num_hidden_layers if self.text_config is not None else None
        return nested or self.num_hidden_layers

    def check_complete(self, source: str) -> None:
        if self.layers is None:
            raise SchemaError(f"{source}: missing field 'num_hidden_layers'; is this the target's config.json?")

    def stored_layer_ids(self) -> list[int]:
        return [final_prenorm_id(self.layers)] if self.layers else []

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        """Id L: the final hidden state before the norm, of the target the config describes."""
        self.check_complete(source)
        return [final_prenorm_id(num_target_layers or self.layers)]


class SpeculatorsMTP(SpeculatorsFormat):
    """speculators' MTP export (models/mtp/config.py): `transformer_layer_config` is the verifier's
    own decoder config, and the head reads its final hidden state before the norm (its
    `target_layer_ids` is [num_hidden_layers], a before-layer id L: this project's id L)."""

    FAMILY: ClassVar[str] = "mtp"
    DECODER_CLASSES: ClassVar[dict[str | None, str]] = {
        kind: CONFIG_CLASSES[kind][1] or CONFIG_CLASSES[kind][0] for kind in MTP_TARGET_TYPES
    }

    speculators_model_type: Literal["mtp"]
    transformer_layer_config: MtpDecoderFields
    num_nextn_predict_layers: Literal[1] = 1

    def stored_layer_ids(self) -> list[int] | None:
        layers = self.decoder.num_hidden_layers
        return None if layers is None else [layers]

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        layers = num_target_layers or self.decoder.num_hidden_layers
        if layers is None:
            raise SchemaError(f"{source}: missing field 'transformer_layer_config.num_hidden_layers'")
        return [layers]


class TargetHeadFields(Schema):
    """What every head kept in its target's own checkpoint shares (NextN, MiMo's): the family, the
    evidence naming the model_type and where the heads are (HEADS_AT), and NativeMTP's layer reading."""

    HEADS_AT: ClassVar[str]

    @property
    def family(self) -> str:
        return "mtp"

    @property
    def evidence(self) -> str:
        return f"a target's config.json, model_type {self.model_type!r} ({self.HEADS_AT})"

    @property
    def layers(self) -> int | None:
        return self.num_hidden_layers

    check_complete = NativeMTP.check_complete
    stored_layer_ids = NativeMTP.stored_layer_ids
    feature_layers = NativeMTP.feature_layers


class NativeNextN(TargetHeadFields):
    """A GLM-4.5 or DeepSeek-V3 target's own config.json (transformers' Glm4MoeConfig,
    DeepseekV3Config): its NextN head is `model.layers.{num_hidden_layers}.*` in the target's
    checkpoint (proposers/mtp/nextn.py). Only the keys the head's rule reads are typed here; the rest
    are the config class's (fields/known.py)."""

    LAYOUT: ClassVar[str] = "nextn"
    HEADS_AT: ClassVar[str] = "NextN head"
    CONVENTION: ClassVar[str] = "output"
    MODEL_TYPES: ClassVar[tuple[str, ...]] = NEXTN_TARGET_TYPES

    model_type: Literal[NEXTN_TARGET_TYPES]
    num_hidden_layers: Positive | None = None
    num_nextn_predict_layers: Count | None = None  # 0 or absent: no head; above 1 refused (config.py)
    head_dim: Positive | None = None  # GLM-4.5's config.json states it; transformers 5.25's class does not declare it
    n_routed_experts: Positive | None = None
    n_shared_experts: Count | None = None
    first_k_dense_replace: Count | None = None
    n_group: Positive | None = None
    topk_group: Positive | None = None
    # DeepSeek-V3's config.json states these; transformers 5.25's DeepseekV3Config does not declare them
    moe_layer_freq: Positive | None = None  # refused other than 1 (decoder_rules.check_nextn_decoder)
    scoring_func: str | None = None  # refused other than "sigmoid"
    topk_method: str | None = None  # refused other than "noaux_tc"
    ep_size: Positive | None = None  # expert parallelism of training and serving: bookkeeping
    qk_head_dim: Positive | None = None  # transformers' save_pretrained writes it: qk_nope + qk_rope, derived
    quantization_config: dict | None = None  # refused: quantized weights

    def namespaces(self) -> dict:
        return {"": (NEXTN_CONFIG_CLASSES[self.model_type], type(self))}


# MiMo-V2-Flash: three chained MTP heads `model.mtp.layers.{0,1,2}.*` (proposers/mtp/mimo.py)
MIMO_TARGET_TYPES = ("mimo_v2_flash",)
MIMO_HEADS = 3  # the converter's count when the config states none (conversion/mimo.py:22-24)


class NativeMimo(TargetHeadFields):
    """A MiMo-V2-Flash target's own config.json (transformers' MiMoV2FlashConfig, plus the keys the
    released config.json states and vLLM's mimo_v2_mtp.py and llama.cpp's conversion/mimo.py read):
    its MTP heads are `model.mtp.layers.{i}.*`, each a sliding-window attention layer of the `swa_*`
    shapes with a dense MLP (proposers/mtp/mimo.py). Typed here: what the heads' rule reads."""

    LAYOUT: ClassVar[str] = "mimo"
    HEADS_AT: ClassVar[str] = "MTP heads model.mtp.layers.*"
    CONVENTION: ClassVar[str] = "output"
    MODEL_TYPES: ClassVar[tuple[str, ...]] = MIMO_TARGET_TYPES

    model_type: Literal[MIMO_TARGET_TYPES]
    num_hidden_layers: Positive | None = None
    num_nextn_predict_layers: Positive | None = None  # absent: 3, the converter's count; vLLM reads head 0 only
    swa_num_attention_heads: Positive | None = None  # the heads' attention (vLLM mimo_v2_mtp.py:91-94)
    swa_num_key_value_heads: Positive | None = None
    swa_head_dim: Positive | None = None
    swa_v_head_dim: Positive | None = None
    swa_rope_theta: float | None = None
    sliding_window_size: int | None = None  # vLLM's window of the heads (-1: none)
    add_swa_attention_sink_bias: bool | None = None  # the heads' per-head sink logit
    add_full_attention_sink_bias: bool | None = None  # the target's full-attention layers: bookkeeping
    layernorm_epsilon: float | None = None  # every norm of the heads
    partial_rotary_factor: float | None = None
    rope_theta: float | None = None  # the target's full-attention layers: bookkeeping
    hybrid_layer_pattern: list[Count] | None = None  # the target's layer kinds (transformers: layer_types)
    moe_layer_freq: list[Count] | None = None  # the target's MLP kinds (transformers: mlp_layer_types)
    topk_method: str | None = None  # the target's router: bookkeeping
    scoring_func: str | None = None  # the target's router: bookkeeping
    attention_chunk_size: int | None = None  # vLLM strips it (model_arch_config_convertor.py:598-607)
    attention_projection_layout: str | None = None  # vLLM reads it for quantized fused q/k/v only: bookkeeping
    moe_router_dtype: str | None = None  # the target's router: bookkeeping
    quantization_config: dict | None = None  # refused: quantized weights

    def namespaces(self) -> dict:
        return {"": ("MiMoV2FlashConfig", type(self))}


# DeepSeek-V4: one MTP head `mtp.0.*` on the target's last layer's hyper-connection streams (proposers/mtp/dsv4.py);
# DeepSeek-V4.1 ships DSpark stages under `mtp.*` instead (read as DeepseekV4DSparkModel), refused by name
DSV4_TARGET_TYPES = ("deepseek_v4", "deepseek_v41")


class NativeDSV4(TargetHeadFields):
    """A DeepSeek-V4 target's own config.json (transformers' DeepseekV4Config, whose keys are DeepSeek's):
    its MTP head is `mtp.0.*` in the target's checkpoint, one DeepSeek-V4 block on the target's last
    layer's streams (proposers/mtp/dsv4.py). Typed here: what the head's rule reads or refuses
    (proposers/mtp/dsv4_rules.py); the rest are DeepseekV4Config's (fields/known.py)."""

    LAYOUT: ClassVar[str] = "deepseek-v4"
    HEADS_AT: ClassVar[str] = "MTP head mtp.0.*"
    CONVENTION: ClassVar[str] = "output"
    MODEL_TYPES: ClassVar[tuple[str, ...]] = DSV4_TARGET_TYPES

    model_type: Literal[DSV4_TARGET_TYPES]
    num_hidden_layers: Positive | None = None
    num_nextn_predict_layers: Count | None = None  # absent: DeepseekV4Config's 1; 0 no head; above 1 refused
    hidden_size: Positive | None = None
    num_attention_heads: Positive | None = None
    num_key_value_heads: Positive | None = None  # refused other than 1
    head_dim: Positive | None = None
    q_lora_rank: Positive | None = None
    qk_rope_head_dim: Positive | None = None
    o_groups: Positive | None = None
    o_lora_rank: Positive | None = None
    moe_intermediate_size: Positive | None = None
    n_routed_experts: Positive | None = None
    n_shared_experts: Count | None = None  # refused other than 1
    num_experts_per_tok: Positive | None = None
    scoring_func: str | None = None  # refused other than sqrtsoftplus
    norm_topk_prob: bool | None = None  # refused when false
    hc_mult: Positive | None = None  # refused other than 4
    sliding_window: Positive | None = None
    hidden_act: str | None = None  # refused other than silu
    compress_ratios: list[Count] | None = None  # DeepSeek's per-layer ratios; the head's (index L) refused above 0
    num_hash_layers: Count | None = None  # refused past the target's layers: the head would be hash-routed
    quantization_config: dict | None = None  # refused: quantized weights
    vocab_size: Positive | None = None

    def namespaces(self) -> dict:
        return {"": ("DeepseekV4Config", type(self))}


LAYOUTS = (SpeculatorsMTP, NativeMTP, NativeNextN, NativeMimo, NativeDSV4)
