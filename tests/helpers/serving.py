"""Real HTTP servers for the --responses-from tests, all on 127.0.0.1 and stopped by the tests:
llama.cpp's `llama-server` serving the bundled SmolLM2-135M GGUF (tools/llama_server.py, shared
with the bench), a counting proxy in front of it, and tiny servers that answer with errors."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tools.llama_server import LlamaServer, free_port

__all__ = ["FakeServer", "LlamaServer", "Proxy", "free_port", "llamacpp_like"]


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


def llamacpp_like(tokenizer, shift: int = 0, owned_by: str = "llamacpp", n_vocab: int | None = None, completion=None):
    """FakeServer routes of a llama.cpp server: GET /v1/models (model "smol", meta.n_vocab: `n_vocab`
    or the tokenizer's size), POST /tokenize by `tokenizer` (each id + `shift`), and POST /completion
    answered by `completion(body)` -> (status, bytes) when given."""

    def tokenize(body):
        ids = tokenizer(json.loads(body)["content"], add_special_tokens=False).input_ids
        return 200, json.dumps({"tokens": [t + shift for t in ids]}).encode()

    meta = {"n_vocab": n_vocab or len(tokenizer)}
    models = json.dumps({"data": [{"id": "smol", "owned_by": owned_by, "meta": meta}]}).encode()
    routes = {("GET", "/v1/models"): lambda body: (200, models), ("POST", "/tokenize"): tokenize}
    if completion is not None:
        routes[("POST", "/completion")] = completion
    return routes
