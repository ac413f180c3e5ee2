"""How a tensor becomes bytes: dtype names, channel-major byte planes, zstd frames held in row 0
of a chunk's column, and the opt-in fp8 quantization of features with per-token scales."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from pipeline.shards.schema import ShardError

_UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {2: np.int16, 4: np.int32, 8: np.int64}  # numpy types torch.from_numpy accepts

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
    """Inverse of encode_tensor, as a view of shape `shape` with stride 1 along axis 0. The planes
    are re-interleaved by a vectorised shift-or, so no Python runs per element."""
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


# ---------------------------------------------------------------------------------------------
# zstd frames: one per tensor and chunk, in row 0 of a large_binary column


def frame_codec(name: str, level: int | None = None) -> pa.Codec | None:
    """The codec a schema names (`CODEC_KEY`); None for "none", frames that are raw planes."""
    if name == "none":
        return None
    return pa.Codec(name) if level is None else pa.Codec(name, compression_level=level)


def compress_frame(planes: pa.Buffer, codec: pa.Codec | None) -> pa.Buffer:
    return planes if codec is None else codec.compress(planes)


def decompress_frame(frame: pa.Buffer, codec: pa.Codec | None, size: int, name: str) -> pa.Buffer:
    """The planes of a frame, `size` bytes. Called only after the chunk's checksum matched, so a
    frame that does not decode is a writer bug, still reported as a ShardError."""
    if codec is None:
        return frame
    try:
        return codec.decompress(frame, decompressed_size=size)
    except (pa.ArrowException, OSError) as error:
        raise ShardError(f"tensor {name!r}: zstd frame does not decode to {size} bytes ({error})") from error


def frame_column(frame: pa.Buffer, rows: int) -> pa.Array:
    """A large_binary array holding `frame` in row 0 and nulls after, without copying it."""
    offsets = pa.py_buffer(np.array([0] + [frame.size] * rows, dtype=np.int64))
    validity = None
    if rows > 1:
        validity = pa.py_buffer(np.packbits(np.arange(rows) == 0, bitorder="little"))
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), rows, [validity, offsets, frame], null_count=rows - 1)


def chunk_frame(column: pa.Array) -> pa.Buffer:
    """Row 0 of a large_binary column as a zero-copy slice (`column[0].as_buffer()` copies)."""
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int64, count=2, offset=8 * column.offset)
    return column.buffers()[2].slice(int(offsets[0]), int(offsets[1] - offsets[0]))


# ---------------------------------------------------------------------------------------------
# fp8 features (lossy, opt-in)

FP8_MAX = 448.0  # largest finite float8_e4m3fn


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
