"""What `specreplay log` (and `watch`) already logged where: a small JSON file beside the results.

One entry per (logger destination, checkpoint hash, training step). Logging a results directory
to a destination that already has its entry is skipped, so running `log` twice, or `log` after
`watch`, adds no duplicate points. The file is rewritten whole under a temporary name and renamed
into place after every entry, so an interruption loses at most the entry being written (whose
points are then logged again on the next run) and never leaves a half-written ledger. Writers
add under an flock on `<ledger>.lock`, so `watch` and a manual `log` can share one ledger.
"""

from __future__ import annotations

import fcntl
import json
import os
import time

from pipeline.common.errors import UserError

LEDGER_NAME = ".specreplay-logged.json"
VERSION = 1


def ledger_path_for(result_dirs: list[str]) -> str:
    """The ledger of these results directories: in the directory holding them (the `--out` of
    `score`), so every command that logs results scored there shares one."""
    parents = [os.path.dirname(os.path.abspath(d)) for d in result_dirs]
    return os.path.join(os.path.commonpath(parents), LEDGER_NAME)


class Ledger:
    """The entries of one ledger file; `add` writes the file at once."""

    def __init__(self, path: str):
        self.path = path
        self.entries: list[dict] = _read(path)
        self._keys = {_key(e["destination"], e["checkpoint_hash"], e["step"]): e for e in self.entries}

    def find(self, destination: str, checkpoint_hash: str, step: int) -> dict | None:
        """The entry saying this checkpoint at this step went to `destination`, or None."""
        return self._keys.get(_key(destination, checkpoint_hash, step))

    def add(self, destination: str, checkpoint_hash: str, step: int, checkpoint: str, results: str, scalars: int):
        entry = {
            "destination": destination,
            "checkpoint_hash": checkpoint_hash,
            "step": int(step),
            "checkpoint": checkpoint,
            "results": os.path.abspath(results),
            "scalars": scalars,
            "logged_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        self._keys[_key(destination, checkpoint_hash, step)] = entry
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        # `watch` and a manual `log` may share a ledger: re-read it under a lock and add to what
        # is there now, so neither drops the other's entries
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            current = _read(self.path)
            known = {_key(e["destination"], e["checkpoint_hash"], e["step"]) for e in current}
            self.entries = current + ([entry] if _key(destination, checkpoint_hash, step) not in known else [])
            self._write()

    def _write(self) -> None:
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"version": VERSION, "logged": self.entries}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def _key(destination: str, checkpoint_hash: str, step: int) -> tuple:
    return destination, checkpoint_hash, int(step)


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            data = json.load(f)
        entries = data["logged"]
        for e in entries:
            _key(e["destination"], e["checkpoint_hash"], e["step"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        # refusing beats guessing: an unreadable ledger would otherwise log every point again
        raise UserError(
            f"{path}: not a specreplay log ledger ({error}); delete it to log every results directory again"
        ) from error
    return list(entries)
