"""`specreplay score --ckpt <target dir>` refusing an MTP head it cannot score: one `error:` line,
no traceback, nothing written. A target without `mtp.*` tensors; shards without the final hidden
state before the norm (id L) or without the final norm's weight, each naming the extract command
that stores them; for speculators' export of the same head (`score --ckpt <export dir>`), the
same line but for the checkpoint's path. The export's NaN placeholder for a tensor speculators
never uses is not read; NaN in a weight the head reads is refused."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from pipeline.shards import ShardSet, read_manifest, write_manifest
from proposers.checkpoints.files import NonFiniteWeightsError
from proposers.checkpoints.load import load_drafter
from tests.helpers import chain_parity as parity, mtp_export, mtp_online as online, mtp_replay as replay
from tests.helpers.prompts import write_prompts


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(a tiny Qwen3.5 target with an mtp.* head, the same without one, a prompts file)."""
    tmp = tmp_path_factory.mktemp("mtp_errors")
    with_head, _, head = online.build_target(tmp / "with-head")
    online.save_head(head, with_head)
    without, _, _ = online.build_target(tmp / "without-head")
    prompts = write_prompts(tmp / "prompts.jsonl", [{"id": "p0", "input_ids": parity.prompt_ids(1)[0]}])
    return with_head, without, prompts


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    """speculators' export of the target's head (tests/helpers/mtp_export.py)."""
    return mtp_export.export(target[0], tmp_path_factory.mktemp("mtp_export") / "export", 3)


def _same_for_the_export(line: str, with_head: str, exported: str, shards: str, out) -> None:
    """The export's error line is the target dir's, the checkpoint's path aside."""
    # the shards' own `--model` (the target dir) stays as it is in both
    assert _errors(exported, shards, out).replace(exported, with_head) == line


_errors = replay.score_error


def test_a_target_without_mtp_weights(target, tmp_path):
    with_head, without, prompts = target
    shards = parity.extract(tmp_path / "shards", without, prompts, 6, [online.TEXT["num_hidden_layers"]])
    line = _errors(without, shards, tmp_path / "out")
    assert "no 'mtp.*' tensors" in line and "no native MTP head" in line, line


def test_shards_without_the_prenorm_final_hidden_state(target, exported, tmp_path):
    with_head, _, prompts = target
    shards = parity.extract(tmp_path / "shards", with_head, prompts, 6, [1])
    line = _errors(with_head, shards, tmp_path / "out")
    assert "missing [3]" in line and "specreplay extract" in line and "--layer-ids 1,3" in line, line
    _same_for_the_export(line, with_head, exported, shards, tmp_path / "out-export")


def test_shards_without_the_final_norm_weight(target, exported, tmp_path):
    with_head, _, prompts = target
    shards = parity.extract(tmp_path / "shards", with_head, prompts, 6, [online.TEXT["num_hidden_layers"]])
    manifest = read_manifest(shards)
    manifest["target_head"].pop("final_norm")  # as written before the norm weight was stored
    write_manifest(shards, manifest)
    line = _errors(with_head, shards, tmp_path / "out")
    assert "no final norm weight" in line and "specreplay extract" in line and "--layer-ids 3" in line, line
    _same_for_the_export(line, with_head, exported, shards, tmp_path / "out-export")


def test_extract_stores_the_final_norm_weight_with_id_l(target, tmp_path):
    with_head, _, prompts = target
    shards = parity.extract(tmp_path / "shards", with_head, prompts, 6, [online.TEXT["num_hidden_layers"]])
    head = ShardSet(shards).target_head()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(with_head, dtype=torch.float32)
    assert torch.equal(head["final_norm"], model.model.norm.weight.detach())


def test_the_exports_nan_placeholder_is_not_read_but_a_nan_weight_is_refused(target, exported, tmp_path):
    """speculators' converter saves `verifier_lm_head.weight` as NaN, a tensor speculators never
    uses: the export loads. NaN in a weight the head does read is still refused, by name."""
    with_head, _, prompts = target
    assert torch.isnan(load_file(os.path.join(exported, "model.safetensors"))["verifier_lm_head.weight"]).all()
    load_drafter(exported, target_layers=online.TEXT["num_hidden_layers"])
    damaged = mtp_export.swapped_copy(
        exported, tmp_path / "damaged", "mtp_layers.0.final_layernorm.weight", "verifier_lm_head.weight"
    )
    with pytest.raises(NonFiniteWeightsError, match="mtp_layers.0.final_layernorm.weight has"):
        load_drafter(damaged, target_layers=online.TEXT["num_hidden_layers"])
