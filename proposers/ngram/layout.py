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


# SGLang's bound on speculative_num_draft_tokens: reconstruct_indices_from_tree_mask's (kernels/jit/csrc/speculative/tree.cuh:182)
SGLANG_MAX_DRAFT_TOKENS = 1024


class SglangNgram(EngineSettings):
    """SGLang's `--speculative-algorithm NGRAM` (SGLang 0.5.23: srt/speculative/ngram_worker.py and its
    C++ corpus, kernels/jit/csrc/ngram_corpus/), its ServerArgs fields as `sglang.Engine(...)` takes them:
    a trie of the tokens its own steps saw, shared by every request, drafting a tree (sglang.py). Defaults
    and checks: srt/arg_groups/fields/spec.py:250-283, speculative_hook.py:1285-1345 (12 draft tokens),
    ngram.cpp:12-40 (the corpus's own). An external corpus is not replayed (config.py refuses its path);
    without one, its SAM budget and token bound are read by nothing (ngram.cpp:170-175)."""

    FAMILY: ClassVar[str] = "ngram"
    LAYOUT: ClassVar[str] = "sglang"
    ALGORITHMS: ClassVar[tuple[str, ...]] = ("NGRAM",)

    speculative_algorithm: Literal["NGRAM"]
    # 1 would verify a tree of the last token alone (no draft): not replayed
    speculative_num_draft_tokens: int = Field(12, ge=2, le=SGLANG_MAX_DRAFT_TOKENS)
    speculative_ngram_min_bfs_breadth: int = Field(1, ge=1)  # ngram.cpp:17-20
    speculative_ngram_max_bfs_breadth: int = Field(10, ge=1)
    speculative_ngram_match_type: Literal["BFS", "PROB"] = "BFS"
    speculative_ngram_max_trie_depth: int = Field(18, ge=2)  # ngram.cpp:13-16
    speculative_ngram_capacity: int = Field(10_000_000, ge=1)
    speculative_ngram_external_corpus_path: str | None = None
    speculative_ngram_external_sam_budget: int = Field(0, ge=0)
    speculative_ngram_external_corpus_max_tokens: int = Field(10_000_000, ge=0)
    # the overlap schedule runs a finished request one step more, which inserts one window more (sglang.py)
    disable_overlap_schedule: bool = False

    @model_validator(mode="after")
    def _consistent(self):
        low, high = self.speculative_ngram_min_bfs_breadth, self.speculative_ngram_max_bfs_breadth
        if low > high:  # ngram.cpp:21-26
            raise ValueError(
                f"speculative_ngram_min_bfs_breadth {low} exceeds speculative_ngram_max_bfs_breadth {high}"
            )
        depth, capacity = self.speculative_ngram_max_trie_depth, self.speculative_ngram_capacity
        if capacity <= depth:  # fewer nodes than one inserted suffix: squeeze fails (trie.cpp:69-75)
            raise ValueError(
                f"speculative_ngram_capacity {capacity} must exceed speculative_ngram_max_trie_depth {depth}"
            )
        return self

    @property
    def evidence(self) -> str:
        return "speculative_algorithm 'NGRAM'"


LAYOUTS = (VllmNgram, LlamaNgramSimple, LlamaNgramMap, LlamaNgramMod, LlamaNgramCache, SglangNgram)
