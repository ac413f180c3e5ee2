"""llama.cpp's server (`llama-server`): POST /completion takes the prompt as token ids and, with
"return_tokens": true, returns the generated token ids in `tokens`; `stop_type` says why it
stopped ("eos": an end-of-generation token, "limit": n_predict or the server's own limits) and
`truncated` that the context (n_ctx) ran out. POST /tokenize checks the vocabulary.

Every sampler that would change the target's distribution is switched off; the chain is
temperature -> top_k -> top_p (the reference's order, pipeline/common/sampling.py), then a
draw seeded per response. Temperature 0 keeps only the largest logit: the argmax. The server
does not reuse cached prompts (`cache_prompt`: false), so a response never depends on which
request came before it.
"""

from __future__ import annotations

from pipeline.common.sampling import Sampling
from pipeline.engines.client import EngineError
from pipeline.engines.dialect import Acceptance, Reply, Request, cut_at_length
from pipeline.engines.schemas import LlamaCppCompletion, read

NEUTRAL = {
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_penalty": 1.0,
    "repeat_last_n": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "mirostat": 0,
    "dynatemp_range": 0.0,
    "n_probs": 0,
    "ignore_eos": False,
}


class LlamaCpp:
    name = "llama.cpp"
    owned_by = "llamacpp"

    def generation(self, request: Request) -> tuple[str, dict]:
        sampling = request.sampling
        body = {
            "prompt": list(request.prompt_ids),
            "n_predict": request.max_new_tokens,
            "return_tokens": True,
            "cache_prompt": False,
            "stream": False,
            "samplers": ["temperature"] if sampling is None else ["temperature", "top_k", "top_p"],
            "temperature": 0.0 if sampling is None else sampling.temperature,
            "top_k": 0 if sampling is None else sampling.top_k,  # 0: off
            "top_p": 1.0 if sampling is None else sampling.top_p,
            **NEUTRAL,
        }
        if request.engine_seed is not None:
            body["seed"] = request.engine_seed
        return "/completion", body

    def reply(self, data: object, where: str, request: Request) -> Reply:
        answer = read(LlamaCppCompletion, data, where)
        if answer.stop_type not in ("eos", "limit"):
            raise EngineError(
                f"serving engine {where}: sample {request.sample_id!r} stopped with stop_type "
                f"{answer.stop_type!r} (extract sends no stop words); is another client changing the server's settings?"
            )
        if answer.truncated:
            return Reply(list(answer.tokens), False, f"its context size n_ctx ({len(answer.tokens)} tokens generated)")
        return cut_at_length(answer.tokens, answer.stop_type == "eos", request.max_new_tokens, "its n_predict limit")

    def acceptance(self, data: object, where: str) -> Acceptance | None:
        """timings.draft_n / draft_n_accepted; both absent when nothing was drafted. Per-step
        counts are in the server's log only (scoring/online/engine_log.py)."""
        timings = read(LlamaCppCompletion, data, where).timings
        if timings is None:
            return None
        return Acceptance(timings.draft_n or 0, timings.draft_n_accepted or 0)

    def tokenize(self, text: str, model: str) -> tuple[str, dict]:
        return "/tokenize", {"content": text, "add_special": False, "parse_special": True}

    def sampling_rule(self, sampling: Sampling | None) -> str:
        if sampling is None:
            return "llama.cpp samplers [temperature] at 0: the argmax; penalties off"
        return (
            "llama.cpp samplers temperature -> top_k -> top_p, then a draw seeded per response; "
            "min-p, typical-p, penalties, DRY, XTC and mirostat off"
        )
