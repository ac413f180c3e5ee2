"""DSpark configs the engines refuse: a checkpoint with one is one `error:` line through `specreplay
score`, naming the file and the field, nothing written, no traceback (docs/drafter-families.md#dspark)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from specreplay.cli import main
from tests.helpers.shards import tiny_synthetic


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    return tiny_synthetic(tmp_path_factory.mktemp("dspark-layouts") / "shards", lengths=[10], target_layers=4)


# DeepSpec's Gemma 4 DSpark configs the engines refuse: one `error:` line naming the field and the fix
GEMMA4_REFUSED = [
    ("layer_types", ["sliding_attention", "full_attention"], "list full_attention for each layer"),
    ("final_logit_softcapping", 30.0, "remove it"),
    ("enable_moe_block", True, "set it false"),
    ("mask_token_id", None, "missing field 'mask_token_id'"),
    ("target_layer_ids", None, "missing field 'target_layer_ids'"),
    ("draft_vocab_size", 256, "the full vocabulary"),
]


@pytest.mark.parametrize(("field", "value", "fix"), GEMMA4_REFUSED, ids=[f for f, _, _ in GEMMA4_REFUSED])
def test_a_gemma4_dspark_config_the_engines_refuse_is_one_error_naming_the_field(shards, tmp_path, field, value, fix):
    from tests.helpers.config_layouts import base, with_field

    config = with_field(base("dspark:gemma4"), field, value)
    if field == "enable_moe_block":
        config |= {"num_experts": 4, "top_k_experts": 2}
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config))
    save_file({"fc.weight": torch.zeros(64, 128)}, str(ckpt / "model.safetensors"))
    out = tmp_path / "results"
    run = CliRunner().invoke(main, ["score", "--ckpt", str(ckpt), "--shards", shards, "--out", str(out), "--quiet"])
    assert run.exit_code != 0 and run.output.count("error:") == 1, run.output
    assert f"{field}'" in run.output and fix in run.output, run.output
    assert "Traceback" not in run.output and (not out.exists() or not any(out.iterdir())), run.output
