"""How the "next:" hints name the console script: as the user can type it.

`make setup` installs `specreplay` into .venv/bin, which is not on PATH until the venv is
activated; a hint that prints a bare `specreplay` then fails with "command not found".
"""

from __future__ import annotations

import os
import shutil
import sys


def program() -> str:
    """'specreplay' when that resolves to the running script, else the script's path relative
    to the working directory ('.venv/bin/specreplay'), else 'python -m specreplay'."""
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.basename(script) != "specreplay":
        return f"{os.path.relpath(sys.executable)} -m specreplay" if sys.executable else "python -m specreplay"
    on_path = shutil.which("specreplay")
    if on_path and os.path.realpath(on_path) == os.path.realpath(script):
        return "specreplay"
    relative = os.path.relpath(script)
    return relative if not relative.startswith("..") else script


REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_repository() -> bool:
    """Whether the working directory is the repository's root, where `make score` and data/ work;
    elsewhere a hint naming them fails."""
    return os.path.realpath(os.getcwd()) == os.path.realpath(REPOSITORY)


def results_dir() -> str:
    """Where a hint puts results: the Makefile's data/results in the repository, results/ elsewhere."""
    return "data/results" if in_repository() else "results"
