"""vLLM's Qwen3-Omni DSpark layout (`"architectures": ["Qwen3OmniDSparkModel"]`), torch-free: a
standalone Qwen3 drafter config (transformers' Qwen3Config fields) with the DSpark fields at the top
level, served over a Qwen3-Omni thinker's text layers. vLLM builds it as the Qwen3 DSpark drafter
(`vllm/model_executor/models/registry.py:682`: `Qwen3DSparkForCausalLM`, qwen3_dspark.py) and checks
the checkpoint's contract in `_validate_qwen3_omni_dspark` (`vllm/config/speculative.py:167-393`);
SGLang and llama.cpp have no reader for it.

Where vLLM reads a value from more than one key, the first set one wins, in vLLM's order:
- the block: `block_size`, else `dspark_block_size` (speculative.py:186-188, 1597-1599);
- the feature layers (output of layer i; vLLM captures aux layer i + 1): `dflash_config.target_layer_ids`,
  `dspark_target_layer_ids`, `target_layer_ids` (speculative.py:262-268; the capture's order
  v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:119-140, `eagle_aux_hidden_state_layer_ids` first);
- the mask token: `dflash_config.mask_token_id`, `mask_token_id`, `dspark_noise_token_id`,
  `pard_token`, `ptd_token_id` (v1/worker/gpu/spec_decode/utils.py:92-115; speculative.py:356-377);
- `use_aux_hidden_state`: `dflash_config`, `eagle_config`, the top level (speculative.py:156-164, 296).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import field_validator

from pipeline.common.schema import Count, Positive, SchemaError
from proposers.toolkit.layout_fields import (
    REQUIRED_SHAPE,
    ArchitectureFields,
    BlockDecoderFields,
    DrafterNamespace,
    LayerIds,
    unique_ids,
)

ARCHITECTURE = "Qwen3OmniDSparkModel"
MASK_KEYS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")  # after dflash_config's
IDS_KEYS = ("dspark_target_layer_ids", "target_layer_ids")  # after dflash_config's
VALIDATOR = "vLLM's _validate_qwen3_omni_dspark (vllm/config/speculative.py:167-393)"


class OmniDFlashOptions(DrafterNamespace):
    """`dflash_config` of a Qwen3-Omni DSpark drafter: what vLLM reads there before the top level."""

    target_layer_ids: LayerIds | None = None
    mask_token_id: Count | None = None
    use_aux_hidden_state: bool | None = None

    _unique = field_validator("target_layer_ids")(unique_ids)


class OmniEagleOptions(DrafterNamespace):
    """`eagle_config`: vLLM reads `use_aux_hidden_state` there after dflash_config's."""

    use_aux_hidden_state: bool | None = None


