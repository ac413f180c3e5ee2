"""The stored prompts sent to a serving engine one at a time, greedy, with the extract's budget:
the engine's response and its own speculative-decoding counts per request (and, from llama-server's
log, per verification step). One at a time, so that a log's new lines are that request's."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pipeline.engines.client import Client, EngineError, Retry
from pipeline.engines.dialect import Acceptance, Dialect, Request
from pipeline.engines.registry import pick_dialect, pick_model, served_models
from scoring.online.engine_log import LogTail

LOG_WAIT_S = 5.0  # llama.cpp writes its log from a worker thread: the last lines may follow the answer


@dataclass(frozen=True)
class Online:
    """One request's outcome at the engine."""

    token_ids: list[int]
    acceptance: Acceptance | None  # None: the engine reported nothing (no speculative decoding?)
    steps: list[tuple[int, int]] | None  # (accepted, drafted) per step, when the engine or its log says


class Engine:
    """A served model and its dialect, with the optional log of its per-step lines."""

    def __init__(self, url: str, engine: str, log: str | None, timeout_s: float):
        # no retry with a log: a retried request would leave a half request's steps in it
        self.client = Client(url, Retry(timeout=timeout_s, retries=3 if log is None else 0))
        found = [(self.client, served_models(self.client))]
        self.dialect: Dialect = pick_dialect(found, engine)
        self.model = pick_model(found, None)
        self.tail = None if log is None else LogTail(log)

    def ask(self, sample_id: str, prompt: list[int], max_new_tokens: int, stop_ids: list[int]) -> Online:
        request = Request(sample_id, prompt, max_new_tokens, stop_ids, None, None, self.model)
        where = self.client.url
        if self.tail is not None:
            self.tail.mark()
        data = self.client.post(*self.dialect.generation(request))
        reply = self.dialect.reply(data, where, request)
        acceptance = self.dialect.acceptance(data, where)
        return Online(reply.token_ids, acceptance, self.steps(acceptance))

    def steps(self, acceptance: Acceptance | None) -> list[tuple[int, int]] | None:
        """Per-step counts: the engine's own lists (vLLM's detailed mode), else the log's, else None."""
        if acceptance is not None and acceptance.per_step_accepted is not None:
            return list(zip(acceptance.per_step_accepted, acceptance.per_step_drafted or ()))
        return None if self.tail is None else self.logged_steps(acceptance)

    def logged_steps(self, acceptance: Acceptance | None) -> list[tuple[int, int]]:
        """The request's logged steps, waiting briefly until they add up to the engine's totals."""
        deadline = time.monotonic() + LOG_WAIT_S
        while True:
            steps = self.tail.steps_since_mark()
            total = (sum(a for a, _ in steps), sum(d for _, d in steps))
            if acceptance is None or total == (acceptance.accepted, acceptance.drafted) or time.monotonic() > deadline:
                return steps
            time.sleep(0.05)


def check_engine_reports(engine: Engine, first: Online, url: str) -> None:
    """The first answer must carry the engine's counts; otherwise say how to turn them on."""
    if first.acceptance is not None:
        return
    how = {
        "llama.cpp": "serve a drafter (-md drafter.gguf --spec-type ...) or an n-gram --spec-type",
        "vllm": "serve with --speculative-config and --per-request-spec-decode-metrics detailed",
        "sglang": "serve with --speculative-algorithm",
    }[engine.dialect.name]
    raise EngineError(f"serving engine {url} reported no speculative-decoding counts for the first request: {how}")
