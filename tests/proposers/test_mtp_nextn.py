"""A GLM-4.5 target's NextN head (proposers/mtp/nextn.py) loaded from the target's checkpoint, and
`specreplay score --ckpt <target dir>` refusing one it cannot score in one `error:` line naming the
file and the field, nothing written, no traceback: a config promising a head
(`num_nextn_predict_layers` 1) whose checkpoint holds no `model.layers.{L}.*` tensors; an expert
count in the checkpoint other than `n_routed_experts`; `num_nextn_predict_layers` 2 over a checkpoint
holding one head (a stack missing a head would score the others' rule)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from proposers.checkpoints.load import load_drafter
from tests.helpers import chain_parity as parity, mtp_replay as replay, nextn_online
from tests.helpers.models import TINY_VOCAB, make_tokenizer, seeded
from tests.helpers.prompts import write_prompts


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(a tiny GLM-4.5 target dir with a NextN head, the head, shards of id L, the same target without a head)."""
    tmp = tmp_path_factory.mktemp("mtp_nextn")
    config = nextn_online.glm_config(TINY_VOCAB)
    model = nextn_online.build_target(config)
    with_head, without = str(tmp / "with-head"), str(tmp / "without-head")
    for model_dir in (with_head, without):
        model.save_pretrained(model_dir)
        make_tokenizer(model_dir)
    with seeded(1):
        head = nextn_online.NextnHead(config)
    nextn_online.save_head(head, with_head, model)
    prompts = write_prompts(tmp / "prompts.jsonl", [{"id": "p0", "input_ids": parity.prompt_ids(1)[0]}])
    shards = parity.extract(tmp / "shards", with_head, prompts, 6, [config.num_hidden_layers])
    return with_head, head, shards, without


def test_the_loaded_head_is_the_saved_one(target):
    """Every tensor of model.layers.{L}, renamed, the experts stacked as transformers' block holds them;
    no embedding or lm_head of its own (the target's are used)."""
    with_head, head, *_ = target
    drafter, info = load_drafter(with_head)
    assert info.config.layout == "nextn" and drafter.embed_tokens is None and drafter.lm_head is None
    loaded = drafter.state_dict()
    renames = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden"}
    for name, tensor in head.state_dict().items():
        own = renames.get(name.split(".")[0], name.split(".")[0]) + name[len(name.split(".")[0]) :]
        own = own.replace("shared_head.norm", "norm")
        assert torch.equal(loaded[own], tensor), name


def _edit_config(model_dir: str, tmp, **fields) -> str:
    """A copy of the target dir (its weights linked) whose config.json says `fields`."""
    out = tmp / "edited"
    out.mkdir()
    for name in os.listdir(model_dir):
        if name != "config.json":
            os.symlink(os.path.join(model_dir, name), out / name)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f) | fields
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_a_promised_head_the_checkpoint_lacks(target, tmp_path):
    _, _, shards, without = target
    line = replay.score_error(without, shards, tmp_path / "out")
    assert "model.safetensors" in line and "'model.layers.2.*'" in line, line
    assert "field 'num_nextn_predict_layers' is 1" in line, line


def test_an_expert_count_other_than_the_configs(target, tmp_path):
    with_head, _, shards, _ = target
    line = replay.score_error(_edit_config(with_head, tmp_path, n_routed_experts=8), shards, tmp_path / "out")
    assert "model.layers.2.mlp.experts.* holds experts 0..3 (4)" in line, line
    assert "field 'n_routed_experts' is 8" in line and "config.json" in line, line


def test_a_stack_missing_a_promised_head(target, tmp_path):
    with_head, _, shards, _ = target
    line = replay.score_error(_edit_config(with_head, tmp_path, num_nextn_predict_layers=2), shards, tmp_path / "out")
    assert "model.safetensors: model.layers.2..3.* holds heads 2," in line, line
    assert "field 'num_nextn_predict_layers' is 2" in line and "config.json" in line, line
