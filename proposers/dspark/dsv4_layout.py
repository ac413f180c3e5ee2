"""DeepSeek-V4's DSpark layout (`"architectures": ["DeepseekV4DSparkModel"]`), torch-free: the
DeepSeek-V4 checkpoint's own config.json (DeepSeek's key names, which transformers'
DeepseekV4Config reads) with the `dspark_*` fields at the top level; the drafter's stages are the
checkpoint's `mtp.{i}.*` tensors (llama.cpp conversion/deepseek.py:927-1034; vLLM
vllm/models/deepseek_v4/nvidia/dspark.py). `num_hidden_layers` is the TARGET's layer count (vLLM
numbers the stages after it, dspark.py:131-139); the stage count is `n_mtp_layers` (vLLM, absent: 3).

Read: `dspark_block_size`, `dspark_noise_token_id` (the mask token) and `dspark_target_layer_ids`
(output of layer i: vLLM's aux layers and the GGUF both get i + 1, eagle3_utils.py:126-135,
conversion/deepseek.py:1034) by llama.cpp's converter; `dspark_markov_rank` by vLLM
(dspark.py:169-181), llama.cpp taking the rank from the tensors (src/models/dflash.cpp:120-136).
What the engines refuse or run apart is refused by name in dsv4.py.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import field_validator

from pipeline.common.schema import Count, Number, Positive, SchemaError
from proposers.toolkit.layout_fields import ArchitectureFields, LayerIds, unique_ids

ARCHITECTURE = "DeepseekV4DSparkModel"
STAGES = 3  # vLLM's default stage count (dspark.py:106)
# the decoder fields the stages are built from (transformers' DeepseekV4Config names; DeepSeek's own)
REQUIRED = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank", "qk_rope_head_dim",
    "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "hc_mult",
    "sliding_window", "vocab_size", "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
    "dspark_markov_rank",
)  # fmt: skip


class DeepseekV4DSpark(ArchitectureFields):
    LAYOUT: ClassVar[str] = "deepseek-v4"
    CONVENTION: ClassVar[str] = "output"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = (ARCHITECTURE,)
    FAMILY: ClassVar[str] = "dspark"
    DECODER_CLASS: ClassVar[str] = "DeepseekV4Config"

    architectures: list[str]
    model_type: str | None = None
    # the DeepSeek-V4 decoder (DeepseekV4Config's; its defaults fill the rest)
    hidden_size: Positive | None = None
    num_hidden_layers: Positive | None = None  # the target's
    num_attention_heads: Positive | None = None
    num_key_value_heads: Positive | None = None
    head_dim: Positive | None = None
    q_lora_rank: Positive | None = None
    qk_rope_head_dim: Positive | None = None  # DeepseekV4Config reads it as partial_rotary_factor
    o_groups: Positive | None = None
    o_lora_rank: Positive | None = None
    moe_intermediate_size: Positive | None = None
    n_routed_experts: Positive | None = None
    n_shared_experts: Count | None = None
    num_experts_per_tok: Positive | None = None
    scoring_func: str | None = None
    norm_topk_prob: bool | None = None
    routed_scaling_factor: Number | None = None
    hc_mult: Positive | None = None
    hc_sinkhorn_iters: Positive | None = None
    hc_eps: Number | None = None
    swiglu_limit: Number | None = None
    sliding_window: Positive | None = None
    hidden_act: str | None = None
    vocab_size: Positive | None = None
    compress_ratios: list[Count] | None = None  # legacy per-layer ratios, the target's then the stages'
    num_hash_layers: Count | None = None  # the target's hash-routed layers; no stage has any
    rope_scaling: dict[str, Any] | None = None  # YaRN of the compressed layers only: no stage has any
    # the DSpark fields
    n_mtp_layers: Positive | None = None
    dspark_block_size: Positive | None = None
    dspark_noise_token_id: Count | None = None
    dspark_target_layer_ids: LayerIds | None = None
    dspark_markov_rank: Positive | None = None
    dspark_draft_topk: Positive | None = None
    enable_confidence_head: bool | None = None
    confidence_threshold: Number | None = None
    sample_from_anchor: bool | None = None
    draft_vocab_size: Positive | None = None

    _unique = field_validator("dspark_target_layer_ids")(unique_ids)

    @property
    def stages(self) -> int:
        return self.n_mtp_layers or STAGES

    def namespaces(self) -> dict:
        """DeepseekV4Config's keys at the top level, whatever model_type says."""
        return {"": (self.DECODER_CLASS, type(self))}

    def check_complete(self, source: str) -> None:
        """What llama.cpp's converter and vLLM's DSparkDeepseekV4Model read without a default."""
        missing = [name for name in REQUIRED if getattr(self, name) is None]
        if missing:
            raise SchemaError(
                f"{source}: missing field {missing[0]!r}; llama.cpp's converter and vLLM's DeepSeek-V4 DSpark "
                f"need it (conversion/deepseek.py:724-748, 1028-1034; vllm deepseek_v4/nvidia/dspark.py:93-181)"
            )

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        """dspark_target_layer_ids (output of layer i), each before the target's last layer: this
        project's extract stores the final-norm output there, not the streams' mean the engines read."""
        ids = self.dspark_target_layer_ids
        if ids is None:
            raise SchemaError(f"{source}: missing field 'dspark_target_layer_ids'; the feature layers are unknown")
        layers = self.num_hidden_layers or num_target_layers
        for i in ids:
            if layers is not None and i >= layers - 1:
                raise SchemaError(
                    f"{source}: field 'dspark_target_layer_ids' lists {i}, "
                    + (f"past the target's {layers} layers" if i >= layers else "the target's last layer")
                    + " (specreplay stores the final-norm output there, the engines the hyper-connection streams' "
                    "mean); list layers before it"
                )
        return list(ids)
