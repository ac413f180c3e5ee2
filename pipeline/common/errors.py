"""One base class for errors a user can fix (a bad path, a refused directory, a mismatched
checkpoint). The console script prints `error: <message>` and exits 2 on any of them; other
exceptions are bugs and keep their traceback. SPECREPLAY_DEBUG=1 shows the traceback always.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input. The message names the file or field and says what to do. A ValueError, so
    library callers that catch ValueError for bad arguments keep working."""


class Interrupted(KeyboardInterrupt):
    """A stop (Ctrl-C, or SIGTERM: `signal` says which) after the work finished so far was put
    on disk; `kept` says what, in the user's words ("4 of 6 samples kept in OUT")."""

    def __init__(self, kept: str, signal: str = "SIGINT"):
        super().__init__(kept)
        self.kept, self.signal = kept, signal


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, a lost node's shutdown) raised where the work is, as Ctrl-C is,
    so the same code keeps what was finished; exits 143."""


# The stop the command line's handler saw (specreplay/cli.py interrupts_noted), none before one. Native
# code a KeyboardInterrupt lands in may turn it into another error (safetensors: a ValueError); an
# error raised after a stop is its echo, and a stage keeps its work as for the stop itself.
_SEEN: list[str] = []


def note_stop(signal_name: str | None) -> None:
    """Record the stop ("SIGINT", "SIGTERM") a handler saw; None forgets it (a new command's start)."""
    _SEEN[:] = [] if signal_name is None else [signal_name]


def stop_behind(error: Exception) -> KeyboardInterrupt | None:
    """The stop `error` echoes when one was seen (a Terminated for SIGTERM), else None."""
    if not _SEEN:
        return None
    stop = Terminated("SIGTERM") if _SEEN[0] == "SIGTERM" else KeyboardInterrupt()
    stop.__context__ = error
    return stop
