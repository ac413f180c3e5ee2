"""Exactness of MiMo-V2-Flash's three chained MTP heads (`model.mtp.layers.{0,1,2}.*`,
proposers/mtp/mimo.py), scored by `specreplay score --ckpt <target dir>`, against both engines' rules:

- llama-server (`--spec-type draft-mtp`, the heads kept in the target's GGUF by llama.cpp's converter,
  conversion/mimo.py, run as src/models/mimo2.cpp's graph_mtp chained by common/speculative.cpp's
  `chain_heads`): every sample's accepted counts equal the replay's under `--walk-rule llama.cpp`, step
  for step, at n_max 3 and 2; replayed with one head reused, the heads in another order, vLLM's
  post-norm feedback or fc's halves swapped, samples' counts differ;
- vLLM's rule (head 0 at every step, fed back after final_layernorm: tests/helpers/mimo_online.py on
  transformers' own MiMoV2FlashDecoderLayer, each line citing mimo_v2_mtp.py, run by
  tests/helpers/mtp_online.py's growing-cache loop): every greedy walk equals that online loop and at
  every anchor the teacher-forced chain equals the loop's own up to its first draft the response does
  not hold; llama.cpp's chained heads there change anchors; at T 0.05, paired against seeded runs of
  that loop, the online tau minus the offline expected tau given each run's tokens has mean zero;
- bad input: a config promising three heads over a checkpoint holding two, one `error:` line.

The target: transformers' MiMoV2FlashForCausalLM (layer 0 full attention, dense; layer 1 sliding with
sinks, MoE), saved with the released config.json's keys, its heads fitted briefly on llama.cpp's chain
(mimo_online.fit) so that they accept several drafts.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from tests.helpers import (
    chain_parity as chains,
    engine_parity as parity,
    llama_engine as engine,
    mimo_online,
    mtp_replay as replay,
)
from tests.helpers.models import SMOLLM2_VOCAB

pytestmark = pytest.mark.slow

STEPS = 3  # the heads: llama.cpp caps n_max at them
FIT_STEPS = 150
FIT_LR = 5e-3
PROMPTS = parity.PROMPTS


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.threads_and_table("mtp ")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import MiMoV2FlashForCausalLM

    from pipeline.shards import ShardSet
    from tests.helpers.models import seeded
    from tests.helpers.prompts import write_prompts
    from tools.llama_convert import convert

    tmp = tmp_path_factory.mktemp("engine_parity_mtp_mimo")
    config = mimo_online.target_config(SMOLLM2_VOCAB)
    with seeded(0):
        target = MiMoV2FlashForCausalLM(config).eval()
    prompts = parity.prompt_ids(PROMPTS)
    model_dir = engine.engine_target(tmp / "target", prompts, parity.MAX_NEW, model=target)
    sequences = engine.continuations(model_dir, prompts, parity.MAX_NEW)
    heads = mimo_online.build_heads(config)
    loss = mimo_online.fit(heads, target, [ids for ids, _ in sequences], steps=FIT_STEPS, lr=FIT_LR)
    mimo_online.save_heads(heads, model_dir)
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(prompts)]
    layers = [config.num_hidden_layers]  # id L: before the final norm, its weight in the target head
    shards = chains.extract(
        tmp / "shards", model_dir, write_prompts(tmp / "prompts.jsonl", records), parity.MAX_NEW, layers
    )
    assert {s.finish_reason for s in ShardSet(shards).samples(tensors=[])} == {"eos", "length"}
    gguf = str(convert(mimo_online.convertible_copy(model_dir, str(tmp / "convert")), tmp / "target.gguf"))
    found = parity.Setup(tmp, model_dir, gguf, shards, sequences, converter=None)
    return found, parity.Drafter("mtp", "mimo", model_dir, None, "draft-mtp", STEPS), loss, target, heads


@pytest.mark.parametrize("n_max", [STEPS, 2])
def test_mimo_counts_equal_llama_server(setup, n_max):
    found, drafter, loss, *_ = setup
    print(f"\nfitted MiMo heads: mean loss {loss:.3f}")
    parity.assert_engine_counts(found, drafter, n_max, fresh_slots=True)


# -- llama.cpp's rule: what the engine runs, against the rules it does not ------------------------


def _one_head(drafter) -> None:
    drafter.head_at = lambda step, conventions: 0


def _heads_reversed(drafter) -> None:
    drafter.layers = torch.nn.ModuleList(list(drafter.layers)[::-1])


def _post_norm_feedback(drafter) -> None:
    drafter.fed_on = lambda h, head, conventions: drafter.layers[head].final_layernorm(h)


def _fc_swapped(drafter) -> None:
    for head in drafter.layers:
        head.combine = lambda h, embeds, head=head: _swapped(head, h, embeds)


def _swapped(head, h, embeds):
    z = head.eh_proj(torch.cat([head.hnorm(h), head.enorm(embeds)], dim=-1))
    return head.input_layernorm(z), z


LLAMA_WRONG = [_one_head, _heads_reversed, _post_norm_feedback, _fc_swapped]


@pytest.mark.parametrize("wrong", LLAMA_WRONG, ids=["one head", "heads reversed", "post-norm feedback", "fc swapped"])
def test_a_rule_llama_cpp_does_not_run_differs_from_it(setup, wrong, monkeypatch):
    from proposers.mtp.mimo import MimoDrafter

    found, drafter, *_ = setup
    engine_walk = engine.walk_counts(parity.scored(found, drafter, STEPS, "llama.cpp"))
    original = MimoDrafter.attach_target_head

    def attach(self, target_head):  # every loaded drafter changed once its weights are in
        original(self, target_head)
        wrong(self)

    monkeypatch.setattr(MimoDrafter, "attach_target_head", attach)
    out = found.tmp / f"wrong-{wrong.__name__}"
    walk = engine.walk_counts(parity.score(drafter, found.shards, out, force=True, walk_rule="llama.cpp", steps=STEPS))
    differ = sum(walk[sid] != steps for sid, steps in engine_walk.items())
    anchors, total = _anchors_differ(parity.scored(found, drafter, STEPS, "llama.cpp"), out)
    print(f"\n{wrong.__name__} under --walk-rule llama.cpp: {differ}/{len(engine_walk)} samples' counts, "
          f"{anchors}/{total} anchors' accepted lengths differ")  # fmt: skip
    assert anchors > 0


def _anchors_differ(engine_out, out) -> tuple[int, int]:
    """(anchors whose accepted length differs between two scores, anchors)."""
    import polars as pl

    def lengths(directory):
        [path] = list(pathlib.Path(directory).rglob("anchors.parquet"))
        return pl.read_parquet(path).sort("sample_id", "anchor")["accepted_len"]

    found, other = lengths(engine_out), lengths(out)
    return int((found != other).sum()), found.len()


# -- vLLM's rule (the default): head 0 at every step, on transformers' own decoder layer ----------


@pytest.fixture(scope="module")
def online_runs(setup):
    found, _, _, target, heads = setup
    return replay.online_runs(heads[0], target, found.shards, STEPS, found.max_new)


def test_greedy_walks_equal_vllms_online_loop(setup, online_runs):
    found, drafter, *_ = setup
    walks = chains.walks(parity.scored(found, drafter, STEPS, "dflash"))
    stepped = {k: r.produced for k, r in online_runs.items() if r.produced}
    assert {sid: w["produced"].to_list() for sid, w in walks.items()} == stepped
    accepted = [n for run in online_runs.values() for n in run.accepted]
    print(f"\nvLLM rule: {len(stepped)} walks equal, {len(accepted)} steps, {sum(accepted)} drafts accepted")
    assert sum(accepted) > len(accepted) / 2, accepted  # a head that accepts


def test_every_anchor_equals_vllms_reference(setup):
    found, _, _, target, heads = setup
    same, total, compared = replay.anchors_equal(found.target, heads[0], target, found.shards, found.max_new, STEPS)
    print(f"\nvLLM rule all-anchor: {same}/{total} anchors equal the reference ({compared} drafts)")
    assert same == total > 0


def _pre_norm_fed(drafter) -> None:
    drafter.fed_on = lambda h, head, conventions: h  # llama.cpp's state, under vLLM's head 0


def _step_k_head_k(drafter) -> None:
    # llama.cpp's head choice on vLLM's context (head 0's KV) and feedback
    drafter.head_at = lambda step, conventions: step


VLLM_WRONG = [_pre_norm_fed, _step_k_head_k, _fc_swapped]


@pytest.mark.parametrize("wrong", VLLM_WRONG, ids=["pre-norm fed on", "step k head k", "fc swapped"])
def test_a_wrong_rule_differs_from_vllms_reference(setup, online_runs, wrong):
    found, _, _, target, heads = setup
    same, total, _ = replay.anchors_equal(found.target, heads[0], target, found.shards, found.max_new, STEPS, wrong)
    walks = replay.offline_produced(found.target, found.shards, found.max_new, change=wrong)
    differ = sum(walks[k] != run.produced for k, run in online_runs.items())
    print(f"\n{wrong.__name__}: {total - same}/{total} anchors, {differ}/{len(online_runs)} walks differ")
    assert same < total


# -- sampled (T > 0), vLLM's rule: paired against seeded online runs -----------------------------

TEMPERATURE = 0.05  # at 0.2 this tiny target is so flat that the head accepts almost nothing (tau 1.01)
SAMPLED_PROMPTS, SAMPLED_DRAWS = 4, 12  # the module's first prompts; seeded online runs per prompt


def test_sampled_expected_tau_equals_the_online_tau_run_by_run(setup):
    """T = TEMPERATURE, paired: SAMPLED_DRAWS seeded runs per prompt of vLLM's rule (head 0 at every
    step, each draft drawn from its q, z-lab's rejection sampling), each run's own response extracted
    and scored; the online tau minus the offline expected tau given those tokens has mean zero within 3
    standard errors; eh_proj reading [hnorm(h) ; enorm(e)] (the halves swapped) outside them."""
    import numpy as np

    from pipeline.shards import ShardSet
    from proposers.mtp.mimo import MimoHead
    from tests.helpers import mtp_online

    found, _, _, target, heads = setup
    stop_ids = ShardSet(found.shards).settings["target"]["stop_token_ids"]

    def run(prompt):
        return mtp_online.online_mtp(heads[0], target, prompt, STEPS, found.max_new, stop_ids, TEMPERATURE)

    runs = chains.paired_runs(run, SAMPLED_PROMPTS, SAMPLED_DRAWS, parity.prompt_ids(SAMPLED_PROMPTS))
    assert np.mean([tau for *_, tau in runs]) > 1.3  # several tokens a step: something to measure
    options = dict(max_new=found.max_new, layer_ids=[target.config.num_hidden_layers], temperature=TEMPERATURE)
    wrong = (MimoHead, "combine", _swapped)
    verdict = chains.paired_verdict(
        found.target, found.target, runs, found.tmp, wrong, "eh_proj halves swapped", **options
    )
    assert all(abs(v) < 3 for v in verdict.z_prompts.values()) and abs(verdict.z) < 3, verdict
    assert abs(verdict.z_wrong) > 3, verdict


# -- bad input ------------------------------------------------------------------------------------


def test_a_head_missing_is_one_error_line(setup, tmp_path):
    from safetensors.torch import load_file, save_file

    found, *_ = setup
    broken = tmp_path / "two-heads"
    shutil.copytree(found.target, broken)
    state = load_file(broken / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.startswith("model.mtp.layers.2.")}, broken / "model.safetensors")
    error = replay.score_error(str(broken), found.shards, tmp_path / "out")
    print(f"\n{error}")
    assert "holds heads 0, 1" in error and "'num_nextn_predict_layers' is 3" in error
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    assert chains.score(str(broken), found.shards, tmp_path / "two", eagle_trees=[])  # two heads: scored


def test_diagnose_replays_llama_cpps_chain_as_a_variant(setup):
    """`diagnose`'s mimo-chain-heads variant replays llama.cpp's chain under the default walk: its tau
    is not the configured (vLLM) rule's."""
    found, *_ = setup
    taus, verdict = replay.diagnose_taus(found.target, found.shards, found.tmp / "diagnose", "mimo-chain-heads")
    print(f"\ndiagnose tau {taus}; {verdict}")
    assert taus["mimo-chain-heads"] != taus["as-configured"], taus


def test_more_steps_than_chained_heads_is_one_error_line(setup, tmp_path):
    """llama.cpp's chain has a head a step: --steps past the heads under its rule is refused by name,
    nothing written; under vLLM's rule (head 0 every step) the same --steps scores."""
    from click.testing import CliRunner

    from specreplay.cli import main

    found, *_ = setup
    out = tmp_path / "out"
    args = ["score", "--ckpt", found.target, "--shards", found.shards, "--out", str(out), "--steps", "4"]
    run = CliRunner().invoke(main, [*args, "--walk-rule", "llama.cpp", "--no-progress"])
    print(f"\n{run.output.strip()}")
    assert run.exit_code != 0 and "Traceback" not in run.output, run.output
    [line] = run.output.strip().splitlines()
    assert line.startswith(f"error: {found.target}: --steps 4:") and "use --steps 3 or fewer" in line
    assert not out.exists() or not any(out.iterdir())
    run = CliRunner().invoke(main, [*args, "--limit", "2", "--no-progress", "--eagle-trees", ""])
    assert run.exit_code == 0, run.output
