"""SGLang's native API: POST /generate takes `input_ids` and returns the generated ids in
`output_ids`, with `meta_info.finish_reason.type` "stop" (a stop token: the target's are sent as
`stop_token_ids`) or "length". POST /tokenize checks the vocabulary.

Penalties and min-p are neutral; temperature, top-k and top-p are SGLang's own, with a
`sampling_seed` per response. Temperature 0 is SGLang's greedy.
"""

from __future__ import annotations

from pipeline.common.sampling import Sampling
from pipeline.engines.client import EngineError
from pipeline.engines.dialect import Acceptance, Reply, Request, cut_at_length, sampling_params
from pipeline.engines.schemas import SglangGenerate, read


class Sglang:
    name = "sglang"
    owned_by = "sglang"

    def generation(self, request: Request) -> tuple[str, dict]:
        params = {"max_new_tokens": request.max_new_tokens, **sampling_params(request)}
        if request.engine_seed is not None:
            params["sampling_seed"] = request.engine_seed
        return "/generate", {"input_ids": list(request.prompt_ids), "sampling_params": params, "stream": False}

    def reply(self, data: object, where: str, request: Request) -> Reply:
        answer = read(SglangGenerate, data, where)
        finish = answer.meta_info.finish_reason.type if answer.meta_info.finish_reason else None
        if finish not in ("stop", "length"):
            raise EngineError(f"serving engine {where}: sample {request.sample_id!r} finished with {finish!r}")
        return cut_at_length(answer.output_ids, finish == "stop", request.max_new_tokens, "its context length")

    def acceptance(self, data: object, where: str) -> Acceptance | None:
        """meta_info's spec_* counters (no per-step list: SGLang keeps only a histogram)."""
        meta = read(SglangGenerate, data, where).meta_info
        if meta.spec_verify_ct is None:
            return None
        return Acceptance(meta.spec_num_proposed_drafts or 0, meta.spec_num_correct_drafts or 0, meta.spec_verify_ct)

    def tokenize(self, text: str, model: str) -> tuple[str, dict]:
        return "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False}

    def sampling_rule(self, sampling: Sampling | None) -> str:
        if sampling is None:
            return "SGLang temperature 0 (greedy); penalties off"
        return "SGLang logits / temperature, then top-k and top-p, sampling_seed per response; penalties and min-p off"
