"""vLLM's OpenAI-compatible server: POST /v1/completions takes the prompt as token ids and, with
"return_token_ids": true, returns the generated ids in `choices[0].token_ids`; `finish_reason`
is "stop" (a stop token: the target's are sent as `stop_token_ids`) or "length". POST /tokenize
checks the vocabulary.

Penalties and min-p are neutral; temperature, top-k and top-p are vLLM's own (logits /
temperature, then top-k and top-p), a seed per response. Temperature 0 is vLLM's greedy.
"""

from __future__ import annotations

from pipeline.common.sampling import Sampling
from pipeline.engines.client import EngineError
from pipeline.engines.dialect import Acceptance, Reply, Request, cut_at_length, sampling_params
from pipeline.engines.schemas import VllmCompletion, read


class Vllm:
    name = "vllm"
    owned_by = "vllm"

    def generation(self, request: Request) -> tuple[str, dict]:
        body = {
            "model": request.model,
            "prompt": list(request.prompt_ids),
            "max_tokens": request.max_new_tokens,
            "return_token_ids": True,
            **sampling_params(request),
            "n": 1,
        }
        if request.engine_seed is not None:
            body["seed"] = request.engine_seed
        return "/v1/completions", body

    def reply(self, data: object, where: str, request: Request) -> Reply:
        choice = read(VllmCompletion, data, where).choices[0]
        if choice.token_ids is None:
            raise EngineError(
                f"serving engine {where} returned no token_ids for sample {request.sample_id!r}; "
                f"vLLM returns them from version 0.10.2 on (return_token_ids), upgrade the server"
            )
        if choice.finish_reason not in ("stop", "length"):
            raise EngineError(
                f"serving engine {where}: sample {request.sample_id!r} finished with {choice.finish_reason!r}"
            )
        return cut_at_length(
            choice.token_ids, choice.finish_reason == "stop", request.max_new_tokens, "its max_model_len"
        )

    def acceptance(self, data: object, where: str) -> Acceptance | None:
        """metrics.speculative_decoding (--per-request-spec-decode-metrics; per-step lists in detailed mode)."""
        metrics = read(VllmCompletion, data, where).metrics
        spec = None if metrics is None else metrics.speculative_decoding
        if spec is None:
            return None
        per_step = (spec.per_step_accepted, spec.per_step_drafted)
        return Acceptance(
            spec.num_draft_tokens,
            spec.num_accepted_draft_tokens,
            spec.num_spec_steps,
            *(None if values is None else tuple(values) for values in per_step),
        )

    def tokenize(self, text: str, model: str) -> tuple[str, dict]:
        return "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False}

    def sampling_rule(self, sampling: Sampling | None) -> str:
        if sampling is None:
            return "vLLM temperature 0 (greedy); penalties off"
        return "vLLM logits / temperature, then top-k and top-p, seeded per response; penalties and min-p off"
