"""The shard format: the one place that knows how extracted samples are laid out in bytes.

Both stages import this module (extract writes, score reads); nothing else touches Arrow.

Layout of an extract directory (any URI pyarrow.fs opens: a local path, s3://, gs://):

    manifest.json            settings identity + every finished shard (merged index)
    target_head.safetensors  the target's input embedding and lm_head, stored once
    shards/rR-NNNNN.arrow    Arrow IPC file, one record batch per chunk, tensors as zstd frames
    shards/rR-NNNNN.json     that shard's entry (rows, tokens, bytes, crc32 of the file, and the
                             byte range + xxh3_64 of its schema message and of every record batch;
                             counts: response tokens, finish reasons, argmax mismatches); written
                             before the .arrow is renamed into place, so a shard counts as
                             finished exactly when both exist

Format version 2. A record batch is a *chunk*: consecutive whole samples (one row each) holding
about `chunk_tokens` tokens together (a longer sample is a chunk by itself). Each tensor of a
chunk is stored once for the whole chunk: the rows' tensors concatenated along their first
(token) axis, [N, *trailing], then stored losslessly as channel-major byte planes — the bytes
viewed as [N, *trailing, itemsize] with every axis reversed, [itemsize, *reversed(trailing), N],
so all high bytes of channel 0 over the chunk's N tokens come first, then channel 1, ... and the
low bytes last, compressed as one zstd frame. Only row 0 of a chunk carries the frame (`<tensor>`,
large_binary; null in the other rows); every row carries its own shape (`<tensor>_shape`), which
locates it in the chunk. The IPC file itself is written without Arrow's buffer compression (the
scalar columns are a few bytes a token): decoding our own frames with pa.Codec ran at ~1.9 GB/s
a core where Arrow's compressed-IPC read path gave ~1.3 on the same bytes. The schema metadata
says which codec the frames use (`specreplay.codec`: zstd, or none for an uncompressed copy).

Why this layout (measured, bench/README.md "Feature codecs", SmolLM2 bf16 features): a channel's
sign/exponent byte repeats over tokens, so zstd finds long matches in a channel's run; runs of
~4096 tokens across samples reach 0.62 of raw bf16 at zstd level 1, against 0.71-0.73 for one
sample's row-major planes (SPEC §5: planes already beat plain zstd by ~12%). Level 1 is both
smaller and faster to decode than level 3 on these runs. Decoding re-interleaves the planes
with a vectorised shift-or and returns each row as a *view* into its chunk (stride 1 along
tokens, i.e. transposed in memory); matmuls take such views directly, `.contiguous()` gives
row-major when a consumer needs it.

Checksums: each record batch's bytes are checked (xxh3_64 from the sidecar) before Arrow sees
them, so the reader touches only the chunks it needs, never decodes a corrupt one, and holds one
chunk in memory at a time; `inspect` also checks the whole file's crc32. xxh3 on the read path
because it hashes ~11 GB/s a core where zlib's crc32 does ~2 (a fifth of the decode budget).

Row schema (one row = one prompt + response):
    sample_id, dataset, prompt_text: string   prompt_len: int32   finish_reason: string
    greedy: bool (False when the response was given, i.e. teacher-forced)
    input_ids: list<int32>                    prompt + response tokens, N of them
    <tensor>: large_binary (the chunk's planes, row 0)   <tensor>_shape: list<int64>
Tensors: features [N, n_layers*H]; topk_ids [R+1, k] and topk_logprobs [R+1, k] where row i is
the target's distribution for the token at position prompt_len + i (R = N - prompt_len);
argmax_mismatch [R] (uint8, 1 where the stored token is not the full-forward argmax);
optional logits [R+1, V] and last_hidden [N, H]. With fp8 features (lossy, opt-in) features
are float8_e4m3fn and features_scale [N, n_layers] float32 holds each token's per-layer scale;
the reader hands out the dequantized float32 features.
"""

from __future__ import annotations

import json
import queue
import threading
import zlib
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import xxhash
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import torch

