"""The installed specreplay version, for run records and reports."""

from __future__ import annotations


def specreplay_version() -> str:
    try:
        from importlib.metadata import version

        return version("specreplay")
    except Exception:  # noqa: BLE001 - running from a source tree
        return "dev"
