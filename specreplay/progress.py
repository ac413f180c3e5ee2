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


def bars(quiet: bool):
    """The progress factory for a command: None (no bars) when quiet."""
    return None if quiet else Bar
