"""Stops (Ctrl-C, SIGTERM) held back while a few lines must run whole: a shard writer between
writing a batch and recording it, where a stop would leave the open shard out of step with its
own bookkeeping, and the samples kept at a stop would not be what the shard holds."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

STOPS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stops_held():
    """Run the block whole: a SIGINT or SIGTERM that arrives meanwhile is delivered to its own
    handler when the block ends. Outside the main thread (signals reach no other) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, object]] = []
    previous = {s: signal.getsignal(s) for s in STOPS}
    for s in STOPS:
        signal.signal(s, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum, frame in caught[:1]:
            deliver(previous[signum], signum, frame)


def deliver(handler, signum: int, frame) -> None:
    """Hand a held signal to the handler that was in place: a Python callable is called (Ctrl-C's
    raises KeyboardInterrupt); the default action is taken by sending the signal again."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)
