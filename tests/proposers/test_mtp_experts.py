"""An MoE MTP head's checkpoint against its config (proposers/mtp/experts.py): the per-expert
tensors transformers' save_pretrained writes land in transformers' fused block unchanged, a
checkpoint already fused loads alike, and a checkpoint whose experts disagree with the config (their
count, their widths, one missing) or a target without the `mtp.*` tensors its config promises is one
error line naming the file, the field and the fix."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from proposers.checkpoints.files import CheckpointError
from proposers.checkpoints.load import load_drafter
from tests.helpers import mtp_online as online

LAYERS = online.TEXT["num_hidden_layers"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(a Qwen3.5-MoE target dir with its head saved as save_pretrained names experts, the head)."""
    tmp = tmp_path_factory.mktemp("mtp_experts")
    model_dir, target, head = online.build_target(tmp / "target", moe=True)
    online.save_head(head.eval(), model_dir, target)
    return model_dir, head


def _copy(saved, tmp_path, config=None, tensors=None) -> str:
    """A copy of the target dir with its text config's fields `config` and its tensors changed."""
    out = shutil.copytree(saved[0], tmp_path / "copy")
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(raw | (config or {})))
    if tensors is not None:
        path = out / "model.safetensors"
        save_file(tensors(load_file(path)), path, metadata={"format": "pt"})
    return str(out)


def _refusal(path: str) -> str:
    with pytest.raises(CheckpointError) as caught:
        load_drafter(path, target_layers=LAYERS)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}/model.safetensors: "), message
    return message


@torch.no_grad()
def test_the_saved_experts_are_the_heads_block(saved):
    model_dir, head = saved
    drafter, _ = load_drafter(model_dir, target_layers=LAYERS)
    mine, reference = drafter.layers[0].mlp, head.layers[0].mlp
    assert type(mine) is type(reference)  # transformers' own Qwen3_5MoeSparseMoeBlock
    for name, tensor in reference.state_dict().items():
        assert torch.equal(mine.state_dict()[name], tensor), name
    x = torch.randn(1, 9, head.fc.out_features)
    assert torch.equal(mine(x), reference(x))


def test_a_fused_checkpoint_loads_alike(saved, tmp_path):
    """Checkpoints that store transformers' fused tensors (`experts.gate_up_proj`) keep them."""
    fused = {f"mtp.layers.0.mlp.{k}": v for k, v in saved[1].layers[0].mlp.state_dict().items() if "experts." in k}

    def fused_only(state):
        return {k: v for k, v in state.items() if ".mlp.experts." not in k} | fused

    drafter, _ = load_drafter(_copy(saved, tmp_path, tensors=fused_only), target_layers=LAYERS)
    reference = saved[1].layers[0].mlp.experts
    assert torch.equal(drafter.layers[0].mlp.experts.gate_up_proj, reference.gate_up_proj)


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"num_experts": 8}, "mtp.layers.0.mlp.experts.* holds experts 0..3 (4), but the config's field 'num_experts' is 8"),
        ({"num_experts": 2}, "holds experts 0..3 (4), but the config's field 'num_experts' is 2"),
        ({"moe_intermediate_size": 16}, "experts.0.down_proj.weight is [32, 32], not [32, 16], but the config's field 'moe_intermediate_size' is 16"),
        ({"shared_expert_intermediate_size": 24}, "shared_expert.gate_proj.weight has 48 rows, but the config's field 'shared_expert_intermediate_size' is 24"),
    ],
    ids=["8 experts said", "2 experts said", "expert width", "shared width"],
)  # fmt: skip
def test_experts_the_config_does_not_describe_are_one_error(saved, tmp_path, config, said):
    path = _copy(saved, tmp_path, config=config)
    message = _refusal(path)
    assert said in message and message.endswith(f"use the config.json saved with this checkpoint ({path}/config.json)")


def test_a_missing_expert_is_one_error(saved, tmp_path):
    path = _copy(saved, tmp_path, tensors=lambda s: {k: v for k, v in s.items() if ".experts.2.up_proj" not in k})
    message = _refusal(path)
    assert "mtp.layers.0.mlp.experts.2.up_proj.weight is missing (1 expert tensors in all), of the 4 experts" in message
    assert message.endswith("the checkpoint is incomplete: save it again")


def test_a_target_without_its_mtp_head_is_one_error(saved, tmp_path):
    path = _copy(saved, tmp_path, tensors=lambda s: {k: v for k, v in s.items() if not k.startswith("mtp.")})
    assert "no 'mtp.*' tensors in its weights: this target has no native MTP head to score" in _refusal(path)


@torch.no_grad()
def test_a_qwen3_next_moe_head_routes_as_its_config_says(tmp_path):
    """Qwen3-Next: the MTP layer's block is transformers' Qwen3NextSparseMoeBlock, its top-k weights
    left unnormalized when norm_topk_prob is false (as vLLM's renormalize = norm_topk_prob); loaded
    from per-expert names, it computes the reference layer's MLP exactly, and not the renormalized one."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    fields = {k: v for k, v in online.MOE_TEXT.items() if k != "layer_types"}
    config = Qwen3NextConfig(**fields, layer_types=["full_attention"] * LAYERS, norm_topk_prob=False)
    target = Qwen3NextForCausalLM(config).eval()
    target.save_pretrained(tmp_path)
    torch.manual_seed(0)
    head = online.MtpHead(config).eval()
    online.save_head(head, str(tmp_path), target)
    drafter, _ = load_drafter(str(tmp_path), target_layers=LAYERS)
    mine, reference = drafter.layers[0].mlp, head.layers[0].mlp
    assert type(mine).__name__ == "Qwen3NextSparseMoeBlock" and mine.gate.norm_topk_prob is False
    x = torch.randn(1, 9, config.hidden_size)
    assert torch.equal(mine(x), reference(x))
    mine.gate.norm_topk_prob = True  # the other rule: the test can fail
    assert not torch.allclose(mine(x), reference(x))
