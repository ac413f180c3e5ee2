"""Real HTTP servers for the --responses-from tests, all on 127.0.0.1 and stopped by the tests:
llama.cpp's `llama-server` (built by `make setup` from the llama-cpp-python source package)
serving the bundled SmolLM2-135M GGUF, a counting proxy in front of it, and tiny servers that
answer with errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def llama_server_binary() -> Path:
    """`llama-server` as `make setup` installs it: site-packages/bin/ of this interpreter."""
    path = Path(sysconfig.get_paths()["purelib"]) / "bin" / "llama-server"
    assert path.is_file(), f"{path} is missing: run `make setup` (it builds llama.cpp's server from llama-cpp-python)"
    return path


def llama_server_env(binary: Path) -> dict:
    """Its shared libraries are installed beside it (site-packages/lib, llama_cpp/lib), not on the loader's path."""
    site = binary.parent.parent
    return {**os.environ, "LD_LIBRARY_PATH": f"{site / 'lib'}:{site / 'llama_cpp' / 'lib'}"}


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

    def __init__(self, gguf: Path, log: Path, port: int | None = None, extra: tuple[str, ...] = ()):
        self.gguf, self.log, self.port, self.extra = gguf, log, port or free_port(), extra
        self.process = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120) -> LlamaServer:
        binary = llama_server_binary()
        env = llama_server_env(binary)
        command = [str(binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port)]
        # One slot: with several, llama.cpp decodes requests together in one batch, and its CPU
        # kernels then round differently, so a response depends on what ran beside it (measured:
        # 2 of 6 greedy responses changed between two runs with --parallel 2). Requests beyond the
        # slot wait in the server's queue, so a client still has several in flight.
        command += ["--ctx-size", "4096", "--parallel", "1", "--threads", "2", *self.extra]
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


class Proxy:
    """A counting HTTP proxy on 127.0.0.1 in front of `upstream` (settable, for a restarted server):
    `requests` lists every (method, path, JSON body or None, upstream status); `most_in_flight` the
    most requests it held at once; `after_post(n)` runs after the n-th POST to `hook_path` was answered."""

    def __init__(self, upstream: str, hook_path: str = "/completion", after_post=None):
        self.upstream, self.hook_path, self.after_post = upstream, hook_path, after_post
        self.requests: list[list] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def posts(self, path: str, status: int | None = None) -> list:
        """Bodies of the POSTs to `path` (those the upstream answered with `status`, when given)."""
        return [
            body for method, p, body, got in self.requests if method == "POST" and p == path and status in (None, got)
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                proxy.forward(self, "GET", None)

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                proxy.forward(self, "POST", raw)

        return Handler

    def forward(self, handler, method: str, raw: bytes | None) -> None:
        record = [method, handler.path, None if raw is None else json.loads(raw), None]
        with self.lock:
            self.requests.append(record)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            posts = len(self.posts(self.hook_path)) if method == "POST" and handler.path == self.hook_path else None
        try:
            status, body = self._upstream(method, handler.path, raw)
            record[3] = status
        finally:
            with self.lock:
                self.in_flight -= 1
        answer(handler, status, body)
        if posts is not None and self.after_post is not None:
            self.after_post(posts)

    def _upstream(self, method: str, path: str, raw: bytes | None) -> tuple[int, bytes]:
        request = urllib.request.Request(
            self.upstream + path, data=raw, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()
        except (urllib.error.URLError, ConnectionError) as error:
            return 502, json.dumps({"error": {"message": f"upstream down: {error}"}}).encode()


def answer(handler, status: int, body: bytes, content_type: str = "application/json") -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class FakeServer:
    """A tiny HTTP server on 127.0.0.1: `routes` maps (method, path) to a function(body) ->
    (status, bytes); anything else is answered by `default` (e.g. every request a 500)."""

    def __init__(self, routes: dict, default=lambda body: (404, b'{"error": {"message": "not found"}}')):
        self.routes, self.default = routes, default
        self.hits: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _serve(self, method):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                fake.hits.append(f"{method} {self.path}")
                status, body = fake.routes.get((method, self.path), fake.default)(raw)
                answer(self, status, body)

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":  # `make setup`: exit 0 when llama-server is built and starts
    raise SystemExit(0 if llama_server_runs() else 1)
