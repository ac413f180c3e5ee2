"""Two writers (issue: reliability under faults): a second `extract` or `score` on an output
another live process writes is refused at once, naming that process; a lock left by a process
killed with -9 is stale and taken over. Real processes through the CLI: the first writer is
stopped (SIGSTOP) once it holds the lock, so it is alive but slow for as long as the test needs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.drafters import random_drafter
from tests.helpers.processes import REPO
from tests.helpers.prompts import write_prompts
from tests.helpers.shards import tiny_shards


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "specreplay", *args]


def start_and_stop_once_locked(command: list[str], lock: Path, timeout_s: float = 120) -> subprocess.Popen:
    """Start a writer and SIGSTOP it as soon as its lock file exists: it holds the lock, alive."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while not lock.exists():
        assert process.poll() is None, process.stdout.read().decode()
        assert time.monotonic() < deadline, "the writer never took its lock"
        time.sleep(0.005)
    process.send_signal(signal.SIGSTOP)
    return process


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


def assert_refused(result: subprocess.CompletedProcess, holder: subprocess.Popen) -> None:
    assert result.returncode == 2, result.stderr
    assert f"being written by process {holder.pid}" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_second_extract_refused_then_stale_lock_taken_over(tiny_qwen3_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"Question {i}?"} for i in range(6)])
    out = tmp_path / "out"
    command = cli("extract", "--model", tiny_qwen3_dir, "--prompts", prompts, "--out", str(out), "--layer-ids", "1,3")
    command += ["--max-new-tokens", "8", "--quiet"]
    first = start_and_stop_once_locked(command, out / ".specreplay.lock")
    try:
        second = run(command)
        assert_refused(second, first)
        assert not (out / "manifest.json").exists() or "complete" in (out / "manifest.json").read_text()
    finally:
        kill(first)  # kill -9: its lock stays behind
    assert (out / ".specreplay.lock").exists()
    third = run(command)
    assert third.returncode == 0, third.stderr
    assert f"took over the lock left by process {first.pid}" in third.stderr
    assert '"complete": true' in (out / "manifest.json").read_text()
    assert not (out / ".specreplay.lock").exists()


def test_second_score_refused_then_stale_lock_taken_over(tiny_qwen3_dir, tmp_path):
    from scoring.fit import save_drafter

    records = [{"id": f"q{i}", "prompt": f"Question {i}: what is {i} + {i}?"} for i in range(3)]
    shards = tiny_shards(tmp_path, tiny_qwen3_dir, records, max_new_tokens=12)
    ckpt = save_drafter(random_drafter(seed=1), str(tmp_path / "runs" / "step_1"))
    out = tmp_path / "results"
    command = cli("score", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--quiet", "--ddtree-budgets", "4")
    first = start_and_stop_once_locked(command, out / ".runs_step_1.lock")
    try:
        second = run(command)
        # one checkpoint refused: the run goes on with the others and exits 1 ("failed")
        assert second.returncode == 1, second.stderr
        assert f"being written by process {first.pid}" in second.stderr and "Traceback" not in second.stderr
        assert not (out / "runs_step_1").exists()
    finally:
        kill(first)
    third = run(command)
    assert third.returncode == 0, third.stderr
    assert f"took over the lock left by process {first.pid}" in third.stderr
    assert (out / "runs_step_1" / "run.json").exists() and not (out / ".runs_step_1.lock").exists()
    assert not [p for p in os.listdir(out) if p.startswith(".")]  # no staging or lock left behind
