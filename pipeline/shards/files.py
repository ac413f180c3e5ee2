"""Filesystem helpers over pyarrow.fs, so s3:// and gs:// work like local paths: paths, atomic
writes, JSON, and the two checksums (crc32 of a whole file, streamed; xxh3_64 of a block)."""

from __future__ import annotations

import json
import os
import zlib

import pyarrow.fs as pafs
import xxhash

BLOCK_HASH = "xxh3_64"  # the sidecar's "block_hash": faster than crc32, so cheap on the read path


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
    with fs.open_output_stream(tmp) as stream:
        stream.write(data)
    fs.move(tmp, path)


def read_json(fs: pafs.FileSystem, path: str) -> dict:
    return json.loads(read_bytes(fs, path))


def write_json_atomic(fs: pafs.FileSystem, path: str, obj: dict) -> None:
    write_bytes_atomic(fs, path, json.dumps(obj, indent=1, sort_keys=True).encode())


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
