"""proposers.checkpoints.load: every accepted checkpoint layout loads to the same weights, every broken
one fails before compute with an error naming the file, the tensors and both values."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from proposers.checkpoints.compatibility import CompatibilityError, check_compatibility
from proposers.checkpoints.files import CheckpointError, content_hash, display_name, parse_step
from proposers.checkpoints.load import load_drafter, read_drafter_config
from proposers.detect import parse_drafter_config
from proposers.toolkit.config import DrafterConfigError
from scoring.replay.packing import select_feature_columns
from tests.helpers.drafters import (
    REFERENCE_HIDDEN as HIDDEN,
    REFERENCE_MASK as MASK,
    REFERENCE_VOCAB as VOCAB,
    reference_drafter,
)


@pytest.fixture(scope="module")
def reference():
    """The public reference drafter: the checkpoints here are written by its own save_pretrained."""
    return reference_drafter()


@pytest.fixture
def weights(reference):
    """The reference state dict (fresh copy per test, so tests may edit it)."""
    return {name: tensor.clone() for name, tensor in reference.state_dict().items()}


@pytest.fixture
def config_raw(reference):
    return reference.config.to_dict()


def write_config(directory, raw: dict) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "config.json")
    with open(path, "w") as handle:
        json.dump(raw, handle)
    return path


def assert_same_weights(drafter, weights: dict) -> None:
    state = drafter.state_dict()
    assert set(state) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name


# ---------------------------------------------------------------------------------------------
# layouts


def test_zlab_directory(tmp_path, weights):
    reference_drafter(tmp_path / "Qwen3-tiny-DFlash")
    drafter, info = load_drafter(str(tmp_path / "Qwen3-tiny-DFlash"))
    assert_same_weights(drafter, weights)
    assert info.path == str(tmp_path / "Qwen3-tiny-DFlash")
    assert info.name == "Qwen3-tiny-DFlash"
    assert info.step is None
    assert info.config.mask_token_id == MASK and info.config.target_layer_ids == [1, 3]
    assert info.config_raw["dflash_config"]["mask_token_id"] == MASK
    assert info.stripped_prefixes == []
    assert len(info.content_hash) == 64
    assert not drafter.training and not any(p.requires_grad for p in drafter.parameters())


def test_zlab_sharded_directory_with_index(tmp_path, weights, config_raw):
    directory = tmp_path / "sharded"
    names = sorted(weights)
    half = len(names) // 2
    files = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    write_config(directory, config_raw)
    weight_map = {}
    for file, part in files.items():
        save_file({name: weights[name] for name in part}, str(directory / file))
        weight_map.update({name: file for name in part})
    with open(directory / "model.safetensors.index.json", "w") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)
    drafter, info = load_drafter(str(directory))
    assert_same_weights(drafter, weights)
    assert [os.path.basename(f) for f in info.weight_files] == sorted(files)

    os.remove(directory / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_drafter(str(directory))


@pytest.mark.parametrize(
    "prefix",
    ["module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module.", "model.", "draft_model.", "module.drafter."],
)
def test_training_safetensors_with_wrapper_prefixes(tmp_path, weights, config_raw, prefix):
    write_config(tmp_path / "run", config_raw)
    path = tmp_path / "run" / "step_20000.safetensors"
    save_file({prefix + name: tensor for name, tensor in weights.items()}, str(path))
    drafter, info = load_drafter(str(path))
    assert_same_weights(drafter, weights)
    assert info.stripped_prefixes == [prefix]
    assert info.step == 20000
    assert info.name == "run/step_20000.safetensors"


@pytest.mark.parametrize("nesting", ["model", "state_dict", "module", "model_state_dict"])
def test_training_pt_nested_state_dict(tmp_path, weights, config_raw, nesting):
    write_config(tmp_path / "ckpts", config_raw)
    path = tmp_path / "ckpts" / "latest.pt"
    optimizer = {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 1e-4}]}
    wrapped = {f"module.{name}": tensor for name, tensor in weights.items()}
    torch.save({nesting: wrapped, "optimizer": optimizer, "global_step": 1500}, str(path))
    drafter, info = load_drafter(str(path))
    assert_same_weights(drafter, weights)
    assert info.step == 1500  # from the checkpoint's own metadata, the path has none


def test_directory_holding_one_pt_and_config(tmp_path, weights, config_raw):
    directory = tmp_path / "checkpoint-1500"
    write_config(directory, config_raw)
    torch.save(weights, str(directory / "pytorch_model.bin"))
    drafter, info = load_drafter(str(directory))
    assert_same_weights(drafter, weights)
    assert info.step == 1500
    assert info.name == f"{tmp_path.name}/checkpoint-1500"  # a bare step dir gets its run's name


def test_explicit_config_path(tmp_path, weights, config_raw):
    path = tmp_path / "weights" / "drafter.safetensors"
    path.parent.mkdir()
    save_file(weights, str(path))
    with pytest.raises(CheckpointError, match="config.json"):
        load_drafter(str(path))
    with pytest.raises(CheckpointError, match="nowhere.json does not exist"):
        load_drafter(str(path), config_path=str(tmp_path / "nowhere.json"))
    config = write_config(tmp_path / "elsewhere", config_raw)
    drafter, info = load_drafter(str(path), config_path=config)
    assert_same_weights(drafter, weights)
    assert info.config_file == config
    assert read_drafter_config(str(path), config_path=config).hidden_size == HIDDEN


def test_pt_that_needs_unpickling_is_refused(tmp_path, weights, config_raw):
    write_config(tmp_path, config_raw)
    path = tmp_path / "unsafe.pt"
    torch.save({"model": weights, "args": Opaque()}, str(path))
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_drafter(str(path))


class Opaque:
    """A class torch.load(weights_only=True) must refuse to rebuild."""


def test_bfloat16_keeps_rotary_frequencies_in_float32(tmp_path):
    reference_drafter(tmp_path / "d")
    drafter, _ = load_drafter(str(tmp_path / "d"), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in drafter.parameters())
    # As the reference's from_pretrained(dtype=bf16): inv_freq stays float32.
    assert {b.dtype for b in drafter.buffers()} == {torch.float32}


def test_rotary_buffers_in_checkpoint_are_ignored(tmp_path, weights, config_raw):
    write_config(tmp_path, config_raw)
    extra = {"rotary_emb.inv_freq": torch.ones(4), "model.rotary_emb.inv_freq": torch.ones(4)}
    save_file({**weights, **extra}, str(tmp_path / "w.safetensors"))
    drafter, _ = load_drafter(str(tmp_path / "w.safetensors"))
    assert_same_weights(drafter, weights)


# ---------------------------------------------------------------------------------------------
# strictness


def test_missing_keys_are_listed(tmp_path, weights, config_raw):
    write_config(tmp_path, config_raw)
    dropped = sorted(name for name in weights if name.startswith("layers.1.mlp."))
    save_file({k: v for k, v in weights.items() if k not in dropped}, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError) as error:
        load_drafter(str(tmp_path / "w.safetensors"))
    message = str(error.value)
    assert "3 missing" in message and all(name in message for name in dropped)
    assert str(tmp_path / "w.safetensors") in message


def test_unexpected_keys_are_listed_under_their_saved_names(tmp_path, weights, config_raw):
    write_config(tmp_path, config_raw)
    foreign = {"model.embed_tokens.weight": torch.zeros(VOCAB, HIDDEN), "lm_head.weight": torch.zeros(VOCAB, HIDDEN)}
    save_file({**weights, **foreign}, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError) as error:
        load_drafter(str(tmp_path / "w.safetensors"))
    message = str(error.value)
    assert "2 unexpected" in message and "model.embed_tokens.weight" in message and "lm_head.weight" in message
    assert "missing" not in message


def test_two_models_in_one_file_is_an_error_not_a_guess(tmp_path, weights, config_raw):
    write_config(tmp_path, config_raw)
    both = {**weights, **{"module." + name: tensor + 1 for name, tensor in weights.items()}}
    save_file(both, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError, match="both map to drafter weight"):
        load_drafter(str(tmp_path / "w.safetensors"))


def test_wrong_hidden_size_names_tensor_and_both_shapes(tmp_path, config_raw):
    reference_drafter(tmp_path / "d")
    write_config(tmp_path / "d", {**config_raw, "hidden_size": 48})
    with pytest.raises(CheckpointError) as error:
        load_drafter(str(tmp_path / "d"))
    message = str(error.value)
    assert "fc.weight: checkpoint [32, 64] vs config [48, 96]" in message
    assert "hidden_size 48" in message and "config.json" in message


def test_a_dflash2_config_is_read_as_dflash2_never_as_v1(tmp_path, config_raw):
    """The DFlash2 architecture or one DFlash2 field makes the file a DFlash2 config: read as
    DFlash v1 its selector and convolutions would be dropped silently; without the rest of its
    fields it is refused naming the first missing one."""
    reference_drafter(tmp_path / "d")
    write_config(tmp_path / "d", {**config_raw, "architectures": ["DFlash2DraftModel"]})
    with pytest.raises(DrafterConfigError, match=r"DFlash2 field dflash_config.conv_kernel_size is missing"):
        load_drafter(str(tmp_path / "d"))
    dflash2 = {**config_raw["dflash_config"], "conv_kernel_size": 4}
    write_config(tmp_path / "d", {**config_raw, "dflash_config": dflash2})
    with pytest.raises(DrafterConfigError, match=r"DFlash2 field dflash_config.conv_group_size is missing"):
        load_drafter(str(tmp_path / "d"))


def test_config_without_mask_token_is_refused(tmp_path, config_raw):
    reference_drafter(tmp_path / "d")
    raw = {**config_raw, "dflash_config": {"target_layer_ids": [1, 3]}}
    write_config(tmp_path / "d", raw)
    with pytest.raises(DrafterConfigError, match="mask_token_id"):
        load_drafter(str(tmp_path / "d"))


def test_missing_config_and_missing_path(tmp_path, weights):
    save_file(weights, str(tmp_path / "model.safetensors"))
    for path in (tmp_path, tmp_path / "model.safetensors"):  # a directory, and its weight file
        with pytest.raises(CheckpointError) as caught:
            load_drafter(str(path))
        message = str(caught.value)
        assert f"the drafter config {tmp_path / 'config.json'} is missing" in message
        assert f"put the drafter's config.json (the one it was trained with) in {tmp_path}, beside" in message
        assert "--" not in message  # no command-line option to point at: the config travels with the weights
    with pytest.raises(CheckpointError, match="no such file"):
        load_drafter(str(tmp_path / "nope"))


def test_ambiguous_directory_is_refused(tmp_path, weights, config_raw):
    write_config(tmp_path, config_raw)
    save_file(weights, str(tmp_path / "a.safetensors"))
    torch.save(weights, str(tmp_path / "b.pt"))
    with pytest.raises(CheckpointError, match="several weight files"):
        load_drafter(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# identity


@pytest.mark.parametrize(
    "path, step",
    [
        ("/runs/a/step_20000", 20000),
        ("/runs/a/checkpoint-1500", 1500),
        ("/runs/a/step20000/model.safetensors", 20000),
        ("/runs/a/global_step500/mp_rank_00_model_states.pt", 500),
        ("/runs/a/ckpt-000750.pt", 750),
        ("/runs/a/epoch_2_step_300.pt", 300),
        ("/runs/step_100/ckpts/step_200.safetensors", 200),  # nearest component wins
        ("/models/Qwen3-8B-DFlash-b16", None),
        ("/models/steps_are_not_numbers", None),
    ],
)
def test_step_from_path(path, step):
    assert parse_step(path) == step


def test_step_from_config_beats_path():
    assert parse_step("/runs/step_5", {"training_step": 7}) == 7
    assert parse_step("/runs/step_5", {"step": "9"}) == 9
    assert parse_step("/runs/step_5", {"step": True}) == 5  # a flag, not a step


def test_display_names():
    assert display_name("/models/Qwen3-8B-DFlash-b16") == "Qwen3-8B-DFlash-b16"


def test_content_hash_is_stable_and_tracks_weights_and_config(tmp_path, weights, config_raw):
    write_config(tmp_path, config_raw)
    path = tmp_path / "w.safetensors"
    save_file(weights, str(path))
    first = load_drafter(str(path))[1].content_hash
    assert load_drafter(str(path))[1].content_hash == first
    assert content_hash([str(path)], config_raw) == first
    # Re-indenting config.json changes no content.
    with open(tmp_path / "config.json", "w") as handle:
        json.dump(config_raw, handle, indent=4)
    assert load_drafter(str(path))[1].content_hash == first

    changed = dict(weights)
    changed["norm.weight"] = changed["norm.weight"].clone()
    changed["norm.weight"][0] += 1e-3
    save_file(changed, str(path))
    assert load_drafter(str(path))[1].content_hash != first
    save_file(weights, str(path))
    assert load_drafter(str(path))[1].content_hash == first
    write_config(tmp_path, {**config_raw, "rms_norm_eps": 1e-5})
    assert load_drafter(str(path))[1].content_hash != first


# ---------------------------------------------------------------------------------------------
# compatibility with the shards' manifest


def manifest(layer_ids=(0, 1, 3, 5), num_layers=6, hidden=HIDDEN, vocab=VOCAB) -> dict:
    """As pipeline/extract/run.py writes it: the identity subset in settings.target, the full
    TargetInfo (with name and path) at the top level."""
    identity = {
        "architecture": "Qwen3ForCausalLM",
        "num_layers": num_layers,
        "hidden_size": hidden,
        "vocab_size": vocab,
    }
    return {
        "format_version": 1,
        "settings": {"layer_ids": list(layer_ids), "target": identity},
        "target": {"name": "tiny-target", "path": "/models/tiny-target", **identity},
    }


@pytest.fixture
def config(config_raw):
    return parse_drafter_config(config_raw)


def test_compatible_shards_select_feature_columns_in_drafter_order(config):
    # Stored order [5, 3, 0, 1]; drafter wants [1, 3]: blocks 3 then 1 of the stored features.
    stored = [5, 3, 0, 1]
    check_compatibility(config, manifest(stored), "ckpt")  # no error
    features = torch.cat([torch.full((2, HIDDEN), float(layer)) for layer in stored], dim=-1)
    selected = select_feature_columns(features, stored, config.target_layer_ids)
    assert selected.shape == (2, 2 * HIDDEN)
    assert torch.equal(selected[:, :HIDDEN], torch.full((2, HIDDEN), 1.0))
    assert torch.equal(selected[:, HIDDEN:], torch.full((2, HIDDEN), 3.0))


def test_layer_ids_not_stored(config):
    with pytest.raises(CompatibilityError) as error:
        check_compatibility(config, manifest([0, 1, 2]), "/ckpts/d")
    message = str(error.value)
    assert "[1, 3]" in message and "[0, 1, 2]" in message and "missing [3]" in message
    assert "--layer-ids 0,1,2,3" in message and "/ckpts/d" in message and "tiny-target" in message


def test_hidden_size_mismatch(config):
    with pytest.raises(CompatibilityError, match="hidden_size 32 .* != target hidden_size 48"):
        check_compatibility(config, manifest(hidden=48), "ckpt")


def test_mask_token_out_of_range(config):
    with pytest.raises(CompatibilityError, match=r"mask_token_id 60 .*vocab_size 50, valid ids 0..49"):
        check_compatibility(config, manifest(vocab=50), "ckpt")


def test_vocab_mismatch_is_an_error(config):
    with pytest.raises(CompatibilityError, match="vocab_size 64 != target vocab_size 128"):
        check_compatibility(config, manifest(vocab=128), "ckpt")


def test_num_target_layers_mismatch(config):
    with pytest.raises(CompatibilityError, match="num_target_layers 6 != target num_layers 8"):
        check_compatibility(config, manifest(num_layers=8), "ckpt")


def test_block_size_below_two(config):
    with pytest.raises(CompatibilityError, match="block_size 1"):
        check_compatibility(dataclasses.replace(config, block_size=1), manifest(), "ckpt")


def test_manifest_without_settings(config):
    with pytest.raises(CompatibilityError, match="settings.layer_ids"):
        check_compatibility(config, {"format_version": 1}, "ckpt")
