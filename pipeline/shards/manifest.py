"""manifest.json (settings identity + every finished shard) and the finished-shard listing it is
merged from. Loading checks the format version, so a directory of another format is refused, and
the checksum every JSON file carries since format 3, so a damaged manifest or sidecar is an error
naming it, never a different extract. Shard entries (in the manifest and in each sidecar) are also
checked for consistency (row counts, contiguous byte ranges), which is what a format 2 file gets."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pyarrow.fs as pafs
from pydantic import Field, field_validator, model_validator

from pipeline.common.dtypes import STORAGE_DTYPES
from pipeline.common.schema import Count, Schema, validate
from pipeline.shards.files import exists, join, json_checksum, load_json, open_fs, read_json, write_json_atomic
from pipeline.shards.schema import (
    JSON_CHECKSUM_SINCE,
    MANIFEST_NAME,
    READABLE_FORMAT_VERSIONS,
    SHARD_DIR,
    ShardError,
)

MANIFEST_FIX = (
    "restore it from a copy, or re-run the extract with --overwrite to rewrite the directory "
    "(a shard's .json sidecar holds its entry, but the settings are only here)"
)
SIDECAR_FIX = "delete it and its .arrow shard and re-run the same extract command to rewrite just that shard"


class ExcludedSample(Schema):
    sample_id: str


def read_manifest(uri: str) -> dict:
    fs, root = open_fs(uri)
    check_directory(fs, root, uri)
    path = join(root, MANIFEST_NAME)
    if not exists(fs, path):
        raise ShardError(
            f"{path}: no manifest. Is this an extract output directory? Run `specreplay extract --out {uri}` first."
        )
    manifest, stored = load_json(fs, path, MANIFEST_FIX)
    if stored is not None and stored != json_checksum(manifest) and not _reopened(manifest, stored):
        raise ShardError(f"{path} is damaged (checksum mismatch); {MANIFEST_FIX}")
    version = manifest.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS:
        readable = " and ".join(map(str, READABLE_FORMAT_VERSIONS))
        raise ShardError(
            f"{path}: format_version {version}, this specreplay reads {readable}; re-extract with this "
            f"specreplay (`specreplay extract ... --overwrite`) or use the version that wrote it"
        )
    if version >= JSON_CHECKSUM_SINCE and stored is None:
        raise ShardError(f"{path} is damaged (its checksum is missing); {MANIFEST_FIX}")
    if not isinstance(manifest.get("complete", False), bool):
        raise ShardError(f"{path} is damaged ('complete' is not true or false); {MANIFEST_FIX}")
    return manifest


def _reopened(manifest: dict, stored) -> bool:
    """A finished manifest whose one change is `"complete": false`: an extract reopened (by hand,
    or a test simulating an interrupted run). Safe to accept, everything else is verified as it
    was written: `score` refuses an unfinished extract, and the resume (and `inspect`) take its
    shard entries from their sidecars again."""
    return manifest.get("complete") is False and stored == json_checksum({**manifest, "complete": True})


class ShardEntry(Schema):
    """One finished shard, as its sidecar and the manifest's `shards` list describe it: its file,
    row and byte counts, the schema block after the 8-byte magic and every record batch back to
    back ([offset, length, rows, checksum]), and one sample id (and dataset) per row."""

    file: Annotated[str, Field(pattern=rf"^{SHARD_DIR}/r\d+-\d+\.arrow$")]
    rows: Count
    tokens: Count
    bytes: Count
    schema_block: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=3, max_length=3)]
    batches: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=4, max_length=4)]]
    sample_ids: list[str]
    datasets: list[str] | None = None
    excluded: list[ExcludedSample] = []

    @model_validator(mode="after")
    def _consistent(self):
        problem = _entry_problem(self)
        if problem:
            raise ValueError(f"does not add up: {problem}")
        return self


class ManifestFile(Schema):
    """What reading shards relies on in manifest.json (its settings are compared whole, as
    written by stage 1, and checked where they are used: scoring/drafters/compatibility.py)."""

    format_version: Literal[READABLE_FORMAT_VERSIONS]
    complete: bool = False
    tensors: dict[str, Literal[tuple(STORAGE_DTYPES)]]
    settings: dict[str, Any] | None = None  # absent: ShardSet says so when asked
    target_head: dict[str, Any] = {}
    shards: list[ShardEntry] | None = None  # absent: ShardSet.entries says so when asked

    @field_validator("shards")
    @classmethod
    def _distinct(cls, value):
        files = [entry.file for entry in value or []]
        if len(set(files)) != len(files):
            raise ValueError("lists a shard twice")
        return value


def _entry_problem(entry: ShardEntry) -> str | None:
    """Why an entry's counts and byte ranges disagree with each other, or None."""
    if entry.schema_block[0] != 8:
        return f"the schema block of {entry.file} does not start after the 8-byte magic"
    end = entry.schema_block[0] + entry.schema_block[1]
    for offset, length, _, _ in entry.batches:
        if offset != end:
            return f"the record batch ranges of {entry.file} are not back to back"
        end = offset + length
    if end > entry.bytes:
        return f"the record batches of {entry.file} end past its {entry.bytes} bytes"
    if sum(block[2] for block in entry.batches) != entry.rows:
        return f"the record batches of {entry.file} do not hold its {entry.rows} rows"
    for name, values in (("sample_ids", entry.sample_ids), ("datasets", entry.datasets)):
        if values is not None and len(values) != entry.rows:
            return f"the {name} of {entry.file} are not its {entry.rows} rows"
    return None


