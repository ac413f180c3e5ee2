"""Running out of disk (or of the file-size limit) while writing, as one clear error.

Writes that can fill a disk go through `with writing(path, needed):`. An OSError meaning "no
space" (ENOSPC, a full quota, or EFBIG when the file-size limit `ulimit -f` is reached; pyarrow
raises such errors without the path) becomes a DiskFullError naming the file, the space left
there and about how much this write needed. Nothing written so far is ever taken as complete:
shards, the target head, manifests and results are written under temporary names and renamed
only once whole, so running the same command again after freeing space resumes cleanly.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

from pipeline.common.errors import UserError

NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_SPACE_WORDS = ("no space left", "file too large", "disk quota exceeded")


class DiskFullError(UserError):
    """A write ran out of disk space or hit the file-size limit."""


def is_no_space(error: BaseException) -> bool:
    """Whether an OSError means the disk (or quota, or file-size limit) is full."""
    if not isinstance(error, OSError):
        return False
    return error.errno in NO_SPACE or any(words in str(error).lower() for words in _NO_SPACE_WORDS)


def free_bytes(path: str) -> int | None:
    """Free bytes on the filesystem holding `path` (its nearest existing parent), None if unknown."""
    probe = os.path.abspath(path)
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def _size(n: int | None) -> str:
    """'0 bytes', '635 bytes', '53.1 KiB', '1.2 GiB' (approximate: a message, not an option)."""
    if n is None:
        return "unknown"
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} bytes"


def message(path: str, needed: int | None, error: OSError, resume: str) -> str:
    """The one-line error: what ran out, where, how much is free and needed, and what to do."""
    if error.errno == errno.EFBIG or "file too large" in str(error).lower():
        problem = f"the file-size limit (ulimit -f) stopped the write of {path}"
    else:
        problem = f"no space left on the device writing {path} ({_size(free_bytes(path))} free there)"
    need = "" if needed is None else f"; this write needs about {_size(needed)} more"
    return f"{problem}{need}. Free some space and run the same command again: {resume}"


@contextlib.contextmanager
def writing(path: str, needed: int | None = None, resume: str = "finished work is kept and it resumes"):
    """Turn a no-space OSError inside the block into a DiskFullError about `path`."""
    try:
        yield
    except OSError as error:
        if not is_no_space(error):
            raise
        raise DiskFullError(message(path, needed, error, resume)) from error
