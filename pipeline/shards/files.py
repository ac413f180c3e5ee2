"""Filesystem helpers over pyarrow.fs, so s3:// and gs:// work like local paths: paths, atomic
writes, checksummed JSON, and the two checksums (crc32 of a whole file, streamed; xxh3_64 of a block).

Every JSON file the shards use (manifest.json, the shard sidecars) carries `"checksum":
"xxh3_64:<hex>"`, the xxh3_64 of the canonical JSON of the rest of the object (sorted keys, no
whitespace), so a flipped byte that still parses (a digit of a row count, a letter of a sample id)
is caught on read; whitespace is not covered, changing it changes nothing read. Files written
before format 3 have none and are read as they are."""

from __future__ import annotations

import json
import os
import zlib

import pyarrow.fs as pafs
import xxhash

from pipeline.common.space import writing
from pipeline.shards.schema import ShardError

BLOCK_HASH = "xxh3_64"  # the sidecar's "block_hash": faster than crc32, so cheap on the read path
CHECKSUM_KEY = "checksum"  # of a JSON file: "xxh3_64:<16 hex digits>" of the canonical JSON of the rest


def open_fs(uri: str) -> tuple[pafs.FileSystem, str]:
    """Filesystem and path for a local path or any URI pyarrow.fs understands."""
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as stream:
        return stream.read()


def write_bytes_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Write to a temporary name then rename, so readers never see a half-written file."""
    tmp = path + ".tmp"
    with writing(path, len(data)), fs.open_output_stream(tmp) as stream:
        stream.write(data)
    fs.move(tmp, path)


def json_checksum(obj: dict) -> str:
    """The `checksum` of a JSON object: xxh3_64 of its canonical JSON (the key itself excluded)."""
    rest = {key: value for key, value in obj.items() if key != CHECKSUM_KEY}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{BLOCK_HASH}:{xxhash.xxh3_64_hexdigest(canonical.encode())}"


def read_json(
    fs: pafs.FileSystem, path: str, fix: str = "re-run the extract or restore it from a copy", required: bool = False
) -> dict:
    """A JSON object written by write_json_atomic, its checksum verified (when it has one, or
    always when `required`) and removed. Unreadable, not an object or damaged: a ShardError
    naming the file, ending with `fix` (what to do about it)."""
    obj, stored = load_json(fs, path, fix)
    if stored is None and required:
        raise ShardError(f"{path} is damaged (its checksum is missing); {fix}")
    if stored is not None and stored != json_checksum(obj):
        raise ShardError(f"{path} is damaged (checksum mismatch); {fix}")
    return obj


def load_json(fs: pafs.FileSystem, path: str, fix: str) -> tuple[dict, object]:
    """(the object without its checksum, the checksum it carried or None), not verified: for a
    caller that decides from the content what to verify (a manifest says its format version)."""
    try:
        obj = json.loads(read_bytes(fs, path).decode("utf-8"))
    except ValueError as error:  # invalid UTF-8 or JSON
        raise ShardError(f"{path} is damaged (not valid JSON: {error}); {fix}") from error
    if not isinstance(obj, dict):
        raise ShardError(f"{path} is damaged (not a JSON object); {fix}")
    return obj, obj.pop(CHECKSUM_KEY, None)


def write_json_atomic(fs: pafs.FileSystem, path: str, obj: dict) -> None:
    """`obj` with its `checksum` (the caller's dict is left as it is), written atomically."""
    checked = {**obj, CHECKSUM_KEY: json_checksum(obj)}
    write_bytes_atomic(fs, path, json.dumps(checked, indent=1, sort_keys=True).encode())


def file_crc32(fs: pafs.FileSystem, path: str, chunk_bytes: int = 64 << 20) -> tuple[int, int]:
    """(crc32, size) of a file, read in chunks so a 1 GiB shard never sits in memory twice."""
    crc, size = 0, 0
    with fs.open_input_stream(path) as stream:
        while True:
            chunk = stream.read(chunk_bytes)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return crc, size


def block_hash(data) -> int:
    """xxh3_64 of a block (a schema message or a record batch) as an int."""
    return xxhash.xxh3_64_intdigest(data)
