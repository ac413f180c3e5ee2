"""Each engine's own speculative-decoding counts, read from its answer as its source shapes it
(docs/walk-rules.md): llama.cpp's timings (tools/server/server-common.cpp), vLLM's
metrics.speculative_decoding (v1/metrics/stats.py RequestSpecDecodeMetrics.to_dict, served with
--per-request-spec-decode-metrics), SGLang's meta_info spec_* counters; a malformed field is one
EngineError naming the server and the field. The llama.cpp fields are also read from a running
llama-server in tests/parity/test_engine_parity.py."""

from __future__ import annotations

import pytest

from pipeline.engines.client import EngineError
from pipeline.engines.dialect import Acceptance
from pipeline.engines.registry import DIALECTS

WHERE = "http://127.0.0.1:1"


def test_llama_cpp_timings():
    answer = {
        "tokens": [5, 6],
        "stop_type": "limit",
        "timings": {"draft_n": 12, "draft_n_accepted": 7, "predicted_n": 9},
    }
    assert DIALECTS["llama.cpp"].acceptance(answer, WHERE) == Acceptance(12, 7)
    # nothing drafted: the server leaves both fields out of timings
    answer["timings"] = {"predicted_n": 2}
    assert DIALECTS["llama.cpp"].acceptance(answer, WHERE) == Acceptance(0, 0)
    del answer["timings"]
    assert DIALECTS["llama.cpp"].acceptance(answer, WHERE) is None


def test_vllm_detailed_per_request_metrics():
    spec = {
        "mean_acceptance_length": 2.5,
        "draft_acceptance_rate": 0.5,
        "acceptance_histogram": [0, 1, 1, 0],
        "num_spec_steps": 2,
        "num_accepted_draft_tokens": 3,
        "num_draft_tokens": 6,
        "num_spec_tokens": 3,
        "per_step_accepted": [1, 2],
        "per_step_drafted": [3, 3],
    }
    answer = {"choices": [{"token_ids": [1, 2], "finish_reason": "length"}], "metrics": {"speculative_decoding": spec}}
    assert DIALECTS["vllm"].acceptance(answer, WHERE) == Acceptance(6, 3, 2, (1, 2), (3, 3))
    del spec["per_step_accepted"], spec["per_step_drafted"]  # summary mode: totals only
    assert DIALECTS["vllm"].acceptance(answer, WHERE) == Acceptance(6, 3, 2)
    assert DIALECTS["vllm"].acceptance({"choices": answer["choices"]}, WHERE) is None


def test_sglang_meta_info():
    meta = {"finish_reason": {"type": "length"}, "spec_verify_ct": 4, "spec_num_correct_drafts": 5}
    meta["spec_num_proposed_drafts"] = 12
    answer = {"output_ids": [1, 2, 3], "meta_info": meta}
    assert DIALECTS["sglang"].acceptance(answer, WHERE) == Acceptance(12, 5, 4)
    assert DIALECTS["sglang"].acceptance({"output_ids": [1], "meta_info": {}}, WHERE) is None


def test_a_malformed_count_names_the_server_and_the_field():
    answer = {"choices": [{"token_ids": [1], "finish_reason": "length"}], "metrics": {"speculative_decoding": {}}}
    with pytest.raises(EngineError, match="num_spec_steps") as error:
        DIALECTS["vllm"].acceptance(answer, WHERE)
    assert WHERE in str(error.value)
