"""Where llama.cpp's programs are: `llama-server`, `llama-bench`, ... as llama-cpp-python installs
them when built with its tools (`make setup`: site-packages/bin/, their shared libraries in
site-packages/lib and llama_cpp/lib, not on the loader's path), or a user's own build on PATH; and
`llama-server` as a child process on 127.0.0.1 (`specreplay profile` times drafters through it; the
tests and the bench serve with it: tools/llama_server.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.common.errors import UserError


def installed_binary(name: str) -> Path:
    """`name` as llama-cpp-python installs it: site-packages/bin/ of this interpreter (maybe absent)."""
    return Path(sysconfig.get_paths()["purelib"]) / "bin" / name


def binary_env(binary: Path) -> dict:
    """The environment `binary` runs in: its installed shared libraries found beside it."""
    site = binary.parent.parent
    return {**os.environ, "LD_LIBRARY_PATH": f"{site / 'lib'}:{site / 'llama_cpp' / 'lib'}"}


def find_binary(name: str, given: str | None = None) -> Path:
    """The program `given` (a path), else `name` as `make setup` installs it, else on PATH."""
    if given:
        if not os.path.isfile(given):
            raise UserError(f"{given}: no such program; give the path of llama.cpp's {name}")
        return Path(given)
    installed = installed_binary(name)
    if installed.is_file():
        return installed
    on_path = shutil.which(name)
    if on_path is None:
        raise UserError(f"llama.cpp's {name} is not installed here: run `make setup`, or give its path")
    return Path(on_path)


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

    def start(self, timeout_s: float = 120, binary: str | None = None) -> LlamaServer:
        """The process started and answering /health (`binary`: llama-server's path, default make setup's)."""
        binary = find_binary("llama-server", binary)
        env = {**binary_env(binary), **self.env}
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
        if process.poll() is not None:
            raise UserError(f"llama-server exited (its log, {log}, ends: {log.read_text()[-2000:]})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise UserError(
        f"llama-server at {url} not healthy after {timeout_s} s (its log, {log}, ends: {log.read_text()[-2000:]})"
    )
