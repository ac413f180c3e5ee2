"""z-lab's layout (`"architectures": ["DFlashDraftModel"]`, or `DFlash2DraftModel`), shared by the
DFlash and DFlash2 families: the config.json is the drafter's Qwen3 config with the DFlash fields
beside it; the reference reads each DFlash field from `dflash_config` first, then from the top
level. Layer ids count the output of layer i, this project's own convention
(docs/layer-numbering.md). A `dflash_config` holding DFlash2's convolution or selector keys is
DFlash2 in this layout; one whose `projector_type` is "dspark" is SpecForge's DSpark
(proposers/dspark/layout.py)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import field_validator

from pipeline.common.layer_ids import build_target_layer_ids
from pipeline.common.schema import Count, Number, Positive, SchemaError
from proposers.toolkit.layout_fields import REQUIRED_SHAPE, BlockDecoderFields, DrafterNamespace, LayerIds, unique_ids

DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# sglang's LiLiCorr correction head (speculative/lilicorr_utils.py): built from these dflash_config keys
LILICORR_KEYS = (
    "lilicorr_enabled", "lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers",
    "lilicorr_num_heads", "lilicorr_mlp_ratio", "lilicorr_factor_dim", "lilicorr_vector_eps", "lilicorr_logit_scale",
)  # fmt: skip


class DFlashOptions(DrafterNamespace):
    """`dflash_config`: the DFlash fields the reference, the engines and SpecForge read there (each
    of z-lab's may also sit at the top level); docs/config-fields.md says what each does."""

    mask_token_id: Count | None = None
    target_layer_ids: LayerIds | None = None
    num_target_layers: Positive | None = None  # sglang's precedence: dflash_config first
    block_size: Positive | None = None
    input_embedding_scale: Number | None = None
    output_multiplier: Number | None = None
    final_logit_softcapping: Number | None = None
    conv_kernel_size: Positive | None = None
    conv_group_size: Positive | None = None
    selector_rank: Positive | None = None
    selector_top_k: Positive | None = None
    projector_type: str | None = None  # refused unless absent ('dspark' is SpecForge's DSpark layout)
    causal: bool | None = None  # every layer's block causality when is_causal is absent (vLLM, llama.cpp)
    attention_value_scale: Number | None = None  # values scaled (vLLM, sglang; llama.cpp after o_proj)
    use_swa: bool | None = None  # a window on every layer (vLLM, llama.cpp): qwen3_decoder.zlab_windows
    swa_window_size: Positive | None = None  # the sliding layers' window (vLLM, llama.cpp)
    attention_sink_bias: bool | None = None  # refused when true: learned attention sinks
    sample_from_anchor: bool | None = None  # refused when true: vLLM refuses it for DFlash
    use_aux_hidden_state: bool | None = None  # refused when false: no fc over target features
    mask_token: str | None = None  # the mask token's text (sglang resolves the id from it): bookkeeping
    shift_label: Any = None  # Domino (sglang) / SpecForge training only
    pure_draft_prefix_len: Any = None
    gru_hidden_dim: Any = None
    emb_dim: Any = None
    lilicorr_enabled: Any = None  # sglang's LiLiCorr head: refused unless lilicorr_enabled is false
    lilicorr_candidate_topk: Any = None
    lilicorr_hidden_size: Any = None
    lilicorr_num_layers: Any = None
    lilicorr_num_heads: Any = None
    lilicorr_mlp_ratio: Any = None
    lilicorr_factor_dim: Any = None
    lilicorr_vector_eps: Any = None
    lilicorr_logit_scale: Any = None

    _unique = field_validator("target_layer_ids")(unique_ids)


class ZlabDFlash(BlockDecoderFields):
    LAYOUT: ClassVar[str] = "z-lab"
    CONVENTION: ClassVar[str] = "output"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("DFlashDraftModel", "DFlash2DraftModel")

    architectures: list[str] | None = None
    num_target_layers: Positive | None = None
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
    # read by an engine at the top level (docs/config-fields.md): refused unless neutral, or bookkeeping
    draft_vocab_size: Positive | None = None
    target_hidden_size: Positive | None = None
    use_aux_hidden_state: bool | None = None
    sample_from_anchor: bool | None = None  # no engine reads it here for DFlash (dflash_config's is refused)
    add_swa_attention_sink_bias: bool | None = None
    projector_type: str | None = None
    has_own_lm_head: bool | None = None  # vLLM's lm_head quantization choice: bookkeeping
    mask_token: str | None = None
    shift_label: Any = None
    pure_draft_prefix_len: Any = None
    gru_hidden_dim: Any = None
    emb_dim: Any = None

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
        layers = self.value("num_target_layers") or num_target_layers
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
