"""The n-gram proposers' configs, each given to `score --ckpt` as a JSON file:

- vLLM's `speculative_config` of method "ngram" (vllm/config/speculative.py `SpeculativeConfig`:
  `num_speculative_tokens`, `prompt_lookup_min`, `prompt_lookup_max`):
  `{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}`;
- llama-server's flags of `--spec-type ngram-simple` (common/arg.cpp), named as on its command line
  without the dashes: `{"spec-type": "ngram-simple", "spec-ngram-simple-size-n": 3, "spec-ngram-simple-size-m": 8}`.

Every other key is refused by name: a setting this proposer does not read would be silently dropped."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from pipeline.common.schema import Positive
from proposers.toolkit.engine_settings import EngineSettings

LABEL = "n-gram"


class VllmNgram(EngineSettings):
    FAMILY: ClassVar[str] = "ngram"
    LAYOUT: ClassVar[str] = "vllm"
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
    def evidence(self) -> str:
        return "method 'ngram'"


# llama-server's bound on its n-gram flags (common/arg.cpp:4289-4318)
LLAMA_NGRAM_MAX = 1024


class LlamaNgramSimple(EngineSettings):
    """llama-server's `--spec-type ngram-simple` (common/ngram-map.cpp common_ngram_simple_draft):
    the last size-n tokens looked up in the history, the size-m tokens after the latest match
    drafted. `--spec-draft-n-max` does not apply to it (the server's n-gram drafts are as long as
    their own settings allow), so its key is refused here like any other."""

    FAMILY: ClassVar[str] = "ngram"
    LAYOUT: ClassVar[str] = "llama.cpp"
    SPEC_TYPES: ClassVar[tuple[str, ...]] = ("ngram-simple",)

    spec_type: Literal["ngram-simple"] = Field(alias="spec-type")
    size_n: int = Field(12, ge=1, le=LLAMA_NGRAM_MAX, alias="spec-ngram-simple-size-n")
    size_m: int = Field(48, ge=1, le=LLAMA_NGRAM_MAX, alias="spec-ngram-simple-size-m")
    # parsed by llama-server and read by nothing (common/speculative.cpp:1764-1765): kept, unused
    min_hits: int = Field(1, ge=1, le=LLAMA_NGRAM_MAX, alias="spec-ngram-simple-min-hits")

    @property
    def evidence(self) -> str:
        return f"spec-type {self.spec_type!r}"


LAYOUTS = (VllmNgram, LlamaNgramSimple)
