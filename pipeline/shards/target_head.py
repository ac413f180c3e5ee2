"""The target head: the target's input embedding and lm_head, stored once per extract as a
standard safetensors file, written and read as a stream. At large vocabularies the two matrices
are several GiB; safetensors' in-memory save/load would hold the whole file beside the tensors."""

from __future__ import annotations

import json
import zlib

import pyarrow.fs as pafs
import torch

from pipeline.shards.encodings import DTYPE_NAMES
from pipeline.shards.files import exists, join, open_fs
from pipeline.shards.schema import TARGET_HEAD_NAME, ShardError

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
    return {
        "file": TARGET_HEAD_NAME,
        "tied": bool(tied),
        "crc32": crc,
        "bytes": size,
        "dtype": DTYPE_NAMES[embed_tokens.dtype],
    }


def load_target_head(uri: str, expected_crc: int | None) -> dict[str, torch.Tensor]:
    """{'embed_tokens', 'lm_head'} of an extract directory (lm_head is embed_tokens when tied),
    checked against the manifest's crc32 when it records one."""
    fs, root = open_fs(uri)
    path = join(root, TARGET_HEAD_NAME)
    if not exists(fs, path):
        raise ShardError(f"{path}: missing; the extract did not store the target's embedding and lm_head")
    weights, crc = read_safetensors_stream(fs, path)
    if expected_crc is not None and crc != expected_crc:
        raise ShardError(f"{path}: checksum mismatch; re-run the extract with --overwrite")
    if "lm_head" not in weights:
        weights["lm_head"] = weights["embed_tokens"]
    return weights


def write_safetensors_stream(fs: pafs.FileSystem, path: str, weights: dict[str, torch.Tensor]) -> tuple[int, int]:
    """A standard safetensors file (8-byte header length, JSON header, raw little-endian data),
    written piece by piece to a temporary name and renamed; returns (crc32, bytes)."""
    header, offset = {}, 0
    for name, tensor in weights.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"target head tensor {name!r}: dtype {tensor.dtype} is not stored (use fp32/bf16/fp16)")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
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
            yield raw[start : start + _STREAM_STEP]


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
                raise ShardError(
                    f"{path}: unexpected safetensors layout at {name!r}; re-run the extract with --overwrite"
                )
            tensor = torch.empty(info["shape"], dtype=names[info["dtype"]])
            raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            for start in range(0, end - begin, _STREAM_STEP):
                piece = stream.read(min(_STREAM_STEP, end - begin - start))
                if not piece:
                    raise ShardError(f"{path}: truncated in {name!r}; re-run the extract with --overwrite")
                raw[start : start + len(piece)] = piece
                crc = zlib.crc32(piece, crc)
            weights[name], position = tensor, end
        crc = zlib.crc32(stream.read(), crc)  # nothing should follow; counted if it does
    return weights, crc
