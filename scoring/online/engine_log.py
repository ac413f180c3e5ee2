"""llama-server's per-step counts, read from its log as it grows.

Run with the environment variable LLAMA_TRACE=1, the server prints one line per verification step
at its default verbosity, `accepted %2zu/%2zu draft tokens` (accepted drafts / drafts verified;
tools/server/server-context.cpp, the LLAMA_TRACE branch of the verification step), the last step
of a request included. A step that restored a checkpoint (targets that cannot drop part of their
cache) says `(restore checkpoint)` and is re-counted on the next line: such logs are refused.
With `-lv 5` the server also prints `accepted %d/%d draft tokens, new n_tokens = %d`, which is
not read (it is missing on a request's last step).
"""

from __future__ import annotations

import os
import re

from pipeline.common.errors import UserError

STEP_LINE = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens(\s*\(restore checkpoint\))?\s*$")


def parse_steps(text: str, where: str) -> list[tuple[int, int]]:
    """(accepted, drafted) per verification step in `text`, in order."""
    steps = []
    for line in text.splitlines():
        found = STEP_LINE.search(line)
        if found is None:
            continue
        if found.group(3):
            raise UserError(
                f"{where}: the server restored a checkpoint after a partial acceptance (a target whose cache "
                "cannot drop part of a sequence); its per-step lines count those steps twice and are not compared: "
                "drop --engine-log to compare totals only"
            )
        steps.append((int(found.group(1)), int(found.group(2))))
    return steps


class LogTail:
    """The lines a log file gained since the last `mark`: one request's steps when requests run one
    at a time."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise UserError(f"--engine-log {path}: no such file (the server's stderr, run with LLAMA_TRACE=1)")
        self.path = path
        self.offset = os.path.getsize(path)

    def mark(self) -> None:
        self.offset = os.path.getsize(self.path)

    def steps_since_mark(self) -> list[tuple[int, int]]:
        with open(self.path, "rb") as log:
            log.seek(self.offset)
            text = log.read().decode("utf-8", errors="replace")
        return parse_steps(text, f"--engine-log {self.path}")
