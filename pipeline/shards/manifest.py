"""manifest.json (settings identity + every finished shard) and the finished-shard listing it is
merged from. Loading checks the format version, so a directory of another format is refused."""

from __future__ import annotations

import json

import pyarrow.fs as pafs

from pipeline.shards.files import exists, join, open_fs, read_json, write_json_atomic
from pipeline.shards.schema import FORMAT_VERSION, MANIFEST_NAME, SHARD_DIR, ShardError


def read_manifest(uri: str) -> dict:
    fs, root = open_fs(uri)
    check_directory(fs, root, uri)
    path = join(root, MANIFEST_NAME)
    if not exists(fs, path):
        raise ShardError(
            f"{path}: no manifest. Is this an extract output directory? Run `specreplay extract --out {uri}` first."
        )
    try:
        manifest = read_json(fs, path)
    except json.JSONDecodeError as error:
        raise ShardError(f"{path}: manifest is not valid JSON ({error}); re-run the extract to rewrite it") from error
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ShardError(
            f"{path}: format_version {version}, this specreplay reads {FORMAT_VERSION}; re-extract with this "
            f"specreplay (`specreplay extract ... --overwrite`) or use the version that wrote it"
        )
    return manifest


def check_directory(fs: pafs.FileSystem, root: str, uri: str) -> None:
    """A mistyped path is told apart from a directory that holds no extract: the fixes differ."""
    kind = fs.get_file_info(root).type
    if kind == pafs.FileType.NotFound:
        raise ShardError(f"no such directory: {uri}")
    if kind != pafs.FileType.Directory:
        raise ShardError(f"{uri}: not a directory; pass the directory an extract wrote (it holds {MANIFEST_NAME})")


def write_manifest(uri: str, manifest: dict) -> None:
    fs, root = open_fs(uri)
    write_json_atomic(fs, join(root, MANIFEST_NAME), manifest)


def _shard_names(out_uri: str) -> tuple[pafs.FileSystem, str, set[str]]:
    """(fs, shard directory, the file names in it; none when it does not exist)."""
    fs, root = open_fs(out_uri)
    shard_dir = join(root, SHARD_DIR)
    if not exists(fs, shard_dir):
        return fs, shard_dir, set()
    return fs, shard_dir, {info.base_name for info in fs.get_file_info(pafs.FileSelector(shard_dir))}


def finished_shard_entries(out_uri: str) -> list[dict]:
    """Entries of every finished shard in a directory (both .json and .arrow present)."""
    fs, shard_dir, names = _shard_names(out_uri)
    entries = []
    for name in sorted(names):
        if name.endswith(".json") and name[:-5] + ".arrow" in names:
            entries.append(read_json(fs, join(shard_dir, name)))
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
