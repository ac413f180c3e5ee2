"""Exactness of MTP replay: `score --ckpt <target dir>` against an online greedy loop written from
the rule alone (tests/helpers/mtp_online.py: transformers' own Qwen3.5 decoder layer on a real
growing KV cache). The target is a tiny random Qwen3.5 (all layers full attention) saved with an
`mtp.*` head fitted on its own greedy continuations, so chains accept several tokens.

- every walk's `produced` equals the online loop's, step for step;
- replayed under the other pre/post-norm rule (the `mtp-prenorm` variant: the target's final
  hidden state before its final norm), the walks differ: the test can fail;
- T = 0.3: per prompt the offline expected tau equals the mean tau of seeded online runs (each
  step's draft drawn from its q, z-lab's rejection sampling) within 3 combined standard errors,
  and the same statistic rejects fc reading [hidden ; embedding].
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.shards import ShardSet
from proposers.toolkit.conventions import Conventions
from tests.helpers import chain_parity as parity, mtp_export, mtp_online as online, mtp_replay as replay

MAX_NEW = 20
PROMPTS = 6
STEPS = 3  # the native head's default (mtp.DEFAULT_STEPS)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.one_thread()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtp_parity")
    # the scored prompts' continuations too (as the EAGLE-3 parity test fits on its greedy responses)
    model_dir, target, head, shards, loss = replay.fitted_native_head(
        tmp, PROMPTS, MAX_NEW, train=24, repeats=3, fit_steps=600
    )
    print(f"fitted head: step-1 loss {loss:.3f}")
    return tmp, model_dir, target, head, shards


def _online_runs(head, target, shards, steps: int = STEPS) -> dict[str, online.OnlineRun]:
    return replay.online_runs(head, target, shards, steps, MAX_NEW)


@pytest.mark.slow
def test_greedy_walks_equal_the_online_loop(setup):
    tmp, model_dir, target, head, shards = setup
    runs = _online_runs(head, target, shards)
    walks = parity.walks(parity.score(model_dir, shards, tmp / "results"))
    for sample_id, run in runs.items():
        assert walks[sample_id]["produced"].to_list() == run.produced, sample_id
    accepted = [n for run in runs.values() for n in run.accepted]
    produced = [n for run in runs.values() for n in run.produced]
    print(f"greedy: {len(runs)} walks equal, {len(produced)} steps, tau {np.mean(produced):.3f}")
    assert np.mean(accepted) > 1.0, accepted  # a head that accepts: the comparison means something
    assert STEPS in accepted, accepted


@pytest.mark.slow
def test_the_other_norm_rule_walks_differently(setup):
    tmp, model_dir, target, head, shards = setup
    runs = _online_runs(head, target, shards)
    reference = replay.offline_produced(model_dir, shards, MAX_NEW, Conventions())
    prenorm = replay.offline_produced(model_dir, shards, MAX_NEW, Conventions(prenorm_hidden=True))
    same = sum(reference[k] == run.produced for k, run in runs.items())
    wrong = sum(prenorm[k] != run.produced for k, run in runs.items())
    steps = sum(len(run.produced) for run in runs.values())
    tau = {
        name: np.mean([n for w in walks.values() for n in w]) for name, walks in (("post", reference), ("pre", prenorm))
    }
    print(
        f"post-norm walks equal {same}/{len(runs)}; pre-norm walks differ in {wrong}/{len(runs)} ({steps} steps); tau {tau}"
    )
    assert same == len(runs)
    assert wrong > 0


# ---------------------------------------------------------------------------------------------
# speculators' export of the same head (tests/helpers/mtp_export.py: its own converter, model class
# and save_pretrained): `score --ckpt <export dir>` is the same drafter as `score --ckpt <target dir>`


@pytest.fixture(scope="module")
def exported(setup):
    tmp, model_dir, *_ = setup
    return mtp_export.export(model_dir, tmp / "export", STEPS)


@pytest.mark.slow
def test_the_export_is_the_native_head_in_speculators_classes(setup, exported):
    """Every native tensor saved under the converter's name, bit for bit, and speculators' own
    MTP layer computing the online loop's h' from them."""
    tmp, model_dir, target, head, shards = setup
    native = mtp_export.native_as_exported(model_dir)
    saved = load_file(os.path.join(exported, "model.safetensors"))
    assert {k for k in saved if k.startswith("mtp_layers.")} == native.keys()
    assert all(torch.equal(saved[k], v) for k, v in native.items())
    ids = next(iter(ShardSet(shards).samples(tensors=[]))).input_ids
    embeds, hidden = target.model.embed_tokens(ids[1:])[None], online.target_states(target, ids)[1][None, :-1]
    with torch.no_grad():
        expected = head.norm(online._forward(head, embeds, hidden, torch.arange(ids.numel() - 1)[None], None))
    got = mtp_export.layer_output(mtp_export.draft_model(exported), embeds, hidden)
    print(f"speculators' layer vs the native head: max |diff| {float((got - expected).abs().max()):.2e}")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_export_walks_equal_the_target_dir(setup, exported):
    tmp, model_dir, target, head, shards = setup
    native = parity.walk_table(parity.score(model_dir, shards, tmp / "results-native"))
    out_dir = parity.score(exported, shards, tmp / "results-export")
    export = parity.walk_table(out_dir)
    assert export.equals(native)  # produced and every teacher-forced draft token, step for step
    runs = _online_runs(head, target, shards)
    walks = parity.walks(out_dir)
    assert all(walks[k]["produced"].to_list() == run.produced for k, run in runs.items())
    print(f"export: {len(runs)} walks equal the target dir's and the online loop's ({export.height} steps)")


@pytest.mark.slow
def test_a_mismapped_export_walks_differently(setup, exported):
    """The equality above can fail: the export with its two input norms exchanged (a converter
    mapping pre_fc_norm_hidden to token_layernorm) replays other walks."""
    tmp, model_dir, target, head, shards = setup
    layer = "mtp_layers.0."
    swapped = mtp_export.swapped_copy(
        exported, tmp / "export-swapped", layer + "hidden_layernorm.weight", layer + "token_layernorm.weight"
    )
    runs = _online_runs(head, target, shards)
    walks = parity.walks(parity.score(swapped, shards, tmp / "results-swapped"))
    wrong = sum(walks[k]["produced"].to_list() != run.produced for k, run in runs.items())
    tau = np.mean([n for w in walks.values() for n in w["produced"].to_list()])
    print(f"norms exchanged: {wrong}/{len(runs)} walks differ from the online loop; tau {tau:.3f}")
    assert wrong > 0


@pytest.mark.slow
def test_the_exports_speculative_tokens_set_k(setup):
    """k is the export's `speculative_tokens` (here 2, the native default being 3): the walks are
    the online loop's at 2 drafts a step, which differ from those at 3."""
    tmp, model_dir, target, head, shards = setup
    two = mtp_export.export(model_dir, tmp / "export-k2", 2)
    walks = parity.walks(parity.score(two, shards, tmp / "results-k2"))
    runs, runs_at_three = _online_runs(head, target, shards, steps=2), _online_runs(head, target, shards)
    assert all(walks[k]["produced"].to_list() == run.produced for k, run in runs.items())
    assert max(n for run in runs.values() for n in run.produced) == 3  # 2 drafts and the bonus token
    assert any(run.produced != runs_at_three[k].produced for k, run in runs.items())


