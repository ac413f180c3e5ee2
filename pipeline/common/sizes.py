"""Human-readable byte sizes for options: '2GiB' in, bytes out, and back for --help."""

from __future__ import annotations

import re

from pipeline.common.errors import UserError

# --memory-budget's default for both stages: extract's lm_head window + shard chunk, score's anchor chunk.
DEFAULT_MEMORY_BYTES = 2 << 30
# The shard writer's defaults, here so the shard format never imports stage 1's settings.
DEFAULT_SHARD_BYTES = 1 << 30
DEFAULT_ZSTD_LEVEL = 1  # measured smaller and faster to decode than 3 on features (bench/README.md)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str, option: str = "--shard-bytes") -> int:
    """'1GiB' -> 1073741824, '512MiB', '200MB', '4096' (bytes)."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise UserError(f"{option} {text!r} is not a size; use e.g. 1GiB, 512MiB, 200MB or a byte count")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise UserError(f"{option} {text!r} must be at least one byte")
    return size


def format_size(size: int) -> str:
    """The shortest exact binary spelling: 2147483648 -> '2GiB', 1536 -> '1536' (bytes)."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)
