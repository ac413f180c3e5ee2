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
from dataclasses import dataclass, field
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
    """One greedy completion of token ids, nothing cached (every request drafts from scratch): the
    server's reply (`timings`, `tokens`)."""
    body = {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0.0,
        "top_k": 1,
        "cache_prompt": False,
        "return_tokens": True,
    }
    request = urllib.request.Request(
        url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.loads(answer.read())


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


# --------------------------------------------------------------------------- servers, interleaved


@dataclass
class Served:
    """One llama-server of a measurement, kept up while every server's requests go round
    (`interleave`): its options, its log, its prompts (the first a warm-up, left out of every
    figure: graphs allocated, caches cold) and, once served, its replies in order."""

    options: tuple[str, ...]
    log: Path
    prompts: list[list[int]]
    n_predict: int
    spec_type: str | None = None  # per-step lines and draft statistics logged (LLAMA_TRACE, -lv 4)
    replies: list[dict] = field(default_factory=list)

    @property
    def timings(self) -> list[dict]:
        """The `timings` of the replies after the warm-up."""
        return [reply["timings"] for reply in self.replies[1:]]


def started(served: Served, target: str, threads: int, extra: tuple[str, ...]) -> LlamaServer:
    env = {"LLAMA_TRACE": "1"} if served.spec_type else {}
    options = (*served.options, "--threads", str(threads), *extra, "-lv", str(TRACE_LEVEL))
    return LlamaServer(Path(target), served.log, extra=options, env=env).start()


def interleave(served: list[Served], target: str, threads: int, extra: tuple[str, ...] = ()) -> None:
    """Every server started, then request i of each in turn, round after round, the order rotating
    by round: the machine's drift over minutes (docs/speed.md) lands on every row alike, where
    one server after another would hand each row its own minute."""
    servers: list[LlamaServer] = []
    try:
        for one in served:
            servers.append(started(one, target, threads, extra))
        pairs = list(zip(served, servers))
        for i in range(max(len(one.prompts) for one in served)):
            turn = i % len(pairs)
            for one, server in pairs[turn:] + pairs[:turn]:
                if i < len(one.prompts):
                    one.replies.append(ask(server.url, one.prompts[i], one.n_predict))
        for one in served:
            if one.spec_type:
                wait_for_statistics(one.log, one.spec_type, len(one.prompts))
    finally:
        for server in servers:
            server.stop()


def random_prompts(how) -> list[list[int]]:
    """1 + how.requests prompts of how.context token ids (the same for every server)."""
    rng = random.Random(0)
    return [[rng.randrange(300, 700) for _ in range(how.context)] for _ in range(1 + how.requests)]


def per_token(timings: list[dict]) -> float:
    """Seconds of generation per generated token (the answers' predicted_ms over predicted_n)."""
    return sum(t["predicted_ms"] for t in timings) / 1000 / sum(t["predicted_n"] for t in timings)


# --------------------------------------------------------------------------- a drafter's pass


def drafter_server(family: str, drafter: str, target: str, drafts: int, how) -> Served:
    """The server timing `drafter` at `drafts` drafts a step. `how`: a scoring.speed.measure.Measurement
    (context: prompt tokens, requests, n_predict, work: where the logs go)."""
    log = Path(how.work) / f"server-{family}-{drafts}.log"
    options = spec_options(family, drafter, target, drafts)
    return Served(options, log, random_prompts(how), how.n_predict, SPEC_TYPES[family])


def drafter_row(family: str, drafts: int, served: Served) -> dict:
    """The profile's drafter row: one pass of the drafter at `drafts` drafts a step, timed by the server."""
    seconds = draft_call_seconds(served.log, SPEC_TYPES[family])
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


def target_servers(target: str, verify_draft: str, tokens: list[int], how) -> dict[str, Served]:
    """The servers timing the target (docs/speed.md): plain decoding (no drafter); one token
    (ngram-simple that never matches: the speculative loop's step without a draft); n > 1 tokens
    (draft-simple drafting n - 1 with `verify_draft`)."""
    work, prompts = Path(how.work), random_prompts(how)
    served = {"plain": Served((), work / "server-plain.log", prompts, how.n_predict)}
    for n in tokens:
        log = work / f"server-verify-{n}.log"
        if n == 1:
            options = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NO_MATCH))
            served["verify-1"] = Served(options, log, prompts, how.n_predict)
        else:
            options = spec_options("draft", verify_draft, target, n - 1)
            served[f"verify-{n}"] = Served(options, log, prompts, how.n_predict, "draft-simple")
    return served


def verify_row(n: int, served: Served) -> dict:
    """The profile's verify row at n tokens: the no-draft step's time a token at 1; above, every
    step's time less its draft call."""
    if n == 1:
        if any(t.get("draft_n") for t in served.timings):
            raise UserError(f"llama-server drafted with ngram-simple of n {NO_MATCH} (its log: {served.log})")
        return {"batch": 1, "tokens": 1, "seconds": per_token(served.timings)}
    intervals = step_intervals(served.log, n - 1)
    if not intervals:
        raise UserError(f"llama-server logged no step of {n - 1} drafts (its log: {served.log})")
    step = sum(intervals) / len(intervals)
    return {"batch": 1, "tokens": n, "seconds": step - draft_call_seconds(served.log, "draft-simple")}


def target_rows(served: dict[str, Served], tokens: list[int]) -> dict:
    """The profile's `verify` and `plain` rows from target_servers' replies and logs."""
    verify = [verify_row(n, served[f"verify-{n}"]) for n in tokens]
    return {"verify": verify, "plain": [{"batch": 1, "seconds": per_token(served["plain"].timings)}]}
