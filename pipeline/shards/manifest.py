"""manifest.json (settings identity + every finished shard) and the finished-shard listing it is
merged from. Loading checks the format version, so a directory of another format is refused, and
the checksum every JSON file carries since format 3, so a damaged manifest or sidecar is an error
naming it, never a different extract. Shard entries (in the manifest and in each sidecar) are also
checked for consistency (row counts, contiguous byte ranges), which is what a format 2 file gets."""

from __future__ import annotations

import pyarrow.fs as pafs

from pipeline.common.schema import validate
from pipeline.shards.files import exists, join, json_checksum, load_json, open_fs, read_json, write_json_atomic
from pipeline.shards.manifest_schema import ManifestFile, ShardEntry
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
    if version not in READABLE_FORMAT_VERSIONS or isinstance(version, bool):
        readable = " and ".join(map(str, READABLE_FORMAT_VERSIONS))
        raise ShardError(
            f"{path}: field 'format_version' is {version!r}, this specreplay reads {readable}; re-extract with "
            f"this specreplay (`specreplay extract ... --overwrite`) or use the version that wrote it"
        )
    if version >= JSON_CHECKSUM_SINCE and stored is None:
        raise ShardError(f"{path} is damaged (its checksum is missing); {MANIFEST_FIX}")
    validate(ManifestFile, manifest, f"{path} is damaged", MANIFEST_FIX, ShardError)
    return manifest


def _reopened(manifest: dict, stored) -> bool:
    """A finished manifest whose one change is `"complete": false`: an extract reopened (by hand,
    or a test simulating an interrupted run). Safe to accept, everything else is verified as it
    was written: `score` refuses an unfinished extract, and the resume (and `inspect`) take its
    shard entries from their sidecars again."""
    return manifest.get("complete") is False and stored == json_checksum({**manifest, "complete": True})


def check_manifest(manifest: dict, uri: str) -> None:
    """A manifest holds what reading shards relies on (manifest_schema.py): read_manifest checks
    that already; this is for a manifest held in memory. Cheap (no I/O)."""
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
