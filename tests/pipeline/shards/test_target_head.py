"""The target head file (pipeline/shards/target_head.py): a standard safetensors file, checked
against the manifest's crc32, tied and untied heads round trip."""

from __future__ import annotations

import pytest
import torch

from pipeline import shards
from pipeline.shards import ShardError, ShardSet


def test_target_head_is_a_standard_safetensors_file(tmp_path):
    """Written as a stream, read back by safetensors itself and by the streaming reader."""
    from safetensors.torch import load_file

    embed, head = torch.randn(70, 8).to(torch.bfloat16), torch.randn(70, 8)
    shards.write_manifest(str(tmp_path), {"format_version": shards.FORMAT_VERSION, "complete": True, "tensors": {}})
    entry = shards.save_target_head(str(tmp_path), embed, head)
    path = tmp_path / shards.TARGET_HEAD_NAME
    loaded = load_file(str(path))
    assert torch.equal(loaded["embed_tokens"], embed) and torch.equal(loaded["lm_head"], head)
    assert entry["bytes"] == path.stat().st_size and entry["crc32"] == shards.file_crc32(*shards.open_fs(str(path)))[0]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    manifest = shards.read_manifest(str(tmp_path))
    manifest["target_head"] = entry
    shards.write_manifest(str(tmp_path), manifest)
    with pytest.raises(ShardError, match="checksum mismatch"):
        ShardSet(str(tmp_path)).target_head()


def test_target_head_round_trip(tmp_path):
    embed = torch.randn(50, 8)
    shards.write_manifest(str(tmp_path), {"format_version": shards.FORMAT_VERSION, "complete": True, "tensors": {}})
    tied = shards.save_target_head(str(tmp_path), embed, embed)
    assert tied["tied"]
    manifest = shards.read_manifest(str(tmp_path))
    manifest["target_head"] = tied
    shards.write_manifest(str(tmp_path), manifest)
    head = ShardSet(str(tmp_path)).target_head()
    assert torch.equal(head["embed_tokens"], embed) and torch.equal(head["lm_head"], embed)
    untied = shards.save_target_head(str(tmp_path), embed, embed * 2)
    assert not untied["tied"]
    manifest["target_head"] = untied
    shards.write_manifest(str(tmp_path), manifest)
    assert torch.equal(ShardSet(str(tmp_path)).target_head()["lm_head"], embed * 2)
