"""Stage events on request: the product marks its stages; a recorder (the bench) observes them.

    with timing.stage("generate", tokens=n):   # in product code: nearly free when nobody records
        ...
    with timing.recording() as times:          # in the bench: seconds and calls per stage name
        run_extract(config)
    times.seconds["generate"], times.calls["generate"]

A recorder is any object with `start(name, info)` and `stop(name, info, seconds)`; the bench's
memory sampler is one. Stages may nest. Per process, main thread only.

Stage names marked by the product:
  extract: load target, weights fingerprint, store target head, generate, capture,
           next-token distribution (inside capture), shard write, shard finish, shard close
  score:   read target head, prepare target head, load drafter, shard pass, context keys/values,
           replay anchors, drafter layers, attention, masks, lm_head, logsumexp,
           ddtree (its worker thread's busy time, reported by `elapsed`), ddtree wait (the
           main thread waiting for that worker: the part not overlapped with the drafter)
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StageTimes:
    """The default recorder: total seconds and call count per stage name."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def start(self, name: str, info: dict) -> None:
        pass

    def stop(self, name: str, info: dict, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1


_recorder = None


@contextmanager
def stage(name: str, **info):
    """Mark the enclosed block as stage `name` (with facts such as tokens=...) for the active
    recorder; does nothing when none is active."""
    recorder = _recorder
    if recorder is None:
        yield
        return
    recorder.start(name, info)
    started = time.perf_counter()
    try:
        yield
    finally:
        recorder.stop(name, info, time.perf_counter() - started)


def elapsed(name: str, seconds: float, **info) -> None:
    """Report `seconds` spent in stage `name` elsewhere (another thread); info carries
    elsewhere=True, so a recorder does not count that time inside the stage open here."""
    recorder = _recorder
    if recorder is not None:
        info = {**info, "elsewhere": True}
        recorder.start(name, info)
        recorder.stop(name, info, seconds)


@contextmanager
def recording(recorder=None):
    """Send every stage entered inside the block to `recorder` (a new StageTimes by default)."""
    global _recorder
    previous, _recorder = _recorder, recorder if recorder is not None else StageTimes()
    try:
        yield _recorder
    finally:
        _recorder = previous
