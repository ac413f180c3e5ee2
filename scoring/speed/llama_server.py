"""A drafter's cost measured inside llama-server itself (docs/speed.md): llama-bench runs no
drafter that reads the target's features (DFlash, DSpark, EAGLE-3), so the server serves the
target with the drafter, and its own timers say how long the drafts took.

llama-server times each speculative implementation (common/speculative.cpp: t_draft_us, summed
over its draft calls) and, at trace verbosity (`-lv 4`), logs after each request
`statistics <type>: #calls(b,g,a) = B G A, ... dur(b,g,a) = b, g, a ms` (common_speculative_print_stats,
cumulative). A draft call's cost is g / G over the requests after a warm-up one: a block drafter's one pass over its block of K + 1
queries; an autoregressive drafter's K one-token passes (and its catch-up on the accepted tokens),
so one pass is g / (G K).
"""

from __future__ import annotations

import json
import random
import re
import time
import urllib.request
from pathlib import Path

from pipeline.common.errors import UserError
from pipeline.common.llama_cpp import LlamaServer
from scoring.speed.shapes import drafting

# family -> llama-server's --spec-type serving it
SPEC_TYPES = {
    "dflash": "draft-dflash",
    "dflash2": "draft-dflash",
    "dspark": "draft-dspark",
    "eagle3": "draft-eagle3",
    "mtp": "draft-mtp",
    "draft": "draft-simple",
}
TRACE_LEVEL = 4  # common/log.h LOG_LEVEL_TRACE: the statistics lines are LOG_TRC
STATISTICS = re.compile(
    r"statistics\s+(\S+): #calls\(b,g,a\) =\s+(\d+)\s+(\d+)\s+(\d+).*?dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms"
)


def spec_options(family: str, drafter: str, target: str, drafts: int) -> tuple[str, ...]:
    """llama-server's options serving `drafter` (an MTP head lives in the target's GGUF: no -md)."""
    if family not in SPEC_TYPES:
        raise UserError(f"--serve {family}=...: llama-server serves no {family!r} drafter ({', '.join(SPEC_TYPES)})")
    model = () if family == "mtp" else ("-md", drafter)
    return (*model, "--spec-type", SPEC_TYPES[family], "--spec-draft-n-max", str(drafts))