def check_manifest(manifest: dict, uri: str) -> None:
    """A finished manifest holds what reading shards relies on: the tensor dtypes, the settings,
    self-consistent shard entries naming distinct files. Cheap (no I/O); a format 2 manifest
    (no checksum) gets no other check."""
    path = join(open_fs(uri)[1], MANIFEST_NAME)
    validate(ManifestFile, manifest, f"{path} is damaged", MANIFEST_FIX, ShardError)


def check_entry(entry, where: str, fix: str) -> None:
    """A shard entry's facts agree with each other (`ShardEntry`). `where` names the file holding it."""
    validate(ShardEntry, entry, f"{where} is damaged", fix, ShardError)


def check_directory(fs: pafs.FileSystem, root: str, uri: str) -> None:
    """A mistyped path is told apart from a directory that holds no extract: the fixes differ."""
    kind = fs.get_file_info(root).type
    if kind == pafs.FileType.NotFound:
        raise ShardError(f"no such directory: {uri}")
    if kind != pafs.FileType.Directory:
        raise ShardError(f"{uri}: not a directory; pass the directory an extract wrote (it holds {MANIFEST_NAME})")


def write_manifest(uri: str, manifest: dict) -> None:
    """manifest.json, with its checksum (write_json_atomic)."""
    fs, root = open_fs(uri)
    write_json_atomic(fs, join(root, MANIFEST_NAME), manifest)


def _shard_names(out_uri: str) -> tuple[pafs.FileSystem, str, set[str]]:
    """(fs, shard directory, the file names in it; none when it does not exist)."""
    fs, root = open_fs(out_uri)
    shard_dir = join(root, SHARD_DIR)
    if not exists(fs, shard_dir):
        return fs, shard_dir, set()
    return fs, shard_dir, {info.base_name for info in fs.get_file_info(pafs.FileSelector(shard_dir))}


def _legacy(out_uri: str) -> bool:
    """Whether OUT's manifest says a format before sidecars were checksummed (then a sidecar
    without a checksum is as written, not damaged)."""
    fs, root = open_fs(out_uri)
    if not exists(fs, join(root, MANIFEST_NAME)):
        return False
    version = read_manifest(out_uri).get("format_version")
    return version < JSON_CHECKSUM_SINCE


def finished_shard_entries(out_uri: str) -> list[dict]:
    """Entries of every finished shard in a directory (both .json and .arrow present), each
    sidecar's checksum verified and its entry checked for consistency (it names its own shard)."""
    fs, shard_dir, names = _shard_names(out_uri)
    sidecars = sorted(name for name in names if name.endswith(".json") and name[:-5] + ".arrow" in names)
    required = bool(sidecars) and not _legacy(out_uri)
    entries = []
    for name in sidecars:
        path = join(shard_dir, name)
        entry = read_json(fs, path, SIDECAR_FIX, required=required)
        check_entry(entry, path, SIDECAR_FIX)
        if entry["file"] != f"{SHARD_DIR}/{name[:-5]}.arrow":
            raise ShardError(f"{path} is damaged (it describes {entry['file']}); {SIDECAR_FIX}")
        entries.append(entry)
    return entries


def remove_unfinished(out_uri: str) -> list[str]:
    """Delete temporary files and sidecars without a shard left by an interrupted run."""
    fs, shard_dir, names = _shard_names(out_uri)
    removed = []
    for name in sorted(names):
        orphan_json = name.endswith(".json") and name[:-5] + ".arrow" not in names
        if name.endswith(".tmp") or orphan_json:
            fs.delete_file(join(shard_dir, name))
            removed.append(name)
    return removed
