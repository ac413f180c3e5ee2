"""The EAGLE-1/2 family's config layouts, torch-free: the EAGLE repository's drafter config (SafeAILab
EAGLE, PyPI `eagle-llm`: a LlamaConfig of the draft decoder with `bias`, the fc bias switch its
`EaModel` reads, default true) under the architecture each engine registers it by: SGLang's
`LlamaForCausalLMEagle` (models/llama_eagle.py), vLLM's `EagleLlamaForCausalLM`
(models/llama_eagle.py), or the repository's own `LlamaForCausalLM`, which no field tells from a
plain Llama model's: read only with `score --family eagle`. HASS trains the same format.

The drafter reads one feature, the target's last hidden state after its final norm (what the
target model returns: EaModel's `outputs[0]`, vLLM's and SGLang's hidden states for method
"eagle"), this project's id L - 1 (docs/layer-numbering.md). The ids depend on the target's layer
count, so reading them needs it. `num_speculative_tokens` is this project's field (the engines take
the step count from their command line).
"""

from __future__ import annotations

from typing import ClassVar

from pipeline.common.schema import Positive, SchemaError
from proposers.toolkit.layout_fields import REQUIRED_SHAPE, DraftDecoderFields

LABEL = "EAGLE-1/2"
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle"
VLLM_ARCHITECTURE = "EagleLlamaForCausalLM"


class EagleRepo(DraftDecoderFields):
    """The EAGLE repository's config (`LlamaForCausalLM`): only under `--family eagle`."""

    LAYOUT: ClassVar[str] = "eagle"
    CONVENTION: ClassVar[str] = "output"
    DECODER_CLASS: ClassVar[str] = "LlamaConfig"
    IDS_FIELD: ClassVar[str] = "the target's last layer"

    architectures: list[str] | None = None
    bias: bool = True  # fc's bias (EaModel: con["bias"], true when absent)
    num_speculative_tokens: Positive | None = None

    def namespaces(self) -> dict:
        """LlamaConfig's keys whatever model_type says (config.py refuses another model_type by name)."""
        return {"": (self.DECODER_CLASS, type(self))}

    @property
    def family(self) -> str:
        return "eagle"

    @property
    def evidence(self) -> str:
        return f"architectures {self.architectures}"

    def check_complete(self, source: str) -> None:
        missing = self.require(REQUIRED_SHAPE)
        if missing:
            raise SchemaError(f"{source}: missing field {missing[0]!r}; an EAGLE-1/2 drafter's LlamaConfig needs it")

    def stored_layer_ids(self) -> list[int] | None:
        return None

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        """[L - 1]: the target's last hidden state after its final norm, for an L-layer target."""
        if num_target_layers is None:
            raise SchemaError(
                f"{source}: an EAGLE-1/2 drafter reads the target's last layer after its final norm, whose id "
                f"needs the target's layer count, which is unknown here"
            )
        return [num_target_layers - 1]


class SglangEagle(EagleRepo):
    LAYOUT: ClassVar[str] = "sglang"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = (SGLANG_ARCHITECTURE,)


class VllmEagle(EagleRepo):
    LAYOUT: ClassVar[str] = "vllm"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = (VLLM_ARCHITECTURE,)


# the repository's layout first: `--family eagle` reads a config of no known architecture as it
LAYOUTS = (EagleRepo, SglangEagle, VllmEagle)
