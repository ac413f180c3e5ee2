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


def ask(url: str, prompt: list[int], n_predict: int) -> None:
    """One greedy completion of token ids, nothing cached (every request drafts from scratch)."""
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "cache_prompt": False}
    request = urllib.request.Request(
        url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        answer.read()


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


def served_pass(family: str, drafter: str, target: str, drafts: int, setting: dict) -> dict:
    """The profile's drafter row: one pass of the drafter at `drafts` drafts a step, timed by the server.
    `setting`: context (prompt tokens), requests, n_predict, threads, extra (more server options), work."""
    log = Path(setting["work"]) / f"server-{family}-{drafts}.log"
    options = (*spec_options(family, drafter, target, drafts), "--threads", str(setting["threads"]), *setting["extra"])
    server = LlamaServer(Path(target), log, extra=(*options, "-lv", str(TRACE_LEVEL))).start()
    try:
        rng = random.Random(0)
        for _ in range(1 + setting["requests"]):  # the first: the warm-up
            ask(server.url, [rng.randrange(300, 700) for _ in range(setting["context"])], setting["n_predict"])
        wait_for_statistics(log, SPEC_TYPES[family], 1 + setting["requests"])
    finally:
        server.stop()
    seconds = draft_call_seconds(log, SPEC_TYPES[family])
    if drafting(family) == "block":
        return {"family": family, "batch": 1, "tokens": drafts + 1, "seconds": seconds}
    return {"family": family, "batch": 1, "tokens": 1, "seconds": seconds / drafts}
