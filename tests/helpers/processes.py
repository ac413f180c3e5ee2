"""Real processes for the tests: the repository root they run in, and a run killed mid-way."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root: where `python -m specreplay` runs


def kill_after_first_shard(command: list[str], out, cwd: str, timeout_s: float = 300) -> None:
    """Start `command` (an extract writing into `out`) and SIGKILL it as soon as its first shard
    lands, so a resume test finds a half-finished extract. Model load under a busy CI can be slow."""
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    try:
        while not any((Path(out) / "shards").glob("*.arrow")):
            assert process.poll() is None, process.stdout.read().decode()
            assert time.monotonic() < deadline, "no shard appeared"
            time.sleep(0.01)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()


PROGRESS = re.compile(r"samples=(\d+)/(\d+)")


def stopped_after_two_samples(command: list[str], signum: int) -> tuple[int, str]:
    """Start `command` (an extract or import printing progress lines), send `signum` once its
    progress shows two samples done; (exit code, its stderr)."""
    process = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen = []
    for line in process.stderr:
        seen.append(line)
        found = PROGRESS.search(line)
        if found and int(found.group(1)) >= 2:
            process.send_signal(signum)
            break
    rest = process.stderr.read()
    process.wait(timeout=120)
    return process.returncode, "".join(seen) + rest
