"""llama.cpp's `llama-server` as a child process on 127.0.0.1, serving a GGUF file: the real
OpenAI-compatible server the --responses-from tests (tests/helpers/serving.py) and the bench's
`engine` section (bench/sections/engine.py) start. `make setup` builds it from the
llama-cpp-python source package into site-packages/bin/."""

from __future__ import annotations

import subprocess
from pathlib import Path

from pipeline.common.llama_cpp import LlamaServer, binary_env, free_port, installed_binary, wait_healthy

__all__ = ["LlamaServer", "free_port", "llama_server_binary", "llama_server_runs", "wait_healthy"]


def llama_server_binary() -> Path:
    """`llama-server` as `make setup` installs it: site-packages/bin/ of this interpreter."""
    path = installed_binary("llama-server")
    assert path.is_file(), f"{path} is missing: run `make setup` (it builds llama.cpp's server from llama-cpp-python)"
    return path


def llama_server_runs() -> bool:
    """Whether the installed llama-server starts (`make setup` builds it when not)."""
    try:
        binary = llama_server_binary()
        done = subprocess.run([str(binary), "--version"], env=binary_env(binary), capture_output=True, timeout=60)
    except (AssertionError, OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


if __name__ == "__main__":  # `make setup`: exit 0 when llama-server is built and starts
    raise SystemExit(0 if llama_server_runs() else 1)
