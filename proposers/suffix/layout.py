"""The suffix decoding proposer's config: vLLM's `speculative_config` of method "suffix"
(vllm/config/speculative.py `SpeculativeConfig`, vLLM 0.33.0), given to `score --ckpt` as a JSON file:
`{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 24}`.

Its fields, vLLM's defaults (speculative.py:538-556) and the ranges vLLM refuses outside
(`_validate_suffix_decoding`, speculative.py:1726-1760); num_speculative_tokens defaults to the tree
depth there (speculative.py:1732-1739). Every other key is refused by name: a setting this proposer
does not read would be silently dropped."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from pipeline.common.schema import LARGEST, Positive
from proposers.toolkit.engine_settings import EngineSettings

LABEL = "suffix decoding"


class VllmSuffix(EngineSettings):
    FAMILY: ClassVar[str] = "suffix"
    LAYOUT: ClassVar[str] = "vllm"
    METHODS: ClassVar[tuple[str, ...]] = ("suffix",)

    method: Literal["suffix"]
    num_speculative_tokens: Positive | None = None  # None: the tree depth, as vLLM defaults it
    # the depth of the prompt's and the responses' trees: the longest suffix matched plus its continuation
    suffix_decoding_max_tree_depth: Positive = 24
    # responses kept in the global tree (FIFO; 0: none). Arctic's cache refuses more than 2^31 - 1
    # (arctic_inference/suffix_decoding/cache.py:73-74)
    suffix_decoding_max_cached_requests: int = Field(10000, ge=0, le=LARGEST)
    suffix_decoding_max_spec_factor: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0.0, le=1.0)

    @property
    def draft_length(self) -> int:
        """num_speculative_tokens as vLLM resolves it: the tree depth when not given."""
        return self.num_speculative_tokens or self.suffix_decoding_max_tree_depth

    @property
    def evidence(self) -> str:
        return "method 'suffix'"


LAYOUTS = (VllmSuffix,)
