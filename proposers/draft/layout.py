"""The draft model's config: llama-server's flags of `--spec-type draft-simple` (common/arg.cpp),
named as on its command line without the dashes, in a JSON file given to `score --ckpt`:
`{"spec-type": "draft-simple", "model-draft": "small/", "spec-draft-n-max": 4}`. `model-draft` is the
transformers checkpoint directory the server's GGUF was converted from, or that GGUF itself (read
through transformers' GGUF loader: checks.py transformers_dir), relative to the JSON file's folder,
or absolute. Every other key is refused by name."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from proposers.toolkit.engine_settings import EngineSettings

LABEL = "draft model"

DRAFT_MAX = 1024  # llama-server's bound on its draft sizes (common/arg.cpp)


class LlamaDraftSimple(EngineSettings):
    """llama-server's `--spec-type draft-simple` (common/speculative.cpp:179-450): n-max greedy drafts
    a step from the draft model's own KV cache; a draft whose top-10 probability falls below p-min
    ends the chain; a chain shorter than n-min is dropped (both refused above 0 by config.py)."""

    FAMILY: ClassVar[str] = "draft"
    LAYOUT: ClassVar[str] = "llama.cpp"
    SPEC_TYPES: ClassVar[tuple[str, ...]] = ("draft-simple",)

    spec_type: Literal["draft-simple"] = Field(alias="spec-type")
    model_draft: str = Field(alias="model-draft")
    n_max: int = Field(3, ge=1, le=DRAFT_MAX, alias="spec-draft-n-max")  # common/common.h:328
    n_min: int = Field(0, ge=0, le=DRAFT_MAX, alias="spec-draft-n-min")  # common/common.h:329
    p_min: float = Field(0.0, ge=0.0, le=1.0, alias="spec-draft-p-min")  # common/common.h:332

    @property
    def evidence(self) -> str:
        return f"spec-type {self.spec_type!r}"


class VllmDraftModel(EngineSettings):
    """vLLM's `speculative_config` of method "draft_model" (vllm/config/speculative.py,
    v1/spec_decode/draft_model.py): num_speculative_tokens greedy drafts a step from the draft
    model (draft_sample_method "greedy": v1/spec_decode/llm_base_proposer.py:437-457), verified with
    no draft probabilities. Probabilistic drafting is refused. `use_heterogeneous_vocab` true: a
    draft model with another tokenizer, mapped by token text (proposers/draft/vocab_mapping.py).
    `parallel_drafting` true: PARD, K drafts from one pass over the last sampled token and K - 1 mask
    tokens, the mask id read from the draft's config.json (proposers/draft/pard.py)."""

    FAMILY: ClassVar[str] = "draft"
    LAYOUT: ClassVar[str] = "vllm"
    METHODS: ClassVar[tuple[str, ...]] = ("draft_model",)

    method: Literal["draft_model"]
    model: str
    num_speculative_tokens: int = Field(ge=1)
    draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"  # speculative.py:634
    use_heterogeneous_vocab: bool = False  # speculative.py:496
    parallel_drafting: bool = False  # speculative.py:511; PARD (pard.py)

    @property
    def evidence(self) -> str:
        return "method 'draft_model'" + (" with parallel_drafting" if self.parallel_drafting else "")


LAYOUTS = (LlamaDraftSimple, VllmDraftModel)
