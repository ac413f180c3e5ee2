"""Exactness of DeepSeek-V4's own MTP head (`mtp.0.*` of the target's checkpoint, proposers/mtp/dsv4.py),
scored by `specreplay score --ckpt <target dir>` on shards of the target's last layer's streams (id L), against
vLLM's rule (tests/helpers/dsv4_mtp.py: written from vllm/models/deepseek_v4/nvidia/mtp.py on transformers' own
DeepSeek-V4 modules, its online greedy loop re-running the head over every row):

- every greedy walk equals the online loop's, and at every anchor the replay's chain equals the reference's
  greedy chain up to its first draft the response does not hold;
- wrong rules (the streams' mean read for the streams, enorm and hnorm swapped, the streams averaged instead
  of the head's hc_head, no sliding window) change anchors and walks;
- `--walk-rule llama.cpp` (its lead slot instead of vLLM's zeroed position 0, docs/drafter-families.md#
  deepseek-v4-mtp-head) changes walks: the engines' rules differ here;
- bad input: a second head `mtp.1.*`, and id L extracted beside other layers, are one `error:` line each.

No llama-server run: llama-server dies loading a DeepSeek-V4 target without a compressed layer
(docs/drafter-families.md#dspark). The target: tests/helpers/dsv4_dspark.py's unservable one (transformers'
DeepseekV4ForCausalLM, four uncompressed layers, four streams, window 8), its head fitted briefly.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import chain_parity as chains, dsv4_dspark as d4, dsv4_mtp, mtp_replay as replay

pytestmark = pytest.mark.slow

PROMPTS = 4
MAX_NEW = 20
STEPS = 3
FIT_STEPS = 40
FIT_LR = 1.5e-2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from chains.one_thread()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from pipeline.shards import ShardSet
    from tests.helpers.engine_parity import prompt_ids
    from tests.helpers.models import seeded
    from tests.helpers.prompts import write_prompts

    tmp = tmp_path_factory.mktemp("mtp_dsv4_parity")
    model_dir = d4.save_target(tmp / "target", servable=False)
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(prompt_ids(PROMPTS))]
    prompts = write_prompts(tmp / "prompts.jsonl", records)
    shards = chains.extract(tmp / "shards", model_dir, prompts, MAX_NEW, [d4.TARGET_LAYERS])  # id L: the streams
    sequences = [s.input_ids for s in ShardSet(shards).samples(tensors=[])]
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with seeded(1):
        head = dsv4_mtp.ReferenceHead(d4.hf_config(1, vocab=d4.SMALL_VOCAB))
    loss = dsv4_mtp.fit(head, target, sequences, FIT_STEPS, FIT_LR)
    head.eval().requires_grad_(False)
    dsv4_mtp.save_head(head, model_dir)
    return tmp, model_dir, shards, target, head, loss


@pytest.fixture(scope="module")
def reference_chains(setup):
    """Sample id -> the reference's greedy chain at every anchor (batched over anchors)."""
    from pipeline.shards import ShardSet

    _, _, shards, target, head, _ = setup
    return {
        s.sample_id: dsv4_mtp.anchor_chains(head, target, s.input_ids, s.prompt_len, STEPS)
        for s in ShardSet(shards).samples(tensors=[])
    }


def anchors_differing(setup, reference_chains, change=None) -> tuple[int, int, int]:
    """(anchors whose replayed chain differs from the reference's along its verified prefix, anchors, drafts
    compared); `change` a wrong rule applied to the loaded drafter."""
    _, model_dir, shards, *_ = setup
    differ = total = compared = 0
    for sample, result in replay.every_anchor(model_dir, shards, MAX_NEW, change=change):
        assert bool(result.computed.all())
        ids = sample.input_ids
        for row, drafts in enumerate(reference_chains[sample.sample_id]):
            t = sample.prompt_len + row
            stored = ids[t + 1 : t + 1 + len(drafts)].tolist()
            read = next((i + 1 for i, (d, y) in enumerate(zip(drafts, stored)) if d != y), len(drafts))
            differ += result.draft_tokens[row, :read].tolist() != drafts[:read]
            total, compared = total + 1, compared + read
    return differ, total, compared


@pytest.fixture(scope="module")
def online_runs(setup):
    _, _, shards, target, head, _ = setup
    return replay.online_runs(head, target, shards, STEPS, MAX_NEW, loop=dsv4_mtp.online_mtp)


