"""What every engine module provides, and the two records that pass through them: the Request
extract makes for one response and the Reply an engine gives back, both in token ids.

An engine module (llamacpp.py, vllm.py, sglang.py) maps a Request onto that engine's documented
generation endpoint, which takes the prompt as token ids and returns the response as token ids
(never text: decoding and re-encoding text changes tokens), and maps its answer onto a Reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pipeline.common.sampling import Sampling

SEED_MASK = 0x7FFFFFFF  # every engine takes a seed of 31 bits (llama.cpp's is a uint32)


@dataclass(frozen=True)
class Request:
    """One response to generate: the prompt's token ids and the extract's settings."""

    sample_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: list[int]  # the target's stop tokens
    sampling: Sampling | None  # None: greedy
    seed: int | None  # sampled: the draw's seed (pipeline/extract/generate.py draw_seed)
    model: str  # the served model's name

    @property
    def engine_seed(self) -> int | None:
        return None if self.seed is None else self.seed & SEED_MASK


def sampling_params(request: Request) -> dict:
    """The sampling fields vLLM and SGLang share, by the same names: the extract's rule and
    nothing else (penalties and min-p off, top-k -1 = off, stop at the target's stop ids)."""
    sampling = request.sampling
    return {
        "temperature": 0.0 if sampling is None else sampling.temperature,
        "top_p": 1.0 if sampling is None else sampling.top_p,
        "top_k": -1 if sampling is None or sampling.top_k == 0 else sampling.top_k,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "stop_token_ids": list(request.stop_ids),
        "skip_special_tokens": False,
    }


@dataclass(frozen=True)
class Reply:
    """An engine's response in token ids, and how it ended."""

    token_ids: list[int]
    stopped: bool  # ended on a stop token (True) or at max_new_tokens (False)
    cut: str | None = None  # the server's own limit ended it early ("its context of 2048 tokens"); None: not cut


@dataclass(frozen=True)
class Acceptance:
    """What an engine reports of its own speculative decoding for one response, when it does
    (docs/walk-rules.md#what-engines-report): totals, and per verification step where it says."""

    drafted: int  # draft tokens proposed (llama.cpp draft_n, vLLM num_draft_tokens, SGLang proposed)
    accepted: int  # draft tokens accepted, as the engine counts them
    steps: int | None = None  # verification steps, when reported
    per_step_accepted: tuple[int, ...] | None = None  # vLLM's detailed mode; llama.cpp's LLAMA_TRACE log
    per_step_drafted: tuple[int, ...] | None = None


class Dialect(Protocol):
    name: str  # "llama.cpp", "vllm", "sglang"
    owned_by: str  # what GET /v1/models says in `owned_by`

    def generation(self, request: Request) -> tuple[str, dict]:
        """(path, JSON body) of the request that generates one response."""

    def reply(self, data: object, where: str, request: Request) -> Reply:
        """The answer to `generation` as a Reply (EngineError when it is not one)."""

    def acceptance(self, data: object, where: str) -> Acceptance | None:
        """The engine's own speculative-decoding counts in its answer; None when it reports none."""

    def tokenize(self, text: str, model: str) -> tuple[str, dict]:
        """(path, JSON body) that tokenises `text` without adding special tokens."""

    def sampling_rule(self, sampling: Sampling | None) -> str:
        """How this engine draws each token with the settings extract sends (the manifest says it)."""


def cut_at_length(tokens: list[int], stopped: bool, max_new_tokens: int, limit: str) -> Reply:
    """A Reply; one that neither stopped nor reached max_new_tokens was cut by the server
    (`limit` names the server's limit in the message)."""
    short = not stopped and len(tokens) < max_new_tokens
    return Reply(list(tokens), stopped, f"{limit} ({len(tokens)} of {max_new_tokens} tokens)" if short else None)
