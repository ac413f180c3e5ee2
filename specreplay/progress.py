"""Progress bars for long commands, made here (the CLI layer) and handed to the stages as a
factory: `progress(total, desc, unit="sample")` -> a bar with update(n, **postfix) and close()."""

from __future__ import annotations


class Bar:
    def __init__(self, total: int, desc: str, unit: str = "sample"):
        import sys

        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr)

    def update(self, n: int = 1, **postfix) -> None:
        if postfix:
            self._bar.set_postfix(refresh=False, **postfix)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


class Lines:
    """Progress as plain lines for a log file or a pipe (no carriage returns): one line each time
    another tenth of the total is done, and one at the end."""

    STEPS = 10

    def __init__(self, total: int, desc: str, unit: str = "sample"):
        import sys
        import time

        self._out, self._clock = sys.stderr, time.monotonic
        self.total, self.desc, self.unit = total, desc, unit
        self.done, self._shown, self._started, self._postfix = 0, 0, self._clock(), {}

    def update(self, n: int = 1, **postfix) -> None:
        self.done += n
        self._postfix.update(postfix)
        tenth = self.STEPS * self.done // max(self.total, 1)
        if tenth > self._shown and self.done < self.total:
            self._shown = tenth
            self._line()

    def close(self) -> None:
        self._line()

    def _line(self) -> None:
        extra = "".join(f", {k}={v}" for k, v in self._postfix.items())
        elapsed = self._clock() - self._started
        print(f"{self.desc}: {self.done}/{self.total} {self.unit} ({elapsed:.0f} s{extra})", file=self._out, flush=True)


def bars(quiet: bool):
    """The progress factory for a command: None (no bars) when quiet; bars on a terminal, plain
    lines when stderr goes to a file or a pipe."""
    import sys

    if quiet:
        return None
    return Bar if sys.stderr.isatty() else Lines