from pipeline.config import DEFAULT_SHARD_BYTES, DEFAULT_ZSTD_LEVEL
from pipeline.errors import UserError

FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
TARGET_HEAD_NAME = "target_head.safetensors"
SHARD_DIR = "shards"
DEFAULT_CHUNK_TOKENS = 4096  # tokens per record batch: ~0.62 of raw bf16 here, 0.645 at 1024 (bench)
FP8_MAX = 448.0  # largest finite float8_e4m3fn

TENSOR_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
DTYPE_NAMES = {v: k for k, v in TENSOR_DTYPES.items()}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {2: np.int16, 4: np.int32, 8: np.int64}  # numpy types torch.from_numpy accepts

# Scalar columns every row carries, in schema order.
SCALAR_FIELDS = [
    pa.field("sample_id", pa.string()),
    pa.field("dataset", pa.string()),
    pa.field("prompt_text", pa.string()),
    pa.field("prompt_len", pa.int32()),
    pa.field("finish_reason", pa.string()),
    pa.field("greedy", pa.bool_()),
    pa.field("input_ids", pa.list_(pa.int32())),
]
REQUIRED_TENSORS = ("features", "topk_ids", "topk_logprobs", "argmax_mismatch")
OPTIONAL_TENSORS = ("logits", "last_hidden", "features_scale")


class ShardError(UserError):
    """A shard or manifest that cannot be trusted (corrupt, missing, or of another format)."""


@dataclass
class Sample:
    """One extracted prompt + response. Tensors are CPU torch tensors."""

    sample_id: str
    dataset: str
    prompt_text: str
    input_ids: torch.Tensor  # [N] int64, prompt + response
    prompt_len: int
    finish_reason: str  # "eos" | "length" | "given"
    greedy: bool
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def response_len(self) -> int:
        return int(self.input_ids.numel()) - self.prompt_len

    def __getattr__(self, name):  # sample.features, sample.topk_ids, ...
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)


# ---------------------------------------------------------------------------------------------
# channel-major byte planes


def encode_tensor(tensor: torch.Tensor) -> pa.Buffer:
    """Lossless channel-major byte planes of a CPU tensor [N, *trailing] (shape stored apart):
    its bytes as [N, *trailing, itemsize] with every axis reversed."""
    flat = tensor.detach().contiguous()
    itemsize = flat.element_size()
    raw = flat.view(-1).view(torch.uint8).view(*flat.shape, itemsize)
    planes = raw.permute(*reversed(range(raw.dim()))).contiguous()
    return pa.py_buffer(planes.numpy())


def decode_tensor(buffer, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Inverse of encode_tensor, as a view of shape `shape` with stride 1 along axis 0.
    The planes are re-interleaved by a vectorised shift-or (4-5 GB/s a core); no Python per element."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    planes = np.frombuffer(buffer, dtype=np.uint8)
    count = int(np.prod(shape)) if shape else 1
    if planes.size != count * itemsize:
        raise ShardError(f"tensor payload has {planes.size} bytes, expected {count * itemsize} for shape {shape}")
    if itemsize == 1:
        values = torch.from_numpy(planes.copy()).view(dtype)
    else:
        planes = planes.reshape(itemsize, count)
        combined = np.empty(count, dtype=_UNSIGNED[itemsize])
        np.left_shift(planes[itemsize - 1], 8 * (itemsize - 1), out=combined, dtype=combined.dtype)
        for plane in range(itemsize - 2, -1, -1):
            if plane:
                combined |= planes[plane].astype(combined.dtype) << (8 * plane)
            else:
                combined |= planes[0]
        values = torch.from_numpy(combined.view(_SIGNED[itemsize])).view(dtype)
    reversed_shape = list(reversed(shape))
    return values.view(*reversed_shape).permute(*reversed(range(len(shape)))) if shape else values.view(())


def quantize_fp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): one layer's hidden states [T, H] as float8_e4m3fn with one float32 scale per
    token, scale = max|h| / 448 over the token's H values (so each token uses fp8's full range);
    hidden ~= q * scale. Lossy (3 mantissa bits); opt-in via `extract --feature-dtype fp8`."""
    values = hidden.float()
    scale = values.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
    q = (values / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 features [T, G*H] from fp8 values [T, G*H] and per-token, per-layer scales [T, G]."""
    tokens, groups = scale.shape
    return (q.float().reshape(tokens, groups, -1) * scale.reshape(tokens, groups, 1)).reshape(tokens, -1)


# ---------------------------------------------------------------------------------------------
# filesystem helpers (pyarrow.fs, so s3:// and gs:// work like local paths)


def open_fs(uri: str) -> tuple[pafs.FileSystem, str]:
    """Filesystem and path for a local path or any URI pyarrow.fs understands."""
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    import os

    return pafs.LocalFileSystem(), os.path.abspath(uri)


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


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


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


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


# ---------------------------------------------------------------------------------------------
# writer


CODEC_KEY = b"specreplay.codec"


def shard_schema(tensor_names: list[str], codec: str = "zstd") -> pa.Schema:
    fields = list(SCALAR_FIELDS)
    for name in tensor_names:
        fields.append(pa.field(name, pa.large_binary()))
        fields.append(pa.field(name + "_shape", pa.list_(pa.int64())))
    return pa.schema(fields, metadata={CODEC_KEY: codec.encode()})


def chunk_record_batch(samples: list[Sample], tensor_names: list[str], schema: pa.Schema,
                       codec: pa.Codec | None = None) -> pa.RecordBatch:
    """One record batch for consecutive samples: a row each, each tensor's planes once (row 0),
    compressed as one frame by `codec` when given."""
    columns = [
        pa.array([s.sample_id for s in samples], pa.string()),
        pa.array([s.dataset for s in samples], pa.string()),
        pa.array([s.prompt_text for s in samples], pa.string()),
        pa.array([s.prompt_len for s in samples], pa.int32()),
        pa.array([s.finish_reason for s in samples], pa.string()),
        pa.array([s.greedy for s in samples], pa.bool_()),
        pa.array([s.input_ids.to(torch.int32).numpy() for s in samples], pa.list_(pa.int32())),
    ]
    for name in tensor_names:
        parts = [s.tensors[name] for s in samples]
        trailing = {tuple(p.shape[1:]) for p in parts}
        if len(trailing) != 1 or any(p.dim() == 0 for p in parts):
            raise ValueError(f"tensor {name!r}: every sample needs the same shape after the first axis, got "
                             f"{[list(p.shape) for p in parts]}")
        chunk = parts[0] if len(parts) == 1 else torch.cat(parts)
        planes = encode_tensor(chunk)
        columns.append(_binary_in_first_row(planes if codec is None else codec.compress(planes), len(samples)))
        columns.append(pa.array([list(p.shape) for p in parts], pa.list_(pa.int64())))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _binary_in_first_row(buffer: pa.Buffer, rows: int) -> pa.Array:
    """A large_binary array holding `buffer` in row 0 and nulls after, without copying it."""
    offsets = pa.py_buffer(np.array([0] + [buffer.size] * rows, dtype=np.int64))
    validity = None
    if rows > 1:
        validity = pa.py_buffer(np.packbits(np.arange(rows) == 0, bitorder="little"))
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), rows, [validity, offsets, buffer],
                                            null_count=rows - 1)


def empty_stats() -> dict:
    """Per-shard counts kept in the shard's entry, so totals never require re-reading shards."""
    return {"response_tokens": 0, "finish_reasons": {}, "argmax_mismatches": 0,
            "greedy_samples": 0, "greedy_response_tokens": 0, "greedy_argmax_mismatches": 0}


def add_sample_stats(stats: dict, sample: Sample) -> None:
    mismatches = int(sample.tensors["argmax_mismatch"].sum()) if "argmax_mismatch" in sample.tensors else 0
    stats["response_tokens"] += sample.response_len
    stats["finish_reasons"][sample.finish_reason] = stats["finish_reasons"].get(sample.finish_reason, 0) + 1
    stats["argmax_mismatches"] += mismatches
    if sample.greedy:
        stats["greedy_samples"] += 1
        stats["greedy_response_tokens"] += sample.response_len
        stats["greedy_argmax_mismatches"] += mismatches


