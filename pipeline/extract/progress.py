"""Progress of an extract's rank share: tokens generated and samples written, on the CLI's bar
or on none."""

from __future__ import annotations

from pipeline.extract.plan import (
    Item,
)


class SilentProgress:
    """The progress bar of a run nobody watches (the library never prints)."""

    def update(self, n: int = 1, **postfix) -> None:
        pass

    def close(self) -> None:
        pass


class TokenProgress:
    """Counts decoded tokens into a bar as they are generated (a batch of long responses takes
    minutes: counting finished prompts left the bar at 0 until the first batch was done), with
    the samples written so far as its postfix."""

    def __init__(self, bar, samples: int):
        self.bar, self.samples, self.done = bar, samples, 0

    def tokens(self, n: int) -> None:
        self.bar.update(n, samples=f"{self.done}/{self.samples}")

    def written(self, item: Item) -> None:
        """One sample stored; a teacher-forced one counts its response now, its forward is done."""
        self.done += 1
        self.bar.update(0 if item.given is None else len(item.given), samples=f"{self.done}/{self.samples}")
