"""What `specreplay log` (and `watch`) wrote, read back by the tool's own reader."""

from __future__ import annotations


def read_tensorboard(logdir, prefix: str = "specreplay/") -> dict[int, dict[str, float]]:
    """step -> {tag: value} for the tags starting with `prefix`, from every event file in
    logdir, by tensorboard's own reader; a tag logged twice at one step is a failure."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={SCALARS: 0})
    acc.Reload()
    found: dict[int, dict[str, float]] = {}
    for tag in (t for t in acc.Tags()["scalars"] if t.startswith(prefix)):
        for event in acc.Scalars(tag):
            assert tag not in found.setdefault(event.step, {}), f"{tag} logged twice at step {event.step}"
            found[event.step][tag] = event.value
    return found
