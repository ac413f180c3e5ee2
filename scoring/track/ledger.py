"""What `specreplay log` (and `watch`) already logged where: a small JSON file beside the results.

One entry per (logger destination, checkpoint hash, training step). Logging a results directory
to a destination that already has its entry is skipped, so running `log` twice, or `log` after
`watch`, adds no duplicate points. The file is rewritten whole under a temporary name and renamed
into place after every entry, so an interruption loses at most the entry being written (whose
points are then logged again on the next run) and never leaves a half-written ledger. Writers
add under an flock on `<ledger>.lock`, so `watch` and a manual `log` can share one ledger; the
holder removes that file before letting go (`locked`), so none is left beside the results.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from typing import Literal

from pipeline.common.errors import UserError
from pipeline.common.schema import Count, Schema, SchemaError, found, validate

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
        with locked(self.path + ".lock"):
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


@contextlib.contextmanager
def locked(path: str):
    """Hold an exclusive flock on the file `path` (created if need be), and remove the file before
    letting go. A writer that opened the file before it was removed gets the lock on a file no
    longer at `path` (another inode, or none): it lets go and locks the file now there, so two
    writers never both hold it and no lock file outlives its holder."""
    while True:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, path):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed by the holder we waited for: lock the one there now
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)  # while still holding it: see above
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _key(destination: str, checkpoint_hash: str, step: int) -> tuple:
    return destination, checkpoint_hash, int(step)


class LedgerEntry(Schema):
    destination: str
    checkpoint_hash: str
    step: int
    checkpoint: str | None = None
    results: str | None = None
    scalars: Count | None = None
    logged_at: str | None = None


class LedgerFile(Schema):
    version: Literal[1]
    logged: list[LedgerEntry]


# refusing beats guessing: an unreadable ledger would otherwise log every point again
LEDGER_FIX = "delete it to log every results directory again"


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise UserError(f"{path}: not a specreplay log ledger ({error}); {LEDGER_FIX}") from error
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: the file holds {found(data)}; expected a specreplay log ledger; {LEDGER_FIX}")
    validate(LedgerFile, data, path, LEDGER_FIX)
    return list(data["logged"])
