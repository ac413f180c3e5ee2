"""The P-EAGLE family's config layouts, torch-free.

* speculators (`speculators_model_type: "peagle"`, models/peagle/config.py
  `PEagleSpeculatorConfig`): EAGLE-3's fields (proposers/toolkit/speculators_layout.py
  `SpeculatorsEagle`) and `mask_token_id`, the token the drafts after the first read (vLLM's
  parallel drafting refuses a drafter without one).
* SpecForge (`"architectures": ["PEagleDraftModel"]`, specforge/modeling/draft/peagle.py, its
  configs/qwen3-8b-peagle.json): the draft decoder's LlamaConfig at the top level, any number of
  layers (the first reads [embedding ; hidden] as EAGLE-3's does), `draft_vocab_size`, the
  `norm_before_residual` switch its save_pretrained writes. vLLM serves it as EAGLE-3 with
  parallel drafting (model_executor/models/registry.py maps `PEagleDraftModel` to
  `Eagle3LlamaForCausalLM`) and so reads its fields as it reads an EAGLE-3 config: the feature
  ids in `eagle_config.eagle_aux_hidden_state_layer_ids` as before-layer ids (v1/worker/
  gpu_model_runner.py:5207-5221; default [2, L // 2, L - 3]), the mask token from the first of
  `dflash_config.mask_token_id`, `mask_token_id`, `dspark_noise_token_id`, `pard_token`,
  `ptd_token_id` (v1/spec_decode/llm_base_proposer.py:361-372). SpecForge resolves its mask token
  at training time (training/model_utils.py `resolve_mask_token_id`) and saves none: such a config
  is refused until the user states it, as vLLM refuses it.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pipeline.common.schema import Count, SchemaError
from proposers.toolkit.layout_fields import DrafterNamespace, SpecForgeEagleFields
from proposers.toolkit.speculators_layout import SpeculatorsEagle, default_eagle_ids, from_before_layer

LABEL = "P-EAGLE"
ARCHITECTURE = "PEagleDraftModel"
# vLLM's parallel-drafting token, the first of these a config sets (llm_base_proposer.py:361-372)
MASK_KEYS = ("dflash_config.mask_token_id", "mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")


class SpeculatorsPEagle(SpeculatorsEagle):
    FAMILY: ClassVar[str] = "peagle"

    speculators_model_type: Literal["peagle"]
    mask_token_id: Count | None = None
    embed_requires_grad: bool = True  # training-only: P-EAGLE trains its own embedding

    def check_complete(self, source: str) -> None:
        super().check_complete(source)
        if self.mask_token_id is None:
            raise SchemaError(
                f"{source}: missing field 'mask_token_id'; a P-EAGLE drafter drafts its tokens after the first "
                f"from its mask token (vLLM refuses a drafter without one too)"
            )


class MaskOptions(DrafterNamespace):
    """`dflash_config` of a P-EAGLE config: vLLM reads its parallel-drafting token here first."""

    mask_token_id: Count | None = None


class SpecForgePEagle(SpecForgeEagleFields):
    CONVENTION: ClassVar[str] = "before"  # vLLM, the engine that serves it, reads the ids before layer i
    ARCHITECTURES: ClassVar[tuple[str, ...]] = (ARCHITECTURE,)
    FAMILY: ClassVar[str] = "peagle"

    norm_before_residual: bool = False  # SpecForge's training switch, saved with the model; vLLM reads it
    dflash_config: MaskOptions | None = None
    mask_token_id: Count | None = None
    dspark_noise_token_id: Count | None = None
    pard_token: Count | None = None
    ptd_token_id: Count | None = None
    fc_norm: bool | None = None  # read by vLLM's EAGLE-3 layers, never built by PEagleDraftModel: refused

    @property
    def mask_token(self) -> int | None:
        """vLLM's parallel-drafting token: the first of MASK_KEYS the config sets."""
        nested = self.dflash_config.mask_token_id if self.dflash_config else None
        found = [nested, self.mask_token_id, self.dspark_noise_token_id, self.pard_token, self.ptd_token_id]
        return next((token for token in found if token is not None), None)

    def check_complete(self, source: str) -> None:
        """SpecForge's required fields, and the mask token vLLM needs."""
        super().check_complete(source)
        if self.mask_token is None:
            raise SchemaError(
                f"{source}: missing field 'mask_token_id'; SpecForge picks P-EAGLE's mask token when it trains "
                f"(its --mask-token-id, else the tokenizer's mask, an unused embedding row, pad, eos or unk token) "
                f'and does not save it: add "mask_token_id": N with the id your training used (vLLM refuses the '
                f"config without it too)"
            )

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        """The stated ids read before layer i as vLLM reads them (the output of layer i - 1, id L
        the last layer's output), else vLLM's default [2, L // 2, L - 3] (the layers SpecForge's
        default [1, L // 2 - 1, L - 4] names in its own output-of-layer numbering)."""
        ids = self.stored_layer_ids()
        if ids is None:
            ids = default_eagle_ids((2, 0, -3), num_target_layers, source, self.IDS_FIELD)
        return from_before_layer(ids, num_target_layers, source, self.IDS_FIELD)


LAYOUTS = (SpeculatorsPEagle, SpecForgePEagle)
