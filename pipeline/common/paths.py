"""Checks on the paths a user types, made before anything is read or written: a URI missing a
slash, an output that is a file or cannot be written, an input file that is a directory. Each
fails with one line naming the option, the path and the fix, and nothing is created."""

from __future__ import annotations

import os
import re

from pipeline.common.errors import UserError

# "s3:/bucket", "gs:/b/x": a scheme and one slash (a Windows drive "C:/" has one letter)
_HALF_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)(.*)$")


def check_uri(value: str, option: str) -> None:
    """A URI with a scheme must have `://`: `s3:/bucket` would otherwise become a local
    directory named `s3:`."""
    match = _HALF_URI.match(value)
    if match:
        scheme, rest = match.groups()
        raise UserError(f"{option} {value!r} looks like a URI missing a slash; did you mean {scheme}://{rest}?")


def _nearest_existing(path: str) -> str:
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return probe


def check_output_dir(value: str, option: str = "--out") -> None:
    """An output directory (created if missing) must not be a file and must be writable."""
    check_uri(value, option)
    if "://" in value:
        return  # object stores: the filesystem layer reports what is wrong
    if os.path.exists(value) and not os.path.isdir(value):
        raise UserError(f"{option} {value} is a file, not a directory; give a directory (it is created if missing)")
    existing = _nearest_existing(value)
    if not os.path.isdir(existing):
        raise UserError(f"{option} {value}: {existing} is a file, so the directory cannot be created there")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            f"{option} {value}: {existing} is not writable (read-only filesystem or permissions); "
            "choose a directory you can write"
        )


def check_input_path(value: str, option: str, want: str) -> None:
    """An input that must be a file (`want` = "file") or a directory (`want` = "directory")."""
    check_uri(value, option)
    if "://" in value or not os.path.exists(value):
        return  # a bundled name, a URI, or missing: the reader says which
    if want == "file" and os.path.isdir(value):
        raise UserError(f"{option} {value} is a directory; give a file")
    if want == "directory" and not os.path.isdir(value):
        raise UserError(f"{option} {value}: not a directory; give the directory")


# What a local directory of this project's holds, told by one file name (nothing is read), so a
# path given to the wrong option gets "swapped?" instead of a hint that points the wrong way.
EXTRACT, RESULTS, CHECKPOINT = (
    "an extract (manifest.json)",
    "score results (run.json)",
    "a drafter checkpoint (config.json)",
)
MARKERS = (("manifest.json", EXTRACT), ("run.json", RESULTS), ("config.json", CHECKPOINT))


def directory_kind(path: str) -> str | None:
    """EXTRACT, RESULTS or CHECKPOINT for a local directory holding its marker file, else None."""
    if "://" in path or not os.path.isdir(path):
        return None
    return next((kind for name, kind in MARKERS if os.path.isfile(os.path.join(path, name))), None)


RESULTS_FILES = ("run.json", "summary.parquet")  # scoring/results.py FILES: a results directory holds these


def results_files(path: str) -> list[str]:
    """The results files a local directory holds (none: not a results directory)."""
    if "://" in path or not os.path.isdir(path):
        return []
    return [name for name in RESULTS_FILES if os.path.isfile(os.path.join(path, name))]


def check_results_parent(out: str, option: str = "--out") -> None:
    """score's --out is the parent of the results directories: neither one of them nor an extract."""
    held = results_files(out)
    if held:
        parent = os.path.dirname(os.path.normpath(out)) or "."
        raise UserError(
            f"{option} {out} is a results directory (holds {', '.join(held)}); give its parent, "
            f"{option} {parent}: each checkpoint writes <parent>/<run>_<step>/"
        )
    if directory_kind(out) == EXTRACT:
        raise UserError(f"{option} {out} holds {EXTRACT}, not results; give a results directory such as data/results")


def check_extract_out(out: str, option: str = "--out") -> None:
    """extract's --out is never a results directory nor a parent of results directories."""
    held = results_files(out)
    if held:
        raise UserError(
            f"{option} {out} is a results directory (holds {', '.join(held)}); give a new directory for shards"
        )
    if "://" in out or not os.path.isdir(out):
        return
    scored = sorted(entry.name for entry in os.scandir(out) if entry.is_dir() and results_files(entry.path))
    if scored:
        raise UserError(
            f"{option} {out} holds score results ({', '.join(scored[:3])}{', ...' if len(scored) > 3 else ''}); "
            "give a new directory for shards, e.g. data/shards/<model>-<prompts>"
        )


def check_roles(ckpts: list[str], shards: str) -> None:
    """--shards names an extract and no --ckpt names one; the two swapped is said as such."""
    shards_kind = directory_kind(shards)
    swapped = "swapped --ckpt and --shards?"
    for ckpt in ckpts:
        kind = directory_kind(ckpt)
        if kind == EXTRACT:
            raise UserError(f"--ckpt {ckpt} holds {kind}, not a drafter checkpoint; {swapped}")
        if kind == RESULTS:
            raise UserError(f"--ckpt {ckpt} holds {kind}, not a drafter checkpoint; pass the checkpoint it scored")
    if shards_kind == CHECKPOINT:
        raise UserError(f"--shards {shards} holds {shards_kind}, not an extract; {swapped}")
    if shards_kind == RESULTS:
        raise UserError(f"--shards {shards} holds {shards_kind}, not an extract; pass the --shards it was scored on")
