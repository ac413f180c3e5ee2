"""proposers.checkpoints.files.checkpoint_problem: a partly written checkpoint (truncated safetensors, a
missing shard, an empty .pt, a config cut off) is one line naming the file, found from sizes and
headers before any tensor is read; a complete checkpoint has no problem."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import proposers.checkpoints.files as checkpoint
from proposers.checkpoints.files import CheckpointError, checkpoint_problem
from proposers.checkpoints.load import load_drafter, read_drafter_config
from tests.helpers.drafters import reference_drafter


@pytest.fixture(scope="module")
def reference():
    return reference_drafter()


@pytest.fixture
def zlab(tmp_path, reference):
    """A complete z-lab directory written by the reference's own save_pretrained."""
    reference.save_pretrained(str(tmp_path / "ckpt"))
    return tmp_path / "ckpt"


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Fail the test if a loader starts reading tensors."""

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read before the checkpoint was checked")

    monkeypatch.setattr(checkpoint, "load_safetensors_file", refuse)
    monkeypatch.setattr(torch, "load", refuse)


def refused(path, needle: str) -> str:
    """The problem line, checked to be one line naming `needle`, and raised the same by both loaders."""
    problem = checkpoint_problem(str(path))
    assert problem is not None and "\n" not in problem and needle in problem, problem
    for load in (load_drafter, read_drafter_config):
        with pytest.raises(CheckpointError) as caught:
            load(str(path))
        assert str(caught.value) == problem
    return problem


def header_length(path) -> int:
    with open(path, "rb") as handle:
        return int.from_bytes(handle.read(8), "little")


def truncate(path, size: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(size)


def test_complete_checkpoint_has_no_problem(zlab):
    assert checkpoint_problem(str(zlab)) is None
    assert checkpoint_problem(str(zlab / "model.safetensors")) is None
    load_drafter(str(zlab))


@pytest.mark.parametrize("where", ["length", "header", "first data byte", "last byte"])
def test_truncated_safetensors(zlab, no_tensor_reads, where):
    weights = zlab / "model.safetensors"
    size, header = weights.stat().st_size, header_length(weights)
    cut = {"length": 5, "header": 8 + header // 2, "first data byte": 8 + header + 1, "last byte": size - 1}[where]
    truncate(weights, cut)
    problem = refused(zlab, str(weights))
    assert f"truncated ({cut} bytes" in problem
    refused(weights, str(weights))  # the weight file itself, config beside it


def test_corrupt_safetensors_header(zlab, no_tensor_reads):
    weights = zlab / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:12] = b"\xff\xfe{["
    weights.write_bytes(bytes(data))
    assert "unreadable safetensors header" in refused(zlab, str(weights))


def test_sharded_checkpoint_missing_or_truncated_shard(tmp_path, reference, no_tensor_reads):
    directory = tmp_path / "sharded"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(reference.config.to_dict()))
    weights = {name: tensor.clone() for name, tensor in reference.state_dict().items()}
    names = sorted(weights)
    files = {"model-00001-of-00002.safetensors": names[: len(names) // 2]}
    files["model-00002-of-00002.safetensors"] = names[len(names) // 2 :]
    for file, part in files.items():
        save_file({name: weights[name] for name in part}, str(directory / file))
    weight_map = {name: file for file, part in files.items() for name in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert checkpoint_problem(str(directory)) is None

    second = directory / "model-00002-of-00002.safetensors"
    truncate(second, second.stat().st_size - 3)
    assert "truncated" in refused(directory, str(second))
    os.remove(second)
    assert "model-00002-of-00002.safetensors" in refused(directory, "model.safetensors.index.json")


def test_config_missing_or_unparseable(zlab, no_tensor_reads):
    config = zlab / "config.json"
    text = config.read_text()
    config.write_text(text[: len(text) // 2])  # cut off mid-write
    assert "not valid JSON" in refused(zlab, str(config))
    config.unlink()
    assert "is missing" in refused(zlab, str(config))


def test_pt_empty_or_truncated(tmp_path, reference, no_tensor_reads):
    (tmp_path / "config.json").write_text(json.dumps(reference.config.to_dict()))
    path = tmp_path / "step_100.pt"
    torch.save(reference.state_dict(), str(path))  # a zip archive, as torch.save writes by default
    assert checkpoint_problem(str(path)) is None
    truncate(path, path.stat().st_size // 2)
    assert "truncated" in refused(path, str(path))
    truncate(path, 0)
    assert "empty (0 bytes)" in refused(path, str(path))
