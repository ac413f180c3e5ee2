"""The EAGLE-3 family's config layouts, torch-free: speculators' (`speculators_model_type: "eagle3"`,
`SpeculatorsEagle3`) and SpecForge's (`"architectures": ["LlamaForCausalLMEagle3"]`): the draft decoder's LlamaConfig at the top level with
`draft_vocab_size` beside it (SpecForge specforge/modeling/draft/llama3_eagle.py
`LlamaForCausalLMEagle3`, configs/*-eagle3*.json), the feature layers in
`eagle_config.eagle_aux_hidden_state_layer_ids` counted as the OUTPUT of layer i (sglang captures
the residual entering layer i + 1), default [1, L // 2 - 1, L - 4] for an L-layer target
(specforge/algorithms/model_providers.py `resolve_eagle_capture_layers`). `fc_norm` (a norm per
aux layer before `fc`) and `norm_output` (default true: the final norm before lm_head) are
SpecForge's switches. `num_speculative_tokens` is this project's field (SpecForge configs state
no step count; sglang takes it from --speculative-num-steps).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pipeline.common.schema import SchemaError
from proposers.toolkit.layout_fields import SpecForgeEagleFields
from proposers.toolkit.speculators_layout import SpeculatorsEagle, default_eagle_ids

LABEL = "EAGLE-3"
ARCHITECTURE = "LlamaForCausalLMEagle3"


class SpeculatorsEagle3(SpeculatorsEagle):
    """speculators' EAGLE-3 (models/eagle3/config.py)."""

    FAMILY: ClassVar[str] = "eagle3"

    speculators_model_type: Literal["eagle3"]


class SpecForgeEagle3(SpecForgeEagleFields):
    CONVENTION: ClassVar[str] = "output"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = (ARCHITECTURE,)
    FAMILY: ClassVar[str] = "eagle3"

    fc_norm: bool = False
    norm_output: bool = True
    # read by an engine, never written by SpecForge (docs/config-fields.md): refused unless neutral
    norm_before_residual: bool | None = None
    use_aux_norm: bool | None = None  # sglang's older name for fc_norm
    bias: bool | None = None  # sglang: a bias on fc

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        """The ids as stated (already this project's convention), else SpecForge's default. The
        target's last layer is refused: sglang captures the residual entering layer i + 1, which
        the last layer has none of, and this project's id L - 1 is stored after the final norm."""
        ids = self.stored_layer_ids()
        if ids is None:
            ids = default_eagle_ids((1, -1, -4), num_target_layers, source, self.IDS_FIELD)
        if num_target_layers is not None and max(ids) >= num_target_layers - 1:
            raise SchemaError(
                f"{source}: field '{self.IDS_FIELD}' lists {max(ids)}, not a layer sglang captures for a "
                f"{num_target_layers}-layer target (ids 0..{num_target_layers - 2}: the residual entering the next layer)"
            )
        return list(ids)


LAYOUTS = (SpeculatorsEagle3, SpecForgeEagle3)
