"""HTTP to a serving engine: JSON in, JSON out, with a timeout per request and retries with
exponential backoff; every failure that outlives its retries is one EngineError line naming
the server and what it said.

Retried (the server may be busy or restarting): refused or dropped connections, timeouts,
HTTP 429 and 5xx. Not retried (asking again gives the same answer): any other 4xx, and a body
that is not JSON. Standard library only (urllib), so stage 1 needs no HTTP package.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from pipeline.common.errors import UserError

RETRIED_STATUS = (429, 500, 502, 503, 504)
MAX_BODY_SHOWN = 200  # characters of a server's error body quoted in a message


class EngineError(UserError):
    """A serving engine that cannot be used: unreachable, refusing, or answering garbage."""


class Unreachable(EngineError):
    """No HTTP answer at all (refused, reset, timed out) after every retry."""


class Refused(EngineError):
    """An HTTP error status that another try would not change (`status`: 400, 404, ...)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Retry:
    """How hard to try: `timeout` seconds per request, `retries` more tries after the first,
    waiting `backoff` * 2**n seconds before try n + 1 (capped at `max_wait`)."""

    timeout: float = 600.0
    retries: int = 3
    backoff: float = 0.5
    max_wait: float = 30.0

    def wait(self, attempt: int) -> float:
        return min(self.max_wait, self.backoff * 2**attempt)


class Client:
    """One engine's base URL (`http://host:port`, any trailing `/v1` removed)."""

    def __init__(self, url: str, retry: Retry = Retry()):
        self.url = base_url(url)
        self.retry = retry

    def get(self, path: str) -> object:
        return self._call("GET", path, None)

    def post(self, path: str, body: dict) -> object:
        return self._call("POST", path, body)

    def _call(self, method: str, path: str, body: dict | None) -> object:
        """The JSON answer; retried as the module docstring says, then EngineError."""
        last = None
        for attempt in range(self.retry.retries + 1):
            if attempt:
                time.sleep(self.retry.wait(attempt - 1))
            try:
                return self._once(method, path, body)
            except _Transient as error:
                last = error
        raise last.final(self.url + path, self.retry.retries + 1)

    def _once(self, method: str, path: str, body: dict | None) -> object:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.retry.timeout) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as error:
            raise http_error(self.url + path, error) from None
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as error:
            raise _Transient(None, reason(error)) from None
        return parse_json(raw, method, self.url + path)


class _Transient(Exception):
    """A failure worth another try; `final` is what the user sees once the tries run out."""

    def __init__(self, status: int | None, message: str):
        self.status, self.message = status, message

    def final(self, where: str, tries: int) -> EngineError:
        if self.status is None:
            return Unreachable(
                f"serving engine {where} is unreachable ({self.message}; {tries} tries); start the server, "
                f"check --responses-from, or raise --request-timeout"
            )
        return EngineError(f"serving engine {where} answered HTTP {self.status} {tries} times: {self.message}")


def http_error(where: str, error: urllib.error.HTTPError) -> Exception:
    """A retried status as _Transient, any other as EngineError quoting the server's message."""
    message = server_message(error.read())
    if error.code in RETRIED_STATUS:
        return _Transient(error.code, message)
    return Refused(f"serving engine {where} refused the request (HTTP {error.code}): {message}", error.code)


def server_message(raw: bytes) -> str:
    """What a server says in an error body: OpenAI-style {"error": {"message"}}, {"message"},
    {"detail"}, else the text itself, shortened."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        inner = obj.get("error", obj)
        inner = inner if isinstance(inner, dict) else {"message": inner}
        text = str(inner.get("message") or inner.get("detail") or obj.get("detail") or text)
    text = " ".join(text.split())
    return (text[:MAX_BODY_SHOWN] + "...") if len(text) > MAX_BODY_SHOWN else (text or "(empty body)")


def reason(error: BaseException) -> str:
    inner = getattr(error, "reason", error)
    return f"{type(inner).__name__}: {inner}" if str(inner) else type(inner).__name__


def parse_json(raw: bytes, method: str, where: str) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        shown = raw[:80].decode("utf-8", errors="replace")
        raise EngineError(
            f"serving engine {where} answered {method} with something that is not JSON ({shown!r}); "
            f"is --responses-from the address of an OpenAI-compatible server (vLLM, SGLang, llama.cpp)?"
        ) from None


def base_url(url: str) -> str:
    """'http://h:8000/v1/' -> 'http://h:8000': every engine path is asked for from the root."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        raise UserError(f"--responses-from {url!r} is not a URL; give one like http://127.0.0.1:8080")
    return url.removesuffix("/v1")
