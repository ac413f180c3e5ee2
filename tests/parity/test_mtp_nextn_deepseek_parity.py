"""Exactness of a DeepSeek-V3 NextN head (`model.layers.{L}.*`, proposers/mtp/nextn.py with MLA,
proposers/toolkit/mla/attention.py), scored by `specreplay score --ckpt <target dir>`, against vLLM's rule on
transformers' own DeepseekV3DecoderLayer (tests/helpers/nextn_online.py, citing deepseek_mtp.py):
llama.cpp's converter drops DeepSeek-V3's MTP layers (conversion/deepseek.py:238-240, 396-401), so
no llama-server comparison exists for it.

- every greedy walk equals the online loop's, and at every anchor the teacher-forced chain equals
  the reference's own chain up to its first draft the response does not hold;
- a wrong rule changes anchors and walks: GLM-4.5's feedback (the state before shared_head.norm),
  position 0's embedding kept, routing over every expert group, the shared experts left out;
- the target's final state read before its norm (`mtp-prenorm`) walks measurably worse;
- a stack of two heads (`num_nextn_predict_layers` 2: the fitted head and a second fitted briefly)
  against vLLM's default model runner's multi-module speculator (nextn_online.online_stack, citing
  v1/worker/gpu/spec_decode/multi_module_mtp/speculator.py): every walk and anchor equal; head 0 at
  every step (its V1 runner, `Conventions.first_head_only`) or the heads swapped differ; more steps
  than heads are refused in one line.

The target: transformers' DeepseekV3ForCausalLM (layer 0 dense, layer 1 MoE: 8 experts in 4 groups,
2 kept, top-2, a shared expert, drawn score-correction biases; MLA with a q LoRA, interleaved rope,
YaRN), its head fitted briefly on its greedy continuations and saved one expert at a time.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from proposers.toolkit.conventions import Conventions
from tests.helpers import chain_parity as parity, mtp_replay as replay, nextn_online
from tests.helpers.models import TINY_VOCAB

MAX_NEW = 20
PROMPTS = 6
STEPS = 3  # the native head's default (mtp.DEFAULT_STEPS)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.one_thread()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtp_nextn_deepseek")
    config = nextn_online.deepseek_config(TINY_VOCAB)
    model_dir, target, head, shards, loss = replay.fitted_native_head(
        tmp, PROMPTS, MAX_NEW, train=12, repeats=2, fit_steps=300, nextn=config
    )
    print(f"fitted DeepSeek-V3 NextN head: step-1 loss {loss:.3f}")
    runs = replay.online_runs(head, target, shards, STEPS, MAX_NEW)
    chains = {s.sample_id: replay.reference_chains(head, target, s, STEPS) for s, _ in _samples(shards)}
    return tmp, model_dir, target, head, shards, runs, chains


def _samples(shards: str):
    from pipeline.shards import ShardSet

    return [(s, None) for s in ShardSet(shards).samples(tensors=[])]


def _anchors_equal(setup, change=None) -> tuple[int, int, int]:
    _, model_dir, target, head, shards, _, chains = setup
    return replay.anchors_equal(model_dir, head, target, shards, MAX_NEW, STEPS, change, chains)


def test_greedy_walks_and_every_anchor_equal_vllms_rule(setup):
    tmp, model_dir, _, _, shards, runs, _ = setup
    walks = parity.walks(parity.score(model_dir, shards, tmp / "results"))
    stepped = {k: run.produced for k, run in runs.items() if run.produced}
    assert {sid: w["produced"].to_list() for sid, w in walks.items()} == stepped
    accepted = [n for run in runs.values() for n in run.accepted]
    produced = [n for run in runs.values() for n in run.produced]
    same, total, compared = _anchors_equal(setup)
    print(
        f"\nDeepSeek-V3: {len(stepped)} walks equal ({len(produced)} steps, tau {np.mean(produced):.3f}); "
        f"{same}/{total} anchors equal ({compared} drafts)"
    )
    assert same == total > 0
    assert np.mean(accepted) > 1.0 and STEPS in accepted, accepted  # a head that accepts


def _pre_norm_feedback(drafter) -> None:
    drafter.feedback_under = lambda h, conventions: h


def _position_zero_kept(drafter) -> None:
    drafter.slot_embeds = lambda embeds, positions, conventions: embeds


def _every_group(drafter) -> None:
    gate = drafter.layers[0].mlp.gate
    gate.topk_group = gate.num_group


def _no_shared_experts(drafter) -> None:
    with torch.no_grad():
        drafter.layers[0].mlp.shared_experts.down_proj.weight.zero_()


WRONG = [_pre_norm_feedback, _position_zero_kept, _every_group, _no_shared_experts]


@pytest.mark.parametrize("wrong", WRONG, ids=["pre-norm feedback", "position 0 kept", "every group", "no shared"])
def test_a_wrong_rule_differs_from_vllms_reference(setup, wrong):
    _, model_dir, _, _, shards, runs, _ = setup
    same, total, _ = _anchors_equal(setup, wrong)
    walks = replay.offline_produced(model_dir, shards, MAX_NEW, change=wrong)
    differ = sum(walks[k] != run.produced for k, run in runs.items())
    print(f"\n{wrong.__name__}: {total - same}/{total} anchors, {differ}/{len(runs)} walks differ")
    assert same < total


def test_the_pre_norm_state_walks_worse(setup):
    _, model_dir, _, _, shards, runs, _ = setup
    prenorm = replay.offline_produced(model_dir, shards, MAX_NEW, Conventions(prenorm_hidden=True))
    differ = sum(prenorm[k] != run.produced for k, run in runs.items())
    tau = {
        "post": np.mean([n for run in runs.values() for n in run.produced]),
        "pre": np.mean([n for w in prenorm.values() for n in w]),
    }
    print(f"\npre-norm reading: {differ}/{len(runs)} walks differ; tau {tau}")
    assert differ > 0 and tau["pre"] < tau["post"] - 0.1, tau


TEMPERATURE = 0.1  # this head accepts little at 0.3 (tau 1.06), where no wrong rule shows
SAMPLED_DRAWS = 16


def test_sampled_expected_tau_equals_the_online_mean_over_seeds(setup):
    """T = 0.1, paired (mtp_replay.sampled_verdict): SAMPLED_DRAWS seeded runs of vLLM's rule per
    prompt (each draft drawn from its q, z-lab's rejection sampling), each run's own response
    extracted and scored; the online tau minus the offline expected tau given those tokens has mean
    zero within 3 standard errors; fc reading [hidden ; embedding] outside them."""
    from proposers.mtp.nextn import NextnDrafter

    tmp, model_dir, target, head, shards, *_ = setup
    wrong = (NextnDrafter, "layer_input", replay.hidden_first)
    sampled = dict(
        prompts=PROMPTS, temperature=TEMPERATURE, draws=SAMPLED_DRAWS, wrong=wrong, label="[hidden ; embedding]"
    )
    verdict = replay.sampled_verdict(tmp, model_dir, target, head, shards, steps=STEPS, max_new=MAX_NEW, **sampled)
    assert all(abs(v) < 3 for v in verdict.z_prompts.values()) and abs(verdict.z) < 3, (verdict.z_prompts, verdict.z)
    assert abs(verdict.z_wrong) > 3, (verdict.z_wrong_prompts, verdict.z_wrong)


# -- a stack of two heads (num_nextn_predict_layers 2) under vLLM's default model runner ----------

STACK_STEPS = 2  # a stack drafts a step per head by default (mtp/config.py)
STACK_FIT_STEPS = 200


@pytest.fixture(scope="module")
def stack(setup):
    """(its dir, the two heads, the online runs, the reference's chains): the module's target and its
    fitted head as head 0, head 1 fitted briefly on its own teacher-forced loss (nextn_online.
    fit_later_heads) and saved as model.layers.{L + 1}.*, the config saying 2."""
    import json
    import shutil

    from tests.helpers.models import seeded

    tmp, model_dir, target, head, shards, *_ = setup
    stack_dir = tmp / "stack"
    shutil.copytree(model_dir, stack_dir)
    config = json.loads((stack_dir / "config.json").read_text()) | {"num_nextn_predict_layers": 2}
    (stack_dir / "config.json").write_text(json.dumps(config))
    with seeded(2):
        second = nextn_online.NextnHead(target.config)
    heads = [head.eval().requires_grad_(False), second]
    sequences = [replay.greedy(target, p, MAX_NEW) for p in parity.prompt_ids(12, seed=9) + parity.prompt_ids(PROMPTS)]
    loss = nextn_online.fit_later_heads(heads, target, sequences, steps=STACK_FIT_STEPS)
    print(f"fitted head 1 of the stack: loss {loss:.3f}")
    nextn_online.save_head(second, str(stack_dir), target, index=1)
    stop_ids = _stop_ids(shards)
    runs = {}
    for sample, _ in _samples(shards):
        prompt = sample.input_ids[: sample.prompt_len]
        runs[sample.sample_id] = nextn_online.online_stack(heads, target, prompt, STACK_STEPS, MAX_NEW, stop_ids)
        assert runs[sample.sample_id].output_ids.tolist() == sample.input_ids.tolist(), sample.sample_id
    chains = {s.sample_id: nextn_online.stack_chains(heads, target, s, STACK_STEPS) for s, _ in _samples(shards)}
    return str(stack_dir), heads, runs, chains


def _stop_ids(shards: str):
    from pipeline.shards import ShardSet

    return ShardSet(shards).settings["target"]["stop_token_ids"]


def _stack_anchors(setup, stack, change=None) -> tuple[int, int, int]:
    _, _, target, _, shards, *_ = setup
    stack_dir, heads, _, chains = stack
    return replay.anchors_equal(stack_dir, heads, target, shards, MAX_NEW, STACK_STEPS, change, chains)


def test_a_stacks_walks_and_every_anchor_equal_vllms_multi_module_speculator(setup, stack):
    tmp, _, _, _, shards, *_ = setup
    stack_dir, _, runs, _ = stack
    walks = parity.walks(parity.score(stack_dir, shards, tmp / "stack-results"))
    stepped = {k: run.produced for k, run in runs.items() if run.produced}
    assert {sid: w["produced"].to_list() for sid, w in walks.items()} == stepped
    accepted = [n for run in runs.values() for n in run.accepted]
    same, total, compared = _stack_anchors(setup, stack)
    print(
        f"\n2-head stack: {len(stepped)} walks equal (tau {np.mean([n for r in runs.values() for n in r.produced]):.3f}); "
        f"{same}/{total} anchors equal ({compared} drafts); accepted {np.bincount(accepted).tolist()}"
    )
    assert same == total > 0
    assert accepted.count(STACK_STEPS) >= 3, accepted  # head 1 accepts: step 2 drafts are verified


def _first_head_only(drafter) -> None:
    """vLLM's V1 model runner: head 0's chain at every step (Conventions.first_head_only)."""
    drafter.multi_module = lambda conventions: False


def _heads_swapped(drafter) -> None:
    first = {k: v.clone() for k, v in drafter.state_dict().items() if not k.startswith("later.")}
    second = {k: v.clone() for k, v in drafter.later[0].state_dict().items()}
    drafter.later[0].load_state_dict({k: first[k] for k in second})
    drafter.load_state_dict({**drafter.state_dict(), **second})


STACK_WRONG = [_first_head_only, _heads_swapped]


@pytest.mark.parametrize("wrong", STACK_WRONG, ids=["head 0 every step", "heads swapped"])
def test_a_wrong_stack_rule_differs(setup, stack, wrong):
    _, _, _, _, shards, *_ = setup
    stack_dir, _, runs, _ = stack
    same, total, _ = _stack_anchors(setup, stack, wrong)
    walks = replay.offline_produced(stack_dir, shards, MAX_NEW, change=wrong)
    differ = sum(walks[k] != run.produced for k, run in runs.items())
    print(f"\n{wrong.__name__}: {total - same}/{total} anchors, {differ}/{len(runs)} walks differ")
    assert same < total and differ > 0


def test_vllms_v1_runner_is_the_first_head_only_convention(setup, stack):
    """Conventions.first_head_only replays vLLM's V1 runner on the stack, head 0's chain at every
    step: at the module's 3 steps, the online loop of head 0 alone, walk for walk."""
    _, _, _, _, shards, runs, _ = setup
    three = Conventions(first_head_only=True)
    first = replay.offline_produced(
        stack[0], shards, MAX_NEW, three, change=lambda d: setattr(d.config, "block_size", STEPS)
    )
    assert first == {k: run.produced for k, run in runs.items()}


def test_diagnose_replays_vllms_v1_runner_as_a_variant(setup, stack, tmp_path):
    """`diagnose`'s nextn-first-head variant (head 0 at every step, vLLM's V1 runner) on the stack: its
    tau is not the configured (V2 runner's) rule's."""
    taus, verdict = replay.diagnose_taus(stack[0], setup[4], tmp_path / "diagnose", "nextn-first-head")
    print(f"\ndiagnose tau {taus}; {verdict}")
    assert taus["nextn-first-head"] != taus["as-configured"], taus


def test_more_steps_than_the_stack_holds_are_refused(setup, stack, tmp_path):
    """vLLM would reuse head 0 at step 3 over a KV cache its step 1 wrote (history-dependent): one line."""
    _, _, _, _, shards, *_ = setup
    line = replay.score_error(stack[0], shards, tmp_path / "out", "--steps", "3")
    assert "--steps 3" in line and "2 NextN heads" in line and "--steps 2 or fewer" in line, line
