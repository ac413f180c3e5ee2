"""Killed scores (issue: reliability under faults, item 4): `score` over several checkpoints and
samples is killed with -9 at random moments (seeded), again and again. After every kill each
results directory that exists is complete and equal to an uninterrupted run's; a rerun redoes
the unfinished ones and skips none that is incomplete; in the end every directory equals the
uninterrupted run's and no staging directory or lock is left."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.drafters import random_drafter
from tests.helpers.faults import content, visible_dirs
from tests.helpers.processes import REPO
from tests.helpers.shards import tiny_shards

KILLS = 5  # the CI run; bench/README.md's Faults table records a longer one


@pytest.fixture(scope="module")
def setup(tiny_qwen3_dir, tmp_path_factory):
    from scoring.fit import save_drafter

    tmp = tmp_path_factory.mktemp("killed")
    records = [{"id": f"q{i}", "prompt": f"Question {i}: what is {i} times {i}?"} for i in range(8)]
    shards = tiny_shards(tmp, tiny_qwen3_dir, records, max_new_tokens=20)
    for step in range(1, 5):
        save_drafter(random_drafter(seed=step), str(tmp / "runs" / f"step_{step}"))
    command = [sys.executable, "-m", "specreplay", "score", "--ckpt", str(tmp / "runs" / "step_*")]
    command += ["--shards", shards, "--ddtree-budgets", "4,8", "--quiet"]
    started = time.monotonic()
    reference = tmp / "reference"
    subprocess.run([*command, "--out", str(reference)], cwd=REPO, check=True, capture_output=True, timeout=300)
    return command, reference, time.monotonic() - started


def test_killed_scores_leave_only_complete_results(setup, tmp_path):
    command, reference, duration = setup
    want = {p.name: content(p) for p in visible_dirs(reference)}
    assert len(want) == 4
    out = tmp_path / "out"
    rng = random.Random(0)
    finished_before_kill = 0
    for _ in range(KILLS):
        process = subprocess.Popen(
            [*command, "--out", str(out)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        time.sleep(rng.uniform(0.2, duration))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        else:
            finished_before_kill += 1
        process.wait()
        for directory in visible_dirs(out):  # whatever exists is whole and right
            assert content(directory) == want[directory.name], directory
    done = subprocess.run([*command, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert {p.name: content(p) for p in visible_dirs(out)} == want
    assert sorted(os.listdir(out)) == sorted(want)  # no staging directory, no lock left behind
    assert finished_before_kill < KILLS  # the kills did land mid-run


def test_ctrl_c_says_what_was_kept_and_exits_130(setup, tmp_path):
    command, reference, duration = setup
    out = tmp_path / "out"
    process = subprocess.Popen([*command, "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120  # interrupt mid-replay: once it holds a results directory's lock
    while not list(out.glob(".*.lock")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "score finished before the interrupt"
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    stderr = stderr.decode()
    assert process.returncode == 130, stderr
    assert "interrupted: specreplay score stopped" in stderr and "run the same command again" in stderr, stderr
    assert "Traceback" not in stderr and "Aborted!" not in stderr, stderr
    want = {p.name: content(p) for p in visible_dirs(reference)}
    for directory in visible_dirs(out):  # what exists is whole
        assert content(directory) == want[directory.name], directory
    done = subprocess.run([*command, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(out)) == sorted(want)  # no staging directory, no lock left behind
