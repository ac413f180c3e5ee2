"""What happened to each checkpoint of a score run: its status and where its results are.
Light on purpose (no torch, no pyarrow): the CLI reads outcomes without loading either."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Status(str, Enum):
    """What happened to one checkpoint (a str, so it compares and serialises as its value)."""

    SCORED = "scored"
    SKIPPED = "skipped"  # already scored with the same settings
    FAILED = "failed"  # `Outcome.error` says why, in one line


@dataclass
class Outcome:
    """What happened to one checkpoint, and where its results are."""

    ckpt: str
    out_dir: str
    status: Status
    record: dict | None = None
    summary: object = None  # pyarrow Table of summary.parquet (scored or skipped)
    error: str | None = None
    name: str = field(default="")
    # what family detection assumed to read its config (proposers/layouts.py); None: the file said
    assumed: str | None = None
