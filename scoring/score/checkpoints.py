"""The checkpoints `score --ckpt` names, expanded and checked before anything heavy is loaded
(the command calls this before it imports torch: a misspelt path is said in a second)."""

from __future__ import annotations

import glob
import os

from proposers import baselines


def expand_checkpoints(patterns: list[str]) -> list[str]:
    """Paths as given, globs expanded (sorted), duplicates dropped; missing paths are an error. A
    baseline's name (`ngram:vllm:k=4`, proposers/baselines.py) is kept as it is."""
    paths: list[str] = []
    for pattern in patterns:
        if baselines.is_named(pattern):
            paths += [pattern] if pattern not in paths else []
            continue
        literal = os.path.exists(pattern) or not any(c in pattern for c in "*?[")
        matches = [pattern] if literal else sorted(glob.glob(pattern))
        if not matches:
            raise FileNotFoundError(f"--ckpt {pattern!r} matches nothing")
        for path in matches:
            if not os.path.exists(path):
                raise FileNotFoundError(f"--ckpt {path}: no such file or directory")
            if path not in paths:
                paths.append(path)
    return paths
