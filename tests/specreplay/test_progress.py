"""specreplay/progress.py: bars on a terminal, plain lines in a log file or a pipe."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

from specreplay.progress import Bar, Lines, bars
from tests.helpers.processes import REPO


def test_plain_lines_without_a_terminal(capsys):
    bar = Lines(95, "score tiny", unit="sample")
    for _ in range(95):
        bar.update(1, anchors_per_s=12)
    bar.close()
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and len(lines) == 10  # a line per tenth (9), then the last at close
    assert lines[0].startswith("score tiny: 10/95 sample (") and lines[0].endswith("anchors_per_s=12)")
    assert lines[-1].startswith("score tiny: 95/95 sample")


def test_the_factory_follows_stderr():
    assert bars(quiet=True) is None
    script = "import sys; from specreplay.progress import bars; print(bars(False).__name__)"
    piped = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert piped.stdout.strip() == Lines.__name__
    # stderr on a terminal (a pseudo-terminal here): the bar
    leader, follower = pty.openpty()
    try:
        tty = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=follower, check=True
        )
    finally:
        os.close(follower)
        os.close(leader)
    assert tty.stdout.decode().strip() == Bar.__name__