class Qwen3OmniDSpark(ArchitectureFields, BlockDecoderFields):
    LAYOUT: ClassVar[str] = "qwen3-omni"
    CONVENTION: ClassVar[str] = "output"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = (ARCHITECTURE,)
    FAMILY: ClassVar[str] = "dspark"

    architectures: list[str]
    num_target_layers: Positive | None = None
    block_size: Positive | None = None
    dspark_block_size: Positive | None = None
    target_hidden_size: Positive | None = None
    draft_vocab_size: Positive | None = None
    target_layer_ids: LayerIds | None = None
    dspark_target_layer_ids: LayerIds | None = None
    eagle_aux_hidden_state_layer_ids: LayerIds | None = None  # refused unless target_layer_ids + 1
    mask_token_id: Count | None = None
    dspark_noise_token_id: Count | None = None
    pard_token: Count | None = None
    ptd_token_id: Count | None = None
    use_aux_hidden_state: bool | None = None
    markov_rank: Count | None = None
    markov_head_type: str | None = None
    enable_confidence_head: bool | None = None  # absent: false (qwen3_dspark.py:220)
    confidence_head_with_markov: bool | None = None  # absent: false (qwen3_dspark.py:221)
    confidence_threshold: Any = None  # this project's (config.py checks it)
    sample_from_anchor: bool | None = None  # absent: true; refused when false (speculative.py:319-324)
    dspark_bonus_anchor: bool | None = None  # refused when true (speculative.py:319-324)
    mrope_section: Any = None  # refused when set (speculative.py:379-393)
    dflash_config: OmniDFlashOptions | None = None
    eagle_config: OmniEagleOptions | None = None

    def namespaces(self) -> dict:
        """Qwen3Config's keys at the top level (vLLM builds the drafter's Qwen3 layers from them)."""
        kind = self.model_type
        return {"": ("Qwen3Config" if kind in (None, "qwen3") else None, type(self))}

    def first_set(self, names: tuple[str, ...], nested: str | None = None) -> tuple[str | None, Any]:
        """(the key, its value) of the first of `dflash_config.<nested>` and `names` that is set."""
        if nested is not None and self.dflash_config is not None and getattr(self.dflash_config, nested) is not None:
            return f"dflash_config.{nested}", getattr(self.dflash_config, nested)
        for name in names:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None, None

    @property
    def block(self) -> int | None:
        return self.first_set(("block_size", "dspark_block_size"))[1]

    @property
    def mask(self) -> int | None:
        return self.first_set(MASK_KEYS, "mask_token_id")[1]

    @property
    def aux_features(self) -> tuple[str, bool | None]:
        """(the key, its value) vLLM reads `use_aux_hidden_state` from."""
        for name, space in (("dflash_config", self.dflash_config), ("eagle_config", self.eagle_config)):
            if space is not None and space.use_aux_hidden_state is not None:
                return f"{name}.use_aux_hidden_state", space.use_aux_hidden_state
        return "use_aux_hidden_state", self.use_aux_hidden_state

    def check_complete(self, source: str) -> None:
        """What vLLM's validator and Qwen3DSparkForCausalLM need present (speculative.py:186-195, 262-272,
        302-310, 356-377; qwen3_dspark.py:209-216)."""
        missing = self.require(REQUIRED_SHAPE) + self.require(("target_hidden_size", "markov_rank"))
        if self.block is None:
            missing.append("block_size")
        if self.first_set(IDS_KEYS, "target_layer_ids")[1] is None:
            missing.append("target_layer_ids")
        if self.mask is None:
            missing.append("mask_token_id")
        if missing:
            raise SchemaError(f"{source}: missing field {missing[0]!r}; {VALIDATOR} requires it")

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        """The first set of dflash_config.target_layer_ids, dspark_target_layer_ids, target_layer_ids
        (output of layer i), strictly increasing as vLLM requires (speculative.py:281-284); the
        target's last layer is refused: vLLM captures it before the final norm, this project's
        extract stores transformers' hidden_states there, after it."""
        key, ids = self.first_set(IDS_KEYS, "target_layer_ids")
        if ids is None:
            raise SchemaError(f"{source}: missing field 'target_layer_ids'; the feature layers are unknown")
        if list(ids) != sorted(ids):
            raise SchemaError(f"{source}: field {key!r} is {ids}; {VALIDATOR} requires it strictly increasing")
        aux = self.eagle_aux_hidden_state_layer_ids
        if aux is not None and list(aux) != [i + 1 for i in ids]:
            raise SchemaError(
                f"{source}: field 'eagle_aux_hidden_state_layer_ids' is {aux}: vLLM captures those target layers "
                f"(before-layer ids) while its validator checks {key!r} {ids}; drop it or set it to "
                f"{[i + 1 for i in ids]}"
            )
        layers = self.num_target_layers or num_target_layers
        for i in ids:
            if layers is not None and i >= layers - 1:
                raise SchemaError(
                    f"{source}: field {key!r} lists {i}, "
                    + (f"past the target's {layers} layers" if i >= layers else "the target's last layer")
                    + " (vLLM feeds that layer before the final norm, specreplay stores it after); list layers "
                    "before it"
                )
        return list(ids)
