"""One writer per output: a lock file naming the process that writes a directory.

`extract --out D` and `score` into a results directory take `D/.specreplay.lock` (or the results
directory's sibling `.<name>.lock`) before writing anything. The lock is created with O_EXCL and
holds JSON naming the holder: pid, its start time (so a reused pid is not mistaken for the
holder), host, command, the torchrun job. A second writer is refused at once with those facts;
a lock whose holder is dead (kill -9 leaves the file behind) is stale and taken over: renamed
aside atomically, so of two processes taking it over at once exactly one wins. Ranks of one
torchrun job share their job's lock: rank 0 takes it, the others write only after a barrier.

Local paths only: object stores (s3://, gs://) have no atomic create-if-absent here, so writers
there are not locked (the manifest and shard names still keep their outputs apart).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass

from pipeline.common.errors import UserError
from pipeline.common.space import writing


class LockedError(UserError):
    """Another live process writes the output."""


@dataclass
class Holder:
    pid: int
    started: float | None  # the process's start time (Linux /proc), to tell a reused pid apart
    host: str
    command: str
    since: str
    job: str | None  # torchrun job id (TORCHELASTIC_RUN_ID), None outside torchrun


def process_start(pid: int) -> float | None:
    """Start time of `pid` in clock ticks since boot (Linux), None when unknown or not running."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return float(fields[19])  # field 22 of stat; the first two (pid, comm) were split off
    except (OSError, IndexError, ValueError):
        return None


def pid_exists(pid: int) -> bool:
    """Whether process `pid` exists on this machine (signal 0 checks without sending one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def is_alive(holder: Holder) -> bool:
    """Whether the holder still runs: same host, the pid exists and started when the holder did."""
    if holder.host != socket.gethostname():
        return True  # cannot tell from here: assume it runs
    if not pid_exists(holder.pid):
        return False
    started = process_start(holder.pid)
    return holder.started is None or started is None or abs(started - holder.started) < 1e-6


def me() -> Holder:
    return Holder(
        pid=os.getpid(),
        started=process_start(os.getpid()),
        host=socket.gethostname(),
        command=" ".join(sys.argv)[:500],
        since=time.strftime("%Y-%m-%d %H:%M:%S"),
        job=os.environ.get("TORCHELASTIC_RUN_ID"),
    )


def read_holder(path: str) -> Holder | None:
    """The lock's holder; None when the file vanished; pid 0 when it cannot be read (locks are
    linked into place whole, so an unreadable one was damaged: taken over after a short grace)."""
    try:
        with open(path) as f:
            return Holder(**json.load(f))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):
        return Holder(pid=0, started=None, host=socket.gethostname(), command="?", since="?", job=None)


def half_written_is_stale(path: str, grace_s: float = 5.0) -> bool:
    """An unreadable lock older than `grace_s` is stale; a younger one may be being written now."""
    try:
        return time.time() - os.path.getmtime(path) > grace_s
    except FileNotFoundError:
        return True


class OutputLock:
    """`with OutputLock(path, what):` holds the lock file `path` for the block."""

    def __init__(self, path: str, what: str):
        self.path, self.what = path, what
        self.held = False
        self.made_dir: str | None = None  # the directory the lock created, removed again if left empty

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        for _ in range(30):  # a takeover raced by another process, a lock being written: look again
            if self._create():
                return
            holder = read_holder(self.path)
            if holder is None:
                continue
            if holder.pid == 0:  # unreadable
                if half_written_is_stale(self.path):
                    self._take_over(holder)
                else:
                    time.sleep(0.2)
                continue
            if holder.job is not None and holder.job == os.environ.get("TORCHELASTIC_RUN_ID"):
                return  # our own torchrun job holds it
            if is_alive(holder):
                raise LockedError(self._refusal(holder))
            self._take_over(holder)
        raise LockedError(f"{self.path}: could not take the lock (other processes keep taking it); try again")

    def _create(self) -> bool:
        """Write our holder JSON to a private file, then hard-link it to the lock name: the link
        either appears whole or fails because the lock exists, so a lock is never half-written."""
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            os.makedirs(directory)
            self.made_dir = directory
        private = f"{self.path}.{os.getpid()}"
        try:
            with writing(self.path, resume="nothing was written yet"), open(private, "w") as f:
                json.dump(asdict(me()), f)
            os.link(private, self.path)
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(private)
        self.held = True
        return True

    def _take_over(self, holder: Holder) -> None:
        """Move the stale lock aside (atomic: one of several contenders succeeds), then delete it."""
        aside = f"{self.path}.stale-{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another process took it over first
        os.remove(aside)
        print(
            f"note: {self.what}: took over the lock left by process {holder.pid} ({holder.command}), "
            "which is no longer running",
            file=sys.stderr,
        )

    def _refusal(self, holder: Holder) -> str:
        where = "" if holder.host == socket.gethostname() else f" on {holder.host}"
        return (
            f"{self.what} is being written by process {holder.pid}{where} since {holder.since} "
            f"(`{holder.command}`); wait for it to finish or stop it. If that process is gone, "
            f"delete {self.path}"
        )

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        if self.made_dir is not None and not os.listdir(self.made_dir):
            os.rmdir(self.made_dir)  # a run that wrote nothing leaves nothing behind


def local_lock(uri: str, path: str, what: str) -> OutputLock | None:
    """An OutputLock for a local output, None for object-store URIs (see the module docstring)."""
    return None if "://" in uri else OutputLock(path, what)
