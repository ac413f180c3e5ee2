"""Exactness of an MTP head whose MLP is a mixture of experts: `score --ckpt <target dir>` of a tiny
Qwen3.5-MoE target (transformers' Qwen3_5MoeForCausalLM, all layers full attention, 4 experts, top-2,
a gated shared expert) whose `mtp.*` head (transformers' own Qwen3_5MoeDecoderLayer, its sparse MoE
block) is fitted briefly on the target's greedy continuations and saved one expert at a time, as
transformers' save_pretrained un-fuses experts, against the online loop of tests/helpers/mtp_online.py
on that same layer class:

- every walk's `produced` equals the online loop's, step for step;
- at every anchor the replay's teacher-forced chain equals the reference's own chain (a fresh cache of
  the stored prefix, then its own drafts) up to and including its first draft the stored response
  does not hold: the drafts the walk reads, all of them;
- a wrong rule fails: the routing weights of the top-k not renormalized (transformers' own Qwen3-Next
  router with norm_topk_prob false), or no shared expert, changes drafts and walks;
- at T = 0.2 the offline expected tau equals the mean of seeded online runs within 3 standard errors,
  and fc reading its halves in the other order falls outside them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import chain_parity as parity, mtp_replay as replay

MAX_NEW = 20
PROMPTS = 6
STEPS = 3  # the native head's default (mtp.DEFAULT_STEPS)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.one_thread()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtp_moe_parity")
    model_dir, target, head, shards, loss = replay.fitted_native_head(
        tmp, PROMPTS, MAX_NEW, moe=True, train=12, repeats=2, fit_steps=300
    )
    print(f"fitted MoE head: step-1 loss {loss:.3f}")
    runs = replay.online_runs(head, target, shards, STEPS, MAX_NEW)
    return tmp, model_dir, target, head, shards, runs


def test_the_checkpoint_names_experts_one_at_a_time(setup):
    """What the loader maps: transformers' save names each expert's projections, not the fused tensors."""
    from safetensors import safe_open

    _, model_dir, target, *_ = setup
    with safe_open(f"{model_dir}/model.safetensors", framework="pt") as handle:
        names = {n for n in handle.keys() if n.startswith("mtp.layers.0.mlp.")}  # noqa: SIM118
    experts = target.config.num_experts
    assert {f"mtp.layers.0.mlp.experts.{i}.up_proj.weight" for i in range(experts)} <= names
    assert not any(n.endswith("gate_up_proj") for n in names)
    assert "mtp.layers.0.mlp.shared_expert_gate.weight" in names


def test_greedy_walks_equal_the_online_loop(setup):
    tmp, model_dir, target, head, shards, runs = setup
    walks = parity.walks(parity.score(model_dir, shards, tmp / "results"))
    for sample_id, run in runs.items():
        assert walks[sample_id]["produced"].to_list() == run.produced, sample_id
    accepted = [n for run in runs.values() for n in run.accepted]
    produced = [n for run in runs.values() for n in run.produced]
    print(
        f"MoE greedy: {len(runs)} walks equal, {len(produced)} steps, tau {np.mean(produced):.3f}, accepted {np.mean(accepted):.3f}"
    )
    assert np.mean(accepted) > 1.0, accepted  # a head that accepts: the comparison means something
    assert STEPS in accepted, accepted


def _anchors_equal(setup, change=None) -> tuple[int, int, int]:
    _, model_dir, target, head, shards, _ = setup
    return replay.anchors_equal(model_dir, head, target, shards, MAX_NEW, STEPS, change)


def test_every_anchor_equals_the_reference(setup):
    same, total, compared = _anchors_equal(setup)
    print(f"MoE all-anchor: {same}/{total} anchors equal the reference ({compared} drafts)")
    assert same == total > 0


def _unnormalized_top_k(drafter) -> None:
    """The routing weights of the top-k left unnormalized: transformers' Qwen3-Next router, whose
    norm_topk_prob false is that rule, with the head's own router weight."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

    mlp = drafter.layers[0].mlp
    experts, hidden = mlp.gate.weight.shape
    config = Qwen3NextConfig(
        hidden_size=hidden, num_experts=experts, num_experts_per_tok=mlp.gate.top_k, norm_topk_prob=False
    )
    router = Qwen3NextTopKRouter(config)
    router.weight = mlp.gate.weight
    mlp.gate = router


def _no_shared_expert(drafter) -> None:
    """The shared expert left out: its output projection zero."""
    with torch.no_grad():
        drafter.layers[0].mlp.shared_expert.down_proj.weight.zero_()


@pytest.mark.parametrize("wrong", [_unnormalized_top_k, _no_shared_expert], ids=["top-k unnormalized", "no shared"])
def test_a_wrong_expert_rule_fails(setup, wrong):
    tmp, model_dir, target, head, shards, runs = setup
    same, total, _ = _anchors_equal(setup, change=wrong)
    walks = replay.offline_produced(model_dir, shards, MAX_NEW, change=wrong)
    differ = sum(walks[k] != run.produced for k, run in runs.items())
    tau = np.mean([n for w in walks.values() for n in w])
    print(f"{wrong.__name__}: {total - same}/{total} anchors differ, {differ}/{len(runs)} walks differ, tau {tau:.3f}")
    assert same < total and differ > 0


TEMPERATURE = 0.2  # at 0.3 the tiny target is too flat for the wrong rule below to move tau past 3 SE
SAMPLED_DRAWS = 24  # seeded online runs per prompt, each one's response extracted and scored


@pytest.mark.slow
def test_sampled_expected_tau_equals_the_online_mean_over_seeds(setup):
    """T = 0.2, paired (mtp_replay.sampled_verdict): SAMPLED_DRAWS seeded online runs of the MoE head
    per prompt (each draft drawn from its q, z-lab's rejection sampling), each run's own response
    extracted and scored; the online tau minus the offline expected tau given those tokens has mean
    zero within 3 standard errors; fc reading its halves in the other order outside them."""
    from proposers.mtp.model import MtpDrafter

    tmp, model_dir, target, head, shards, _ = setup
    wrong = (MtpDrafter, "layer_input", replay.hidden_first)
    sampled = dict(
        prompts=PROMPTS, temperature=TEMPERATURE, draws=SAMPLED_DRAWS, wrong=wrong, label="[hidden ; embedding]"
    )
    verdict = replay.sampled_verdict(tmp, model_dir, target, head, shards, steps=STEPS, max_new=MAX_NEW, **sampled)
    print(f"\nQwen3.5-MoE at T {TEMPERATURE}: z {verdict.z:+.2f}, wrong rule z {verdict.z_wrong:+.2f}")
    assert all(abs(v) < 3 for v in verdict.z_prompts.values()) and abs(verdict.z) < 3, (verdict.z_prompts, verdict.z)
    assert abs(verdict.z_wrong) > 3, (verdict.z_wrong_prompts, verdict.z_wrong)
