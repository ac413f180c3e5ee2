"""Real small and read-only filesystems for the fault tests: a size-limited tmpfs mounted at a
directory when the tests run as root (CI and this project's machines do), else the fallbacks
each test states (RLIMIT_FSIZE for a full disk, chmod for read-only)."""

from __future__ import annotations

import contextlib
import os
import subprocess


def can_mount() -> bool:
    return os.geteuid() == 0 and os.path.exists("/bin/mount")


def _mount(directory: str, options: str) -> bool:
    os.makedirs(directory, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", directory], capture_output=True)
    return result.returncode == 0


@contextlib.contextmanager
def tmpfs(directory: str, size_bytes: int, readonly: bool = False):
    """A tmpfs of `size_bytes` at `directory` for the block; yields True when mounted, False
    when this machine cannot mount (not root, or no permission in this container)."""
    options = f"size={size_bytes}" + (",ro" if readonly else "")
    mounted = can_mount() and _mount(directory, options)
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", directory], capture_output=True)


def resize(directory: str, size_bytes: int) -> None:
    """Grow (or shrink) a mounted tmpfs in place: the files on it stay."""
    subprocess.run(["mount", "-o", f"remount,size={size_bytes}", directory], check=True, capture_output=True)


def used_bytes(directory: str) -> int:
    stat = os.statvfs(directory)
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize
