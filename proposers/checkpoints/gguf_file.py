"""The GGUF container (llama.cpp's model file): its metadata and tensor index, read from the header
alone, and one tensor's values on demand (docs/gguf-drafters.md).

The header is parsed here rather than by the gguf package's GGUFReader, which builds a numpy view
for every string of the tokenizer arrays (seconds for a 49k-token vocabulary, on every read); the
file format's constants and the dequantization of quantized types are the gguf package's. Tensor
shapes are numpy's (ggml's `ne` reversed), which is the HF checkpoint's shape for every tensor the
converter writes. A file cut short (its tensor index names bytes past its end) or not a GGUF at
all is one CheckpointError naming the file.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from proposers.checkpoints.files import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 (2023) counted with 32-bit integers; llama.cpp writes v3
DEFAULT_ALIGNMENT = 32  # of the tensor data, unless `general.alignment` says otherwise
SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# Tensor types whose bytes are the values themselves
PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class Strings:
    """An array of strings in the metadata (the tokenizer's tokens, merges), counted, not decoded."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # numpy's order: ggml's ne reversed
    kind: GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class GgufFile:
    path: str
    metadata: dict
    tensors: dict[str, TensorEntry]

    def key(self, name: str, default=None):
        return self.metadata.get(name, default)


class _Cursor:
    """Little-endian reads through the mapped file; struct.error past its end (a truncated file)."""

    def __init__(self, buffer):
        self.buffer, self.offset = buffer, 0

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.buffer, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def take(self, size: int) -> bytes:
        if self.offset + size > len(self.buffer):
            raise struct.error(f"{size} bytes asked at offset {self.offset}, past the end")
        data = self.buffer[self.offset : self.offset + size]
        self.offset += size
        return data

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8")

    def value(self, kind: int):
        kind = GGUFValueType(kind)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            return self.unpack(SCALARS[kind])
        item, count = GGUFValueType(self.unpack("<I")), self.unpack("<Q")
        if item == GGUFValueType.STRING:
            for _ in range(count):
                self.take(self.unpack("<Q"))
            return Strings(count)
        if item == GGUFValueType.ARRAY:
            return [self.value(item) for _ in range(count)]
        dtype = np.dtype(SCALARS[item])
        return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()


def read_gguf(path: str) -> GgufFile:
    """The metadata and tensor index of the GGUF file at `path` (no tensor data is read)."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        if size < 4 or handle.read(4) != MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            try:
                return _parse(path, _Cursor(buffer), size)
            except (struct.error, UnicodeDecodeError, ValueError, KeyError, OverflowError) as error:
                raise CheckpointError(
                    f"{path}: truncated or corrupt GGUF ({size} bytes; its header cannot be read: {error}); "
                    f"the file was not completely written or downloaded: convert or download it again"
                ) from None


def _parse(path: str, cursor: _Cursor, size: int) -> GgufFile:
    cursor.offset = 4
    version = cursor.unpack("<I")
    if version not in VERSIONS:
        raise CheckpointError(
            f"{path}: GGUF version {version}; specreplay reads versions {', '.join(map(str, VERSIONS))} (little-endian), "
            f"which llama.cpp's convert_hf_to_gguf.py writes"
        )
    tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    metadata = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    infos = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.offset // alignment) * alignment
    tensors = {
        name: TensorEntry(name, shape, kind, start + offset, _nbytes(shape, kind))
        for name, shape, kind, offset in infos
    }
    if len(tensors) != len(infos):
        raise CheckpointError(f"{path}: the tensor index names a tensor twice; the file is corrupt")
    needed = max((t.offset + t.nbytes for t in tensors.values()), default=start)
    if needed > size:
        raise CheckpointError(
            f"{path}: truncated ({size} bytes, its tensor index says {needed}); the file was not completely "
            f"written or downloaded: convert or download it again"
        )
    return GgufFile(path, metadata, tensors)


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cursor.string()
    dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
    kind = GGMLQuantizationType(cursor.unpack("<I"))
    return name, tuple(reversed(dims)), kind, cursor.unpack("<Q")


def _nbytes(shape: tuple[int, ...], kind: GGMLQuantizationType) -> int:
    block, type_size = GGML_QUANT_SIZES[kind]
    return int(np.prod(shape, dtype=np.int64)) * type_size // block


def tensor_values(file: GgufFile, entry: TensorEntry) -> np.ndarray:
    """The tensor's values in its numpy shape: as stored for F32/F16/F64 and integers, else
    dequantized to float32 by the gguf package (BF16 included); a type it cannot dequantize is a
    CheckpointError naming the tensor and its type."""
    with open(file.path, "rb") as handle:
        handle.seek(entry.offset)
        raw = handle.read(entry.nbytes)
    if entry.kind in PLAIN:
        return np.frombuffer(raw, dtype=PLAIN[entry.kind]).reshape(entry.shape)
    from gguf.quants import dequantize, quant_shape_to_byte_shape

    data = np.frombuffer(raw, dtype=np.uint8).reshape(quant_shape_to_byte_shape(entry.shape, entry.kind))
    try:
        return dequantize(data, entry.kind)
    except NotImplementedError:
        raise CheckpointError(
            f"{file.path}: tensor {entry.name} is stored as {entry.kind.name}, which the gguf package cannot "
            f"dequantize; convert the drafter with --outtype f32, f16, bf16 or q8_0"
        ) from None