TEMPERATURE = 0.3  # at 0.7 the tiny target is so flat that even a wrong fc moves tau less than the test resolves
SAMPLED_DRAWS = 24  # seeded online runs per prompt, each one's response extracted and scored


@pytest.mark.slow
def test_sampled_expected_tau_equals_the_online_mean_over_seeds(setup):
    """T = 0.3, paired (mtp_replay.sampled_verdict): SAMPLED_DRAWS seeded online runs per prompt
    (each draft drawn from its q, z-lab's rejection sampling), each run's own response extracted and
    scored; the online tau minus the offline expected tau given those tokens has mean zero within 3
    standard errors; fc reading its halves in the other order outside them."""
    from proposers.mtp.model import MtpDrafter

    tmp, model_dir, target, head, greedy = setup
    wrong = (MtpDrafter, "layer_input", replay.hidden_first)
    sampled = dict(
        prompts=PROMPTS, temperature=TEMPERATURE, draws=SAMPLED_DRAWS, wrong=wrong, label="[hidden ; embedding]"
    )
    verdict = replay.sampled_verdict(tmp, model_dir, target, head, greedy, steps=STEPS, max_new=MAX_NEW, **sampled)
    assert all(abs(v) < 3 for v in verdict.z_prompts.values()) and abs(verdict.z) < 3, (verdict.z_prompts, verdict.z)
    assert abs(verdict.z_wrong) > 3, (verdict.z_wrong_prompts, verdict.z_wrong)
