"""The n-gram proposer's config: vLLM's `speculative_config` of method "ngram" (vllm/config/speculative.py
`SpeculativeConfig`: `num_speculative_tokens`, `prompt_lookup_min`, `prompt_lookup_max`), given to
`score --ckpt` as a JSON file: `{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}`.
Every other key is refused by name: a setting this proposer does not read would be silently dropped."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import model_validator

from pipeline.common.schema import ClosedSchema, Positive

LABEL = "n-gram"


class VllmNgram(ClosedSchema):
    LAYOUT: ClassVar[str] = "vllm"
    CONVENTION: ClassVar[str] = "output"
    METHODS: ClassVar[tuple[str, ...]] = ("ngram",)

    method: Literal["ngram"]
    num_speculative_tokens: Positive
    prompt_lookup_min: Positive | None = None
    prompt_lookup_max: Positive | None = None

    @model_validator(mode="after")
    def _ordered(self):
        if self.lookup[0] > self.lookup[1]:
            raise ValueError(f"prompt_lookup_min {self.lookup[0]} exceeds prompt_lookup_max {self.lookup[1]}")
        return self

    @property
    def lookup(self) -> tuple[int, int]:
        """(min n, max n) as vLLM resolves them: both 5 when neither is given, else one stands for the other."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return 5, 5
        return (low or high, high or low)

    @property
    def family(self) -> str:
        return "ngram"

    @property
    def evidence(self) -> str:
        return "method 'ngram'"

    def check_complete(self, source: str) -> None:
        """Nothing to add: the schema itself requires every field the lookup needs."""

    def namespaces(self) -> dict:
        """No namespace is a transformers config: the schema is closed (proposers/fields/known.py)."""
        return {}

    def stored_layer_ids(self) -> list[int]:
        return []

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        return []  # it reads the tokens alone: shards extracted with --layer-ids none serve it


LAYOUTS = (VllmNgram,)
