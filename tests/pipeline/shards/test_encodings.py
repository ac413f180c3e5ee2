"""Byte planes (pipeline/shards/encodings.py): every dtype round trips bit for bit, bytes grouped
by significance, channel-major, wrong sizes refused."""

from __future__ import annotations

import pytest
import torch

from pipeline import shards
from pipeline.common.dtypes import STORAGE_DTYPES
from pipeline.shards import ShardError
from tests.helpers.shards import same_bits


@pytest.mark.parametrize("dtype", list(STORAGE_DTYPES))
@pytest.mark.parametrize("shape", [(0, 4), (7,), (3, 5, 2), (1,)])
def test_byte_planes_round_trip_every_dtype(dtype, shape):
    torch_dtype = STORAGE_DTYPES[dtype]
    raw = torch.randint(
        0,
        256,
        (int(torch.tensor(shape).prod()) * torch.empty((), dtype=torch_dtype).element_size(),),
        dtype=torch.uint8,
    )
    tensor = raw.view(torch_dtype).view(*shape)  # every bit pattern, NaNs and infs included
    decoded = shards.decode_tensor(shards.encode_tensor(tensor), torch_dtype, list(shape))
    assert same_bits(decoded, tensor)


def test_byte_planes_group_bytes_by_significance():
    tensor = torch.tensor([1.0, -2.0, 3.5], dtype=torch.bfloat16)
    planes = bytes(shards.encode_tensor(tensor))
    raw = tensor.view(torch.uint8).tolist()  # little endian: low byte, high byte per element
    assert list(planes) == raw[0::2] + raw[1::2]


def test_byte_planes_are_channel_major():
    """[tokens, channels]: plane by plane, channel by channel, every token of that channel."""
    tensor = torch.arange(6, dtype=torch.int16).view(3, 2) + 256 * torch.tensor([1, 2], dtype=torch.int16)
    planes = list(bytes(shards.encode_tensor(tensor)))
    low = [int(tensor[t, c]) & 0xFF for c in range(2) for t in range(3)]
    high = [int(tensor[t, c]) >> 8 for c in range(2) for t in range(3)]
    assert planes == low + high
    decoded = shards.decode_tensor(shards.encode_tensor(tensor), torch.int16, [3, 2])
    assert torch.equal(decoded, tensor) and decoded.stride() == (1, 3)  # a transposed view, no copy


def test_decode_rejects_wrong_size():
    with pytest.raises(ShardError, match="expected 16"):
        shards.decode_tensor(shards.encode_tensor(torch.zeros(3, dtype=torch.float32)), torch.float32, [4])