def chunk_tokens_for(memory_bytes: int, bytes_per_token: int, most: int = DEFAULT_CHUNK_TOKENS) -> int:
    """Tokens per chunk so that one chunk, held raw, as planes and compressed (~3x its raw
    size while it is written or read), stays within `memory_bytes`; at most `most`."""
    return max(1, min(most, memory_bytes // (3 * max(1, bytes_per_token))))


class ShardWriter:
    """Appends samples to size-bounded shards of one rank; every shard lands atomically.

    Samples are buffered until a chunk holds `chunk_tokens` tokens (or would fill the shard),
    then written as one record batch; an interrupted run redoes the buffered samples. A shard is written as `.arrow.tmp`, closed, checksummed, its `.json` entry written,
    and only then renamed to `.arrow`. A crash at any point leaves either a finished shard or a
    temporary file that the next run deletes; finished samples are never rewritten.
    """

    def __init__(
        self,
        out_uri: str,
        rank: int,
        tensor_dtypes: dict[str, str],
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        zstd_level: int | None = DEFAULT_ZSTD_LEVEL,  # None: uncompressed (a benchmark baseline)
        first_index: int = 0,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ):
        self.fs, self.root = open_fs(out_uri)
        self.fs.create_dir(join(self.root, SHARD_DIR), recursive=True)
        self.rank = rank
        self.tensor_dtypes = dict(tensor_dtypes)
        self.tensor_names = list(tensor_dtypes)
        self.codec = None if zstd_level is None else pa.Codec("zstd", compression_level=zstd_level)
        self.schema = shard_schema(self.tensor_names, "none" if self.codec is None else "zstd")
        self.shard_bytes = shard_bytes
        self.chunk_tokens = chunk_tokens
        self.next_index = first_index
        self.entries: list[dict] = []
        self._pending: list[Sample] = []
        self._pending_tokens = self._pending_bytes = 0
        self._stream = None
        self._writer = None

    def _open(self) -> None:
        self._name = f"r{self.rank:03d}-{self.next_index:05d}"
        self._tmp = join(self.root, SHARD_DIR, self._name + ".arrow.tmp")
        self._stream = self.fs.open_output_stream(self._tmp)
        self._writer = ipc.new_file(self._stream, self.schema)  # our frames, no Arrow buffer compression
        self._ids: list[str] = []
        self._tokens = 0
        self._batch_ends: list[int] = []
        self._batch_rows: list[int] = []
        self._stats = empty_stats()
        self.next_index += 1

    def write(self, sample: Sample) -> None:
        for name, dtype in self.tensor_dtypes.items():
            got = sample.tensors[name].dtype
            if DTYPE_NAMES.get(got) != dtype:
                raise ValueError(f"tensor {name!r} of sample {sample.sample_id} is {got}, shard schema says {dtype}")
        tokens = int(sample.input_ids.numel())
        if self._pending and self._pending_tokens + tokens > self.chunk_tokens:
            self._write_chunk()  # a long sample does not make the buffered chunk overshoot
        self._pending.append(sample)
        self._pending_tokens += tokens
        self._pending_bytes += sum(t.numel() * t.element_size() for t in sample.tensors.values())
        written = self._stream.tell() if self._stream is not None else 0
        # A chunk ends at chunk_tokens, or earlier when it would fill the shard (raw bytes
        # overestimate the compressed size, so small --shard-bytes still roll over on time).
        if self._pending_tokens >= self.chunk_tokens or written + self._pending_bytes >= self.shard_bytes:
            self._write_chunk()

    def _write_chunk(self) -> None:
        if not self._pending:
            return
        if self._writer is None:
            self._open()
        self._writer.write_batch(chunk_record_batch(self._pending, self.tensor_names, self.schema, self.codec))
        self._batch_ends.append(self._stream.tell())
        self._batch_rows.append(len(self._pending))
        for sample in self._pending:
            self._ids.append(sample.sample_id)
            self._tokens += int(sample.input_ids.numel())
            add_sample_stats(self._stats, sample)
        self._pending, self._pending_tokens, self._pending_bytes = [], 0, 0
        if self._stream.tell() >= self.shard_bytes:
            self.finish_shard()

    def finish_shard(self) -> dict | None:
        """Write what is buffered and land the current shard (no-op when nothing is open)."""
        if self._pending:
            self._write_chunk()  # may land the shard itself when it reaches shard_bytes
        if self._writer is None:
            return None
        self._writer.close()
        self._stream.close()
        self._writer = self._stream = None
        entry = {
            "file": f"{SHARD_DIR}/{self._name}.arrow",
            "rank": self.rank,
            "rows": len(self._ids),
            "tokens": self._tokens,
            **block_checksums(self.fs, self._tmp, self._batch_ends, self._batch_rows),
            "sample_ids": self._ids,
            **self._stats,
        }
        write_json_atomic(self.fs, join(self.root, SHARD_DIR, self._name + ".json"), entry)
        self.fs.move(self._tmp, join(self.root, SHARD_DIR, self._name + ".arrow"))
        self.entries.append(entry)
        return entry

    def close(self) -> list[dict]:
        self.finish_shard()
        return self.entries


def block_checksums(fs: pafs.FileSystem, path: str, batch_ends: list[int], batch_rows: list[int]) -> dict:
    """Checksums of a written IPC file: crc32 of the whole file (`file_crc32`); byte range and
    xxh3_64 of its schema message and of every record batch (rows included). The schema message
    starts after the 8-byte file magic; batch i spans from the end of batch i-1 (or of the
    schema) to its end."""
    crc, size = file_crc32(fs, path)
    with fs.open_input_file(path) as file:
        file.seek(8)
        ipc.read_message(file)
        starts = [file.tell()] + batch_ends[:-1]

        def hashed(offset: int, end: int) -> int:
            file.seek(offset)
            return xxhash.xxh3_64_intdigest(file.read(end - offset))

        schema_block = [8, starts[0] - 8, hashed(8, starts[0])]
        batches = [[start, end - start, rows, hashed(start, end)]
                   for start, end, rows in zip(starts, batch_ends, batch_rows)]
    return {"bytes": size, "crc32": crc, "block_hash": "xxh3_64", "schema_block": schema_block,
            "batches": batches}


def finished_shard_entries(out_uri: str) -> list[dict]:
    """Entries of every finished shard in a directory (both .json and .arrow present)."""
    fs, root = open_fs(out_uri)
    shard_dir = join(root, SHARD_DIR)
    if not exists(fs, shard_dir):
        return []
    infos = fs.get_file_info(pafs.FileSelector(shard_dir))
    names = {info.base_name for info in infos}
    entries = []
    for name in sorted(names):
        if name.endswith(".json") and name[:-5] + ".arrow" in names:
            entries.append(read_json(fs, join(shard_dir, name)))
    return entries


def remove_unfinished(out_uri: str) -> list[str]:
    """Delete temporary files and sidecars without a shard left by an interrupted run."""
    fs, root = open_fs(out_uri)
    shard_dir = join(root, SHARD_DIR)
    if not exists(fs, shard_dir):
        return []
    names = {info.base_name for info in fs.get_file_info(pafs.FileSelector(shard_dir))}
    removed = []
    for name in sorted(names):
        orphan_json = name.endswith(".json") and name[:-5] + ".arrow" not in names
        if name.endswith(".tmp") or orphan_json:
            fs.delete_file(join(shard_dir, name))
            removed.append(name)
    return removed


# ---------------------------------------------------------------------------------------------
# manifest


def read_manifest(uri: str) -> dict:
    fs, root = open_fs(uri)
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


def write_manifest(uri: str, manifest: dict) -> None:
    fs, root = open_fs(uri)
    write_json_atomic(fs, join(root, MANIFEST_NAME), manifest)


# ---------------------------------------------------------------------------------------------
# reader


def _checked_block(file, path: str, block: list[int], what: str) -> pa.Buffer:
    offset, length, expected = block[0], block[1], block[-1]
    file.seek(offset)
    data = file.read_buffer(length)
    got = xxhash.xxh3_64_intdigest(data)
    if data.size != length or got != expected:
        raise ShardError(
            f"{path}: checksum mismatch in {what} (bytes {offset}..{offset + length}: xxh3_64 {got:#018x}, "
            f"sidecar says {expected:#018x}). The shard is corrupt: delete it and its .json sidecar and re-run the "
            f"same extract command to rewrite just that shard."
        )
    return data


def chunk_frame(column: pa.Array) -> pa.Buffer:
    """Row 0 of a large_binary column as a zero-copy slice (`column[0].as_buffer()` copies)."""
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int64, count=2, offset=8 * column.offset)
    return column.buffers()[2].slice(int(offsets[0]), int(offsets[1] - offsets[0]))


def _decode_chunk(batch: pa.RecordBatch, tensor_dtypes: dict[str, str], names: list[str],
                  rows: list[int], codec: pa.Codec | None) -> Iterator[Sample]:
    """The samples at `rows` of one chunk; each tensor decoded once for the chunk, rows are views."""
    column = {name: batch.column(name).to_pylist() for name in
              ("sample_id", "dataset", "prompt_text", "prompt_len", "finish_reason", "greedy")}
    ids = batch.column("input_ids")
    offsets = ids.offsets.to_numpy()
    all_ids = torch.from_numpy(ids.values.to_numpy(zero_copy_only=False).astype(np.int64))
    tensors: dict[str, list[torch.Tensor]] = {}
    for name in names:
        shapes = batch.column(name + "_shape").to_pylist()
        lengths = [shape[0] for shape in shapes]
        dtype = TENSOR_DTYPES[tensor_dtypes[name]]
        shape = [sum(lengths), *shapes[0][1:]]
        frame = chunk_frame(batch.column(name))
        if codec is not None:
            size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            try:
                frame = codec.decompress(frame, decompressed_size=size)
            except (pa.ArrowException, OSError) as error:  # only after a checksum match: a writer bug
                raise ShardError(f"tensor {name!r}: zstd frame does not decode to {size} bytes ({error})") from error
        chunk = decode_tensor(frame, dtype, shape)
        tensors[name] = list(torch.split(chunk, lengths))
    if "features_scale" in tensors and "features" in tensors:  # fp8 features: hand out float32
        tensors["features"] = [dequantize_fp8(q, s) for q, s in zip(tensors["features"], tensors.pop("features_scale"))]
    for row in rows:
        yield Sample(
            sample_id=column["sample_id"][row],
            dataset=column["dataset"][row],
            prompt_text=column["prompt_text"][row],
            input_ids=all_ids[offsets[row]:offsets[row + 1]],
            prompt_len=column["prompt_len"][row],
            finish_reason=column["finish_reason"][row],
            greedy=column["greedy"][row],
            tensors={name: parts[row] for name, parts in tensors.items()},
        )


def read_shard(uri: str, entry: dict, tensor_dtypes: dict[str, str], tensors: list[str] | None = None,
               rows=None) -> Iterator[Sample]:
    """Yield the samples of one shard (only the row indices in `rows`, if given). Chunks holding
    none of them are not read; every chunk read is checksummed before Arrow decodes it."""
    fs, root = open_fs(uri)
    path = join(root, entry["file"])
    if not exists(fs, path):
        raise ShardError(f"{path}: shard listed in the manifest is missing")
    names = [n for n in (tensors if tensors is not None else tensor_dtypes) if n in tensor_dtypes]
    if "features" in names and "features_scale" in tensor_dtypes and "features_scale" not in names:
        names.append("features_scale")  # fp8 features are dequantized with their scales
    wanted = None if rows is None else set(rows)
    # Local shards are memory-mapped: a chunk's bytes are hashed and decompressed in place, no copy.
    local = isinstance(fs, pafs.LocalFileSystem)
    with (pa.memory_map(path) if local else fs.open_input_file(path)) as file:
        if file.size() != entry["bytes"]:
            raise ShardError(f"{path}: {file.size()} bytes, the sidecar says {entry['bytes']}; the shard is "
                             f"truncated or was replaced: delete it and its .json sidecar and re-run the extract")
        schema_message = ipc.read_message(_checked_block(file, path, entry["schema_block"], "the schema"))
        schema = ipc.read_schema(schema_message)
        codec_name = (schema.metadata or {}).get(CODEC_KEY, b"zstd").decode()
        codec = None if codec_name == "none" else pa.Codec(codec_name)
        first = 0
        for number, block in enumerate(entry["batches"]):
            count = block[2]
            chunk_rows = list(range(count)) if wanted is None else [r for r in range(count) if first + r in wanted]
            first += count
            if not chunk_rows:
                continue
            data = _checked_block(file, path, block, f"record batch {number}")
            batch = ipc.read_record_batch(ipc.read_message(data), schema)
            yield from _decode_chunk(batch, tensor_dtypes, names, chunk_rows, codec)


class ShardSet:
    """A finished extract directory: manifest, shards and the stored target head."""

    def __init__(self, uri: str):
        self.uri = uri
        self.manifest = read_manifest(uri)
        if not self.manifest.get("complete", False):
            raise ShardError(
                f"{uri}: the extract that writes here has not finished; run the same `specreplay extract` "
                f"command again to resume it"
            )
        self.tensor_dtypes: dict[str, str] = self.manifest["tensors"]

    @property
    def settings(self) -> dict:
        return self.manifest["settings"]

    @property
    def entries(self) -> list[dict]:
        return self.manifest["shards"]

    @property
    def num_samples(self) -> int:
        return sum(entry["rows"] for entry in self.entries)

    def samples(self, tensors: list[str] | None = None, entries: list[dict] | None = None,
                prefetch: int = 2, keep=None, pin_memory: bool = False) -> Iterator[Sample]:
        """Samples in manifest order. `keep(index)` (index over the whole set) selects which
        to decode, e.g. one torchrun rank's share; chunks holding none of them are not read.
        Decoding runs in a background thread `prefetch` samples ahead, so the consumer's
        compute never waits on zstd (both release the GIL). `pin_memory` (CUDA only) copies
        each sample's tensors into page-locked memory in that thread, so the consumer's
        `.to("cuda", non_blocking=True)` overlaps with compute."""
        entries = self.entries if entries is None else entries

        def produce():
            base = 0
            for entry in entries:
                rows = None if keep is None else [i for i in range(entry["rows"]) if keep(base + i)]
                base += entry["rows"]
                if rows != []:
                    for sample in read_shard(self.uri, entry, self.tensor_dtypes, tensors, rows=rows):
                        if pin_memory:
                            sample.tensors = {k: v.contiguous().pin_memory() for k, v in sample.tensors.items()}
                        yield sample

        if prefetch <= 0:
            yield from produce()
            return
        yield from _background(produce(), prefetch)

    def target_head(self) -> dict[str, torch.Tensor]:
        """{'embed_tokens': [V, H], 'lm_head': [V, H]} as stored by extract (lm_head may be the
        same tensor). Streamed into the tensors, so the file never sits in memory beside them."""
        fs, root = open_fs(self.uri)
        path = join(root, TARGET_HEAD_NAME)
        if not exists(fs, path):
            raise ShardError(f"{path}: missing; the extract did not store the target's embedding and lm_head")
        weights, crc = read_safetensors_stream(fs, path)
        expected = self.manifest.get("target_head", {}).get("crc32")
        if expected is not None and crc != expected:
            raise ShardError(f"{path}: checksum mismatch; re-run the extract with --overwrite")
        if "lm_head" not in weights:
            weights["lm_head"] = weights["embed_tokens"]
        return weights


# ---------------------------------------------------------------------------------------------
# target head: safetensors written and read as a stream (at 27B shapes the two matrices are
# 4.7 GiB in bf16; safetensors' in-memory save/load would hold the file beside the tensors)

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_STREAM_STEP = 64 << 20


def save_target_head(uri: str, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> dict:
    """Store the target's input embedding and output head once; returns the manifest entry."""
    tied = lm_head.data_ptr() == embed_tokens.data_ptr() or (
        lm_head.shape == embed_tokens.shape and torch.equal(lm_head, embed_tokens)
    )
    weights = {"embed_tokens": embed_tokens.detach().cpu().contiguous()}
    if not tied:
        weights["lm_head"] = lm_head.detach().cpu().contiguous()
    fs, root = open_fs(uri)
    crc, size = write_safetensors_stream(fs, join(root, TARGET_HEAD_NAME), weights)
    return {"file": TARGET_HEAD_NAME, "tied": bool(tied), "crc32": crc, "bytes": size,
            "dtype": DTYPE_NAMES[embed_tokens.dtype]}


def write_safetensors_stream(fs: pafs.FileSystem, path: str, weights: dict[str, torch.Tensor]) -> tuple[int, int]:
    """A standard safetensors file (8-byte header length, JSON header, raw little-endian data),
    written piece by piece to a temporary name and renamed; returns (crc32, bytes)."""
    header, offset = {}, 0
    for name, tensor in weights.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"target head tensor {name!r}: dtype {tensor.dtype} is not stored (use fp32/bf16/fp16)")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    crc, size = 0, 0
    with fs.open_output_stream(path + ".tmp") as stream:
        for piece in _pieces([len(text).to_bytes(8, "little"), text], weights.values()):
            stream.write(piece)
            crc, size = zlib.crc32(piece, crc), size + len(piece)
    fs.move(path + ".tmp", path)
    return crc, size


def _pieces(prefix: list[bytes], tensors):
    yield from prefix
    for tensor in tensors:
        raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        for start in range(0, len(raw), _STREAM_STEP):
            yield raw[start:start + _STREAM_STEP]


def read_safetensors_stream(fs: pafs.FileSystem, path: str) -> tuple[dict[str, torch.Tensor], int]:
    """(tensors, crc32 of the file): each tensor allocated once and filled piece by piece."""
    names = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
    with fs.open_input_stream(path) as stream:
        length_bytes = stream.read(8)
        text = stream.read(int.from_bytes(length_bytes, "little"))
        crc = zlib.crc32(text, zlib.crc32(length_bytes))
        header = json.loads(text)
        header.pop("__metadata__", None)
        weights, position = {}, 0
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            begin, end = info["data_offsets"]
            if begin != position or info["dtype"] not in names:
                raise ShardError(f"{path}: unexpected safetensors layout at {name!r}; re-run the extract with --overwrite")
            tensor = torch.empty(info["shape"], dtype=names[info["dtype"]])
            raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            for start in range(0, end - begin, _STREAM_STEP):
                piece = stream.read(min(_STREAM_STEP, end - begin - start))
                if not piece:
                    raise ShardError(f"{path}: truncated in {name!r}; re-run the extract with --overwrite")
                raw[start:start + len(piece)] = piece
                crc = zlib.crc32(piece, crc)
            weights[name], position = tensor, end
        crc = zlib.crc32(stream.read(), crc)  # nothing should follow; counted if it does
    return weights, crc


_DONE = object()


def _background(iterator: Iterator, depth: int) -> Iterator:
    """Run `iterator` in a daemon thread, `depth` items ahead; exceptions re-raise here."""
    items: queue.Queue = queue.Queue(maxsize=depth)

    def run():
        try:
            for item in iterator:
                items.put(item)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            items.put(error)
        items.put(_DONE)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while True:
        item = items.get()
        if item is _DONE:
            return
        if isinstance(item, BaseException):
            raise item
        yield item
