"""SpecForge's EAGLE-3 layout (`"architectures": ["LlamaForCausalLMEagle3"]`; speculators' own is
speculators.py's `SpeculatorsEagle3`): the draft decoder's LlamaConfig at the top level with
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

from typing import Annotated, ClassVar

from pydantic import Field, field_validator

from pipeline.common.drafter_configs.decoder import REQUIRED_SHAPE, DecoderFields
from pipeline.common.drafter_configs.speculators import default_eagle_ids
from pipeline.common.drafter_configs.zlab import unique_ids
from pipeline.common.schema import Count, Positive, Schema, SchemaError, wrong

LayerIds = Annotated[list[Count], Field(min_length=1)]
ARCHITECTURE = "LlamaForCausalLMEagle3"


class EagleOptions(Schema):
    """`eagle_config`: which target layers feed `fc`, and whether any do."""

    eagle_aux_hidden_state_layer_ids: LayerIds | None = None
    use_aux_hidden_state: bool = True

    _unique = field_validator("eagle_aux_hidden_state_layer_ids")(unique_ids)


class SpecForgeEagle3(DecoderFields):
    LAYOUT: ClassVar[str] = "specforge"
    CONVENTION: ClassVar[str] = "output"
    IDS_FIELD: ClassVar[str] = "eagle_config.eagle_aux_hidden_state_layer_ids"

    architectures: list[str]
    draft_vocab_size: Positive | None = None
    target_hidden_size: Positive | None = None
    eagle_config: EagleOptions | None = None
    fc_norm: bool = False
    norm_output: bool = True
    num_speculative_tokens: Positive | None = None

    @field_validator("architectures")
    @classmethod
    def _eagle3(cls, value):
        if ARCHITECTURE not in value:
            raise wrong(value, f"['{ARCHITECTURE}']")
        return value

    @property
    def family(self) -> str:
        return "eagle3"

    @property
    def evidence(self) -> str:
        return f"architectures ['{ARCHITECTURE}']"

    @property
    def options(self) -> EagleOptions:
        return self.eagle_config or EagleOptions()

    def check_complete(self, source: str) -> None:
        """What SpecForge's LlamaForCausalLMEagle3 reads without a default."""
        missing = self.require(REQUIRED_SHAPE) + self.require(("draft_vocab_size",))
        if missing:
            raise SchemaError(f"{source}: missing field {missing[0]!r}; SpecForge's LlamaForCausalLMEagle3 needs it")

    def stored_layer_ids(self) -> list[int] | None:
        return self.options.eagle_aux_hidden_state_layer_ids

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
