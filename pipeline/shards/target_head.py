"""The target head: the target's input embedding and lm_head (and, when an MTP head is to be
scored, its final norm's weight: the MTP head reads the final hidden state after that norm, which
the shards keep before it, id L), stored once per extract as a standard safetensors file, written and read as a stream. At large vocabularies the two matrices
are several GiB; safetensors' in-memory save/load would hold the whole file beside the tensors."""

from __future__ import annotations

import json
import zlib

import pyarrow.fs as pafs
import torch

from pipeline.common.dtypes import SAFETENSORS_NAMES, STORAGE_NAMES
from pipeline.common.space import writing
from pipeline.shards.files import exists, join, open_fs
from pipeline.shards.schema import TARGET_HEAD_NAME, ShardError

_STREAM_STEP = 64 << 20


def save_target_head(
    uri: str, embed_tokens: torch.Tensor, lm_head: torch.Tensor, final_norm: torch.Tensor | None = None
) -> dict:
    """Store the target's input embedding and output head once (and its final norm's weight [H]
    when given); returns the manifest entry, whose `final_norm` says whether the file holds it
    (heads stored before it existed hold none: read as false)."""
    tied = lm_head.data_ptr() == embed_tokens.data_ptr() or (
        lm_head.shape == embed_tokens.shape and torch.equal(lm_head, embed_tokens)
    )
    weights = {"embed_tokens": embed_tokens.detach().cpu().contiguous()}
    if not tied:
        weights["lm_head"] = lm_head.detach().cpu().contiguous()
    if final_norm is not None:
        weights["final_norm"] = final_norm.detach().cpu().contiguous()
    fs, root = open_fs(uri)
    crc, size = write_safetensors_stream(fs, join(root, TARGET_HEAD_NAME), weights)
    return {
        "file": TARGET_HEAD_NAME,
        "tied": bool(tied),
        "crc32": crc,
        "bytes": size,
        "dtype": STORAGE_NAMES[embed_tokens.dtype],
        "final_norm": final_norm is not None,
    }


HEAD_FIX = "restore it from a copy, or re-run the extract with --overwrite"


def load_target_head(uri: str, expected: dict | int | None) -> dict[str, torch.Tensor]:
    """{'embed_tokens', 'lm_head'[, 'final_norm']} of an extract directory (lm_head is embed_tokens when tied),
    checked against the manifest's entry: its size first (a truncated or extended file is refused
    before anything is allocated), then its crc32. `expected` is that entry (or a bare crc32, or
    None when the manifest records nothing)."""
    fs, root = open_fs(uri)
    path = join(root, TARGET_HEAD_NAME)
    if not exists(fs, path):
        raise ShardError(f"{path}: missing; the extract did not store the target's embedding and lm_head")
    entry = expected if isinstance(expected, dict) else {"crc32": expected}
    expected_crc, expected_bytes = entry.get("crc32"), entry.get("bytes")
    size = fs.get_file_info(path).size
    if expected_bytes is not None and size != expected_bytes:
        raise ShardError(
            f"{path}: {size} bytes, the manifest says {expected_bytes}; the file is truncated or was "
            f"replaced: {HEAD_FIX}"
        )
    weights, crc = read_safetensors_stream(fs, path)
    if expected_crc is not None and crc != expected_crc:
        raise ShardError(f"{path}: checksum mismatch; the file is damaged: {HEAD_FIX}")
    if "embed_tokens" not in weights:
        raise ShardError(f"{path}: no 'embed_tokens' tensor; {HEAD_FIX}")
    if "lm_head" not in weights:
        weights["lm_head"] = weights["embed_tokens"]
    return weights


def write_safetensors_stream(fs: pafs.FileSystem, path: str, weights: dict[str, torch.Tensor]) -> tuple[int, int]:
    """A standard safetensors file (8-byte header length, JSON header, raw little-endian data),
    written piece by piece to a temporary name and renamed; returns (crc32, bytes)."""
    header, offset = {}, 0
    for name, tensor in weights.items():
        if tensor.dtype not in SAFETENSORS_NAMES:
            raise ValueError(f"target head tensor {name!r}: dtype {tensor.dtype} is not stored (use fp32/bf16/fp16)")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    crc, size = 0, 0
    with writing(path, 8 + len(text) + offset), fs.open_output_stream(path + ".tmp") as stream:
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
    """(tensors, crc32 of the file): each tensor allocated once and filled piece by piece. The
    header is checked against the file's size before any tensor is allocated, so a damaged header
    is a ShardError naming the file, never a huge allocation or a traceback."""
    names = {v: k for k, v in SAFETENSORS_NAMES.items()}
    size = fs.get_file_info(path).size

    def damaged(why: str) -> ShardError:
        return ShardError(f"{path}: {why}; the file is damaged: {HEAD_FIX}")

    with fs.open_input_stream(path) as stream:
        length_bytes = stream.read(8)
        length = int.from_bytes(length_bytes, "little")
        if len(length_bytes) < 8 or length > size - 8:
            raise damaged(f"header length {length} does not fit in its {size} bytes")
        text = stream.read(length)
        crc = zlib.crc32(text, zlib.crc32(length_bytes))
        layout = _header_layout(text, names, size - 8 - length, damaged)
        weights, position = {}, 0
        for name, info in layout:
            begin, end = info["data_offsets"]
            if begin != position:
                raise damaged(f"unexpected safetensors layout at {name!r}")
            tensor = torch.empty(info["shape"], dtype=names[info["dtype"]])
            raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            for start in range(0, end - begin, _STREAM_STEP):
                piece = stream.read(min(_STREAM_STEP, end - begin - start))
                if len(piece) != min(_STREAM_STEP, end - begin - start):
                    raise damaged(f"truncated in {name!r}")
                raw[start : start + len(piece)] = piece
                crc = zlib.crc32(piece, crc)
            weights[name], position = tensor, end
        crc = zlib.crc32(stream.read(), crc)  # nothing should follow; counted if it does
    return weights, crc


def _header_layout(text: bytes, names: dict, data_bytes: int, damaged) -> list[tuple[str, dict]]:
    """The header's tensors sorted by offset, each entry checked (_describes_tensor)."""
    try:
        header = json.loads(text.decode("utf-8"))
    except ValueError as error:  # invalid UTF-8 or JSON
        raise damaged(f"its header is not valid JSON ({error})") from error
    if not isinstance(header, dict):
        raise damaged("its header is not a JSON object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        if not _describes_tensor(info, names, data_bytes):
            raise damaged(f"its header entry {name!r} does not describe a tensor in the file")
    return sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])


def _describes_tensor(info, names: dict, data_bytes: int) -> bool:
    """A known dtype, a shape of counts whose bytes are exactly its data range, inside the
    `data_bytes` that follow the header."""

    def ints(values) -> bool:
        return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)

    if not isinstance(info, dict) or info.get("dtype") not in names:
        return False
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not ints(shape) or not ints(offsets) or len(offsets) != 2 or any(d < 0 for d in shape):
        return False
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=names[info["dtype"]]).element_size()
    return 0 <= offsets[0] <= offsets[1] <= data_bytes and numel * itemsize == offsets[1] - offsets[0]
