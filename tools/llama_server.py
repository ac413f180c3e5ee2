"""llama.cpp's `llama-server` as a child process on 127.0.0.1, serving a GGUF file: the real
OpenAI-compatible server the --responses-from tests (tests/helpers/serving.py) and the bench's
`engine` section (bench/sections/engine.py) start. `make setup` builds it from the
llama-cpp-python source package into site-packages/bin/."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.common.llama_cpp import binary_env, installed_binary


def llama_server_binary() -> Path:
    """`llama-server` as `make setup` installs it: site-packages/bin/ of this interpreter."""
    path = installed_binary("llama-server")
    assert path.is_file(), f"{path} is missing: run `make setup` (it builds llama.cpp's server from llama-cpp-python)"
    return path


def llama_server_env(binary: Path) -> dict:
    return binary_env(binary)


def llama_server_runs() -> bool:
    """Whether the installed llama-server starts (`make setup` builds it when not)."""
    try:
        binary = llama_server_binary()
        done = subprocess.run([str(binary), "--version"], env=llama_server_env(binary), capture_output=True, timeout=60)
    except (AssertionError, OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LlamaServer:
    """One llama-server process serving `gguf` on `port`; `extra` are more of its options."""

    def __init__(
        self, gguf: Path, log: Path, port: int | None = None, extra: tuple[str, ...] = (), env: dict | None = None
    ):
        self.gguf, self.log, self.port, self.extra = gguf, log, port or free_port(), extra
        self.env = env or {}  # more environment (LLAMA_TRACE=1: one log line per verification step)
        self.process = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120) -> LlamaServer:
        binary = llama_server_binary()
        env = {**llama_server_env(binary), **self.env}
        command = [str(binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port)]
        # One slot: with several, llama.cpp decodes requests together in one batch, and its CPU
        # kernels then round differently, so a response depends on what ran beside it (measured:
        # 2 of 6 greedy responses changed between two runs with --parallel 2). Requests beyond the
        # slot wait in the server's queue, so a client still has several in flight.
        # Threads: LLAMA_ARG_THREADS when set (the test suite's share of the cores for each worker)
        threads = os.environ.get("LLAMA_ARG_THREADS", "2")
        command += ["--ctx-size", "4096", "--parallel", "1", "--threads", threads, *self.extra]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        wait_healthy(self.url, self.process, self.log, timeout_s)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def wait_healthy(url: str, process, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"llama-server exited: {log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"llama-server at {url} not healthy after {timeout_s} s: {log.read_text()[-2000:]}")


if __name__ == "__main__":  # `make setup`: exit 0 when llama-server is built and starts
    raise SystemExit(0 if llama_server_runs() else 1)
