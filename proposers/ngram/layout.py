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


class LlamaNgramMap(EngineSettings):
    """llama-server's `--spec-type ngram-map-k` / `ngram-map-k4v` (common/ngram-map.cpp): a hash map of
    the slot's earlier n-grams whose draft length follows each step's acceptance (llama_map.py).
    Each type reads its own flags; the other type's are refused."""

    FAMILY: ClassVar[str] = "ngram"
    LAYOUT: ClassVar[str] = "llama.cpp"
    SPEC_TYPES: ClassVar[tuple[str, ...]] = ("ngram-map-k", "ngram-map-k4v")

    spec_type: Literal["ngram-map-k", "ngram-map-k4v"] = Field(alias="spec-type")
    k_size_n: int = Field(12, ge=1, le=LLAMA_NGRAM_MAX, alias="spec-ngram-map-k-size-n")  # common/common.h:361-365
    k_size_m: int = Field(48, ge=1, le=LLAMA_NGRAM_MAX, alias="spec-ngram-map-k-size-m")
    k_min_hits: int = Field(1, ge=1, alias="spec-ngram-map-k-min-hits")  # read by nothing (ngram-map.cpp:382-399)
    k4v_size_n: int = Field(12, ge=1, le=LLAMA_NGRAM_MAX, alias="spec-ngram-map-k4v-size-n")
    k4v_size_m: int = Field(48, ge=1, le=LLAMA_NGRAM_MAX, alias="spec-ngram-map-k4v-size-m")
    k4v_min_hits: int = Field(1, ge=1, alias="spec-ngram-map-k4v-min-hits")

    @model_validator(mode="after")
    def _own_flags(self):
        other = "k4v" if self.spec_type == "ngram-map-k" else "k"
        given = sorted(
            f"spec-ngram-map-{other}-{n}"
            for n in ("size-n", "size-m", "min-hits")
            if f"{other}_{n.replace('-', '_')}" in self.model_fields_set
        )
        if given:
            raise ValueError(f"{', '.join(given)} set for spec-type {self.spec_type!r}, which reads its own flags only")
        return self

    @property
    def sizes(self) -> tuple[int, int, int]:
        """(n, m, min hits) of the chosen type."""
        if self.spec_type == "ngram-map-k":
            return self.k_size_n, self.k_size_m, self.k_min_hits
        return self.k4v_size_n, self.k4v_size_m, self.k4v_min_hits

    @property
    def evidence(self) -> str:
        return f"spec-type {self.spec_type!r}"


class LlamaNgramMod(EngineSettings):
    """llama-server's `--spec-type ngram-mod` (common/ngram-mod.cpp, common/speculative.cpp:1849-2022):
    one hash table of next tokens shared by every slot and request (llama_mod.py)."""

    FAMILY: ClassVar[str] = "ngram"
    LAYOUT: ClassVar[str] = "llama.cpp"
    SPEC_TYPES: ClassVar[tuple[str, ...]] = ("ngram-mod",)

    spec_type: Literal["ngram-mod"] = Field(alias="spec-type")
    n_match: int = Field(24, ge=1, le=LLAMA_NGRAM_MAX, alias="spec-ngram-mod-n-match")  # common/common.h:354-359
    n_min: int = Field(48, ge=0, le=LLAMA_NGRAM_MAX, alias="spec-ngram-mod-n-min")
    n_max: int = Field(64, ge=0, le=LLAMA_NGRAM_MAX, alias="spec-ngram-mod-n-max")

    @property
    def evidence(self) -> str:
        return f"spec-type {self.spec_type!r}"


class LlamaNgramCache(EngineSettings):
    """llama-server's `--spec-type ngram-cache` (common/ngram-cache.cpp, common/speculative.cpp:2024-2161):
    per-slot counts of the tokens after earlier n-grams (llama_cache.py). It has no size flag (8 drafts,
    n-grams of 1 to 4 tokens); the static and dynamic cache files are declared and refused by config.py."""

    FAMILY: ClassVar[str] = "ngram"
    LAYOUT: ClassVar[str] = "llama.cpp"
    SPEC_TYPES: ClassVar[tuple[str, ...]] = ("ngram-cache",)

    spec_type: Literal["ngram-cache"] = Field(alias="spec-type")
    lookup_cache_static: str | None = Field(None, alias="lookup-cache-static")  # -lcs (common/arg.cpp:1624-1630)
    lookup_cache_dynamic: str | None = Field(None, alias="lookup-cache-dynamic")  # -lcd (common/arg.cpp:1631-1637)

    @property
    def evidence(self) -> str:
        return f"spec-type {self.spec_type!r}"


LAYOUTS = (VllmNgram, LlamaNgramSimple, LlamaNgramMap, LlamaNgramMod, LlamaNgramCache)
