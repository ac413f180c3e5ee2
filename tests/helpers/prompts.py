"""Prompt files for extract tests."""

from __future__ import annotations

import json
from pathlib import Path


def write_prompts(path, records) -> str:
    """Write a prompts JSONL file, one record a line, and return its path as a string. Records are
    dicts (written as JSON) or strings (written as they are, for malformed-input tests)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)