def test_greedy_walks_equal_vllms_online_loop(setup, online_runs):
    *_, loss = setup
    walks = replay.offline_produced(setup[1], setup[2], MAX_NEW)
    assert walks == {k: run.produced for k, run in online_runs.items()}
    accepted = [n for run in online_runs.values() for n in run.accepted]
    print(f"\nvLLM rule: {len(walks)}/{len(walks)} walks equal, {len(accepted)} steps, {sum(accepted)} drafts accepted, "
          f"fit loss {loss:.3f}")  # fmt: skip
    assert sum(accepted) > len(accepted), accepted  # a head that accepts several drafts a step


def test_every_anchor_equals_vllms_reference(setup, reference_chains):
    differ, total, compared = anchors_differing(setup, reference_chains)
    print(f"\nvLLM rule all-anchor: {total - differ}/{total} anchors equal the reference ({compared} drafts)")
    assert differ == 0 and total > 40 and compared > 1.5 * total


def _stream_mean(drafter) -> None:
    hc = drafter.hc  # the streams' mean, as extract stores the other layers, read for every stream
    drafter.project = lambda features, conventions=None: (
        features.unflatten(-1, (hc, -1)).mean(-2, True).expand(*features.shape[:-1], hc, -1)
    )


def _norms_swapped(drafter) -> None:
    drafter.enorm, drafter.hnorm = drafter.hnorm, drafter.enorm


def _no_hc_head(drafter) -> None:
    drafter.logit_state = lambda streams: drafter.norm(streams.mean(dim=-2))


def _no_window(drafter) -> None:
    drafter.window = None


WRONG = [_stream_mean, _norms_swapped, _no_hc_head, _no_window]


@pytest.mark.parametrize("wrong", WRONG, ids=["stream mean", "enorm/hnorm swapped", "no hc_head", "no window"])
def test_a_wrong_rule_differs_from_vllms_reference(setup, reference_chains, online_runs, wrong):
    differ, total, _ = anchors_differing(setup, reference_chains, wrong)
    walks = replay.offline_produced(setup[1], setup[2], MAX_NEW, change=wrong)
    walks_differ = sum(walks[k] != run.produced for k, run in online_runs.items())
    print(f"\n{wrong.__name__}: {differ}/{total} anchors, {walks_differ}/{len(online_runs)} walks differ")
    assert differ > 0


def test_llama_cpps_lead_slot_changes_walks(setup, reference_chains):
    """llama.cpp's rule (its lead slot at position 0, no zeroed embedding) is not vLLM's on these walks."""
    from scoring.replay.walk_rules import RULES

    _, model_dir, shards, *_ = setup
    conventions = RULES["llama.cpp"].conventions("mtp")
    walks = replay.offline_produced(model_dir, shards, MAX_NEW, conventions)
    vllm = replay.offline_produced(model_dir, shards, MAX_NEW)
    print(f"\nllama.cpp's lead slot: {sum(walks[k] != w for k, w in vllm.items())}/{len(vllm)} walks differ")
    assert walks != vllm


def test_a_second_head_is_one_error_line(setup, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, model_dir, shards, *_ = setup
    broken = tmp_path / "two-heads"
    shutil.copytree(model_dir, broken)
    state = load_file(broken / "model.safetensors")
    state |= {k.replace("mtp.0.", "mtp.1.", 1): v.clone() for k, v in state.items() if k.startswith("mtp.0.")}
    save_file(state, broken / "model.safetensors")
    error = replay.score_error(str(broken), shards, tmp_path / "out")
    print(f"\n{error}")
    assert "mtp.1.* is a second MTP head" in error and "'num_nextn_predict_layers' 1" in error


def test_id_l_beside_other_layers_is_one_error_line(setup, tmp_path):
    import os

    from click.testing import CliRunner

    from specreplay.cli import main

    tmp, model_dir, *_ = setup
    out = tmp_path / "mixed"
    args = ["extract", "--model", model_dir, "--prompts", str(tmp / "prompts.jsonl"), "--out", str(out)]
    run = CliRunner().invoke(main, [*args, "--layer-ids", f"1,{d4.TARGET_LAYERS}", "--max-new-tokens", "4"])
    print(f"\n{run.output.strip()}")
    [line] = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert (
        "Traceback" not in run.output
        and run.exit_code != 0
        and line.startswith("error: --layer-ids 1,4: id 4 of this hyper-connection target")
    )
    assert not os.path.exists(out)