def ask(url: str, prompt: list[int], n_predict: int) -> dict:
    """One greedy completion of token ids, nothing cached (every request drafts from scratch): its `timings`."""
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "cache_prompt": False}
    request = urllib.request.Request(
        url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.loads(answer.read())["timings"]


def statistics(log: Path, spec_type: str) -> list[re.Match]:
    return [m for m in STATISTICS.finditer(log.read_text(errors="replace")) if m.group(1) == spec_type]


def wait_for_statistics(log: Path, spec_type: str, count: int, timeout_s: float = 30) -> None:
    """Until the log holds `count` statistics lines (the server logs from its own thread, after the
    answer may have left)."""
    deadline = time.monotonic() + timeout_s
    while len(statistics(log, spec_type)) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def draft_call_seconds(log: Path, spec_type: str) -> float:
    """g / G of the requests after the first, from the cumulative statistics lines of `spec_type`
    (the first request is the warm-up: graphs allocated, caches cold)."""
    found = statistics(log, spec_type)
    if len(found) < 2:
        said = [
            line for line in log.read_text(errors="replace").splitlines() if "speculative" in line and " E " in line
        ]
        why = said[-1].split(": ", 1)[-1] if said else "did it load the drafter?"
        raise UserError(f"llama-server drafted nothing with {spec_type}: {why} (its log: {log})")
    calls = int(found[-1].group(3)) - int(found[0].group(3))
    ms = float(found[-1].group(6)) - float(found[0].group(6))
    if calls <= 0:
        raise UserError(f"llama-server made no draft call of {spec_type} after the warm-up request (its log: {log})")
    return ms / calls / 1000


def served_pass(family: str, drafter: str, target: str, drafts: int, how) -> dict:
    """The profile's drafter row: one pass of the drafter at `drafts` drafts a step, timed by the server.
    `how`: a scoring.speed.measure.Measurement (context: prompt tokens, requests, n_predict, threads,
    extra: more server options, work: where the logs go)."""
    log = Path(how.work) / f"server-{family}-{drafts}.log"
    timed_requests(target, spec_options(family, drafter, target, drafts), how, log, SPEC_TYPES[family])
    seconds = draft_call_seconds(log, SPEC_TYPES[family])
    if drafting(family) == "block":
        return {"family": family, "batch": 1, "tokens": drafts + 1, "seconds": seconds}
    return {"family": family, "batch": 1, "tokens": 1, "seconds": seconds / drafts}


# --------------------------------------------------------------------------- the target's step

# llama-server's per-step line under LLAMA_TRACE (tools/server/server-context.cpp: after each
# verification), stamped minutes.seconds.milliseconds.microseconds when logged (common/log.cpp)
STEP = re.compile(
    r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I slot .*?\| task (\d+) \| accepted\s+(\d+)/\s*(\d+) draft tokens$", re.M
)
NO_MATCH = 1024  # ngram-simple's largest n-gram (common/arg.cpp): it matches nothing, so it never drafts


def step_intervals(log: Path, drafts: int) -> list[float]:
    """Seconds between consecutive step lines of a request, each ending at a step of `drafts`
    drafts, the first request (the warm-up) left out."""
    by_task: dict[int, list[tuple[float, int]]] = {}
    for m in STEP.finditer(log.read_text(errors="replace")):
        minutes, seconds, ms, us = map(int, m.group(1, 2, 3, 4))
        by_task.setdefault(int(m.group(5)), []).append((minutes * 60 + seconds + ms / 1e3 + us / 1e6, int(m.group(7))))
    tasks = sorted(by_task)[1:]
    return [b[0] - a[0] for t in tasks for a, b in zip(by_task[t], by_task[t][1:]) if b[1] == drafts]


def timed_requests(target: str, options: tuple, how, log: Path, spec_type: str | None = None) -> list[dict]:
    """The `timings` of the requests after a warm-up one, served with `options`; with a
    `spec_type`, its per-step lines (LLAMA_TRACE) and statistics are in the log when it returns."""
    env = {"LLAMA_TRACE": "1"} if spec_type else {}
    extra = (*options, "--threads", str(how.threads), *how.extra, "-lv", str(TRACE_LEVEL))
    server = LlamaServer(Path(target), log, extra=extra, env=env).start()
    try:
        rng = random.Random(0)
        answers = [
            ask(server.url, [rng.randrange(300, 700) for _ in range(how.context)], how.n_predict)
            for _ in range(1 + how.requests)
        ]
        if spec_type:
            wait_for_statistics(log, spec_type, 1 + how.requests)
    finally:
        server.stop()
    return answers[1:]


def per_token(answers: list[dict]) -> float:
    """Seconds of generation per generated token (the answers' predicted_ms over predicted_n)."""
    return sum(a["predicted_ms"] for a in answers) / 1000 / sum(a["predicted_n"] for a in answers)


def served_target(target: str, verify_draft: str, tokens: list[int], how) -> dict:
    """The profile's `verify` and `plain` rows measured inside llama-server (docs/speed.md):
    plain decoding (no drafter); one token (ngram-simple that never matches: the speculative loop's
    step without a draft); n > 1 tokens (draft-simple drafting n - 1 with `verify_draft`, every
    step's time less its draft call)."""
    work = Path(how.work)
    plain = per_token(timed_requests(target, (), how, work / "server-plain.log"))
    verify = []
    for n in tokens:
        if n == 1:
            options = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NO_MATCH))
            answers = timed_requests(target, options, how, work / "server-verify-1.log")
            if any(a.get("draft_n") for a in answers):
                raise UserError(f"llama-server drafted with ngram-simple of n {NO_MATCH} (its log: {work})")
            verify.append({"batch": 1, "tokens": 1, "seconds": per_token(answers)})
            continue
        log = work / f"server-verify-{n}.log"
        timed_requests(target, spec_options("draft", verify_draft, target, n - 1), how, log, "draft-simple")
        intervals = step_intervals(log, n - 1)
        if not intervals:
            raise UserError(f"llama-server logged no step of {n - 1} drafts (its log: {log})")
        step = sum(intervals) / len(intervals)
        verify.append({"batch": 1, "tokens": n, "seconds": step - draft_call_seconds(log, "draft-simple")})
    return {"verify": verify, "plain": [{"batch": 1, "seconds": plain}]}
