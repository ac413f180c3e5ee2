"""The declared shapes of what serving engines answer (pipeline/common/schema.py): only the
fields extract reads, everything else ignored. A reply that breaks one is an EngineError naming
the server and the field, never a KeyError deep in a worker thread."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pipeline.common.schema import Count, Schema, validate
from pipeline.engines.client import EngineError

TokenIds = list[Count]


class ModelCard(Schema):
    """One entry of GET /v1/models (OpenAI): `owned_by` names the engine ("llamacpp", "vllm",
    "sglang"); llama.cpp adds `meta.n_vocab`, vLLM `max_model_len`."""

    id: Annotated[str, Field(min_length=1)]
    owned_by: str | None = None
    meta: dict | None = None
    max_model_len: Count | None = None


class ModelList(Schema):
    data: list[ModelCard] = Field(description="the models the server serves")


class Tokenized(Schema):
    """POST /tokenize of llama.cpp, vLLM and SGLang: {"tokens": [ids]}."""

    tokens: TokenIds


class LlamaCppTimings(Schema):
    """llama.cpp's `timings`: draft_n / draft_n_accepted appear once the request drafted anything
    (tools/server/server-common.cpp server_slot_stats::to_json)."""

    draft_n: Count | None = None
    draft_n_accepted: Count | None = None


class LlamaCppCompletion(Schema):
    """POST /completion of llama.cpp's server with "return_tokens": true."""

    tokens: TokenIds = Field(description="the generated token ids (sent with return_tokens)")
    stop_type: str = Field(description='"eos", "limit", "word" or "none"')
    truncated: bool = False  # the context (n_ctx) ran out
    tokens_predicted: Count | None = None
    timings: LlamaCppTimings | None = None


class VllmChoice(Schema):
    token_ids: TokenIds | None = Field(description="the generated token ids (sent with return_token_ids)")
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None


class VllmSpecMetrics(Schema):
    """vLLM's per-request speculative-decoding metrics (served with --per-request-spec-decode-metrics
    summary|detailed; v1/metrics/stats.py RequestSpecDecodeMetrics.to_dict): the per-step lists in
    detailed mode only."""

    num_spec_steps: Count
    num_accepted_draft_tokens: Count
    num_draft_tokens: Count
    per_step_accepted: list[Count] | None = None
    per_step_drafted: list[Count] | None = None


class VllmMetrics(Schema):
    speculative_decoding: VllmSpecMetrics | None = None


class VllmCompletion(Schema):
    """POST /v1/completions of vLLM with "return_token_ids": true."""

    choices: Annotated[list[VllmChoice], Field(min_length=1, max_length=1)]
    metrics: VllmMetrics | None = None


class SglangFinish(Schema):
    type: str = Field(description='"stop", "length" or "abort"')


class SglangMeta(Schema):
    """`meta_info`; the spec_* counters come once a request with speculative decoding finishes
    (srt/managers/tokenizer_manager.py): verify steps, accepted drafts (not cut at the stop), proposed."""

    finish_reason: SglangFinish | None = None
    spec_verify_ct: Count | None = None
    spec_num_correct_drafts: Count | None = None
    spec_num_proposed_drafts: Count | None = None


class SglangGenerate(Schema):
    """POST /generate of SGLang (native API) given input_ids."""

    output_ids: TokenIds
    meta_info: SglangMeta


def read(model, data, where: str):
    """`data` as `model`, or an EngineError naming the server's answer and the field."""
    return validate(model, data, f"serving engine answer from {where}", error_class=EngineError)
