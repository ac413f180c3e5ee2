"""Whether two runs' settings differ, and how: one rule for extract (its manifest) and score
(its run.json), so both refuse to mix results in the same words."""

from __future__ import annotations

ABSENT = "<absent>"


def flatten(obj, prefix: str = "") -> dict:
    """{"a.b": value} for nested dicts."""
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): obj}


def settings_diff(old: dict, new: dict) -> list[str]:
    """'key: old -> new' lines for every setting that differs (dotted keys for nested ones)."""
    a, b = flatten(old), flatten(new)
    return [
        f"{key}: {a.get(key, ABSENT)!r} -> {b.get(key, ABSENT)!r}"
        for key in sorted(set(a) | set(b))
        if a.get(key, ABSENT) != b.get(key, ABSENT)
    ]
