"""Exactness of a GLM-4.5 NextN head (`model.layers.{L}.*`, proposers/mtp/nextn.py), scored by
`specreplay score --ckpt <target dir>`, against both engines' rules on one fitted head:

- llama-server (`--spec-type draft-mtp`, the head kept in the target's GGUF by llama.cpp's
  converter, conversion/glm.py `Glm4MoeModel` with `supports_mtp_export`, run as
  src/models/glm4-moe.cpp's graph_mtp): every sample's accepted counts equal the replay's under
  `--walk-rule llama.cpp`, step for step, at n_max 3 and 2; replayed with vLLM's feedback (the state before
  shared_head.norm) or without llama.cpp's lead slot, samples differ;
- vLLM's rule (tests/helpers/nextn_online.py on transformers' own Glm4MoeDecoderLayer, each line
  citing glm4_moe_mtp.py): under the default rule every greedy walk equals that online loop, and at
  every anchor the teacher-forced chain equals the reference's own chain up to its first draft the
  response does not hold; a wrong rule (post-norm feedback, the concat order swapped, position 0's
  embedding kept, the shared experts left out) changes anchors and walks;
- the layer convention: the head reads the target's final state after the norm; read before it
  (`mtp-prenorm`) the same weights score measurably worse, and `diagnose` keeps the configured one;
- sampled (T > 0): per prompt the offline expected tau equals the mean tau of seeded runs of vLLM's
  online loop within 3 standard errors; fc reading [hidden ; embedding] falls outside them.

The target: transformers' Glm4MoeForCausalLM (layer 0 dense, layer 1 MoE: 4 experts, top-2, a
shared expert, sigmoid routing with a drawn score-correction bias, routed_scaling_factor 2.5, q/k/v
biases, partial rotary 0.5) at SmolLM2's vocabulary plus the GLM special tokens llama.cpp's GLM
vocabulary export asks for (conversion/base.py `_set_vocab_glm`), made the engine target
(llama_engine.engine_target); its head fitted briefly (mtp_online.fit on vLLM's rule) and saved
one expert at a time.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.helpers import (
    chain_parity as chains,
    engine_parity as parity,
    llama_engine as engine,
    mtp_replay as replay,
    nextn_online,
)
from tests.helpers.models import SMOLLM2_VOCAB

pytestmark = pytest.mark.slow

STEPS = 3  # the native head's default (mtp.DEFAULT_STEPS)
FIT_STEPS = 300
FIT_LR = 5e-3
GLM_SPECIAL = ("[gMASK]", "<|user|>", "<|observation|>")  # _set_vocab_glm's (<|endoftext|> is SmolLM2's id 0)


def _glm_tokenizer(model_dir: str) -> None:
    """SmolLM2's tokenizer with the GLM special tokens llama.cpp's GLM vocabulary export looks up
    (ids past SmolLM2's 49152, which the target never emits), loaded as the saved class."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(GLM_SPECIAL)})
    tokenizer.save_pretrained(model_dir)
    parity.keep_saved_tokenizer_class(model_dir)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine_parity_mtp_nextn")
    target = nextn_online.build_target(nextn_online.glm_config(SMOLLM2_VOCAB + 8))
    fitted = {}
    options = dict(layers=target.config.num_hidden_layers, steps=STEPS, fit_steps=FIT_STEPS, fit_lr=FIT_LR)
    found = parity.native_mtp_setup(tmp, target, prepare=_glm_tokenizer, nextn=True, fitted=fitted, **options)
    return (*found, target, fitted["head"])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.threads_and_table("mtp ")


@pytest.mark.parametrize("n_max", [STEPS, 2])
def test_nextn_counts_equal_llama_server(setup, n_max):
    setup, drafter, loss, *_ = setup
    print(f"\nfitted NextN head: step-1 loss {loss:.3f}")
    parity.assert_engine_counts(setup, drafter, n_max, fresh_slots=True)


# -- llama.cpp's rule: what the engine runs, against the rules it does not ------------------------


def _engine_walk(setup) -> dict:
    """The replay's llama.cpp walk at STEPS (scored once per module; the engine test above showed
    it equal to llama-server's counts for every sample)."""
    setup, drafter, *_ = setup
    return engine.walk_counts(parity.scored(setup, drafter, STEPS, "llama.cpp"))


def _vllm_feedback(monkeypatch) -> None:
    """vLLM's feedback (the layer output before shared_head.norm) under llama.cpp's walk."""
    from proposers.mtp.nextn import NextnDrafter

    monkeypatch.setattr(NextnDrafter, "feedback_under", lambda self, h, conventions: h)


def _no_lead_slot(monkeypatch) -> None:
    """llama.cpp's feedback without its lead slot (vLLM's draft KV positions)."""
    from proposers.toolkit.conventions import Conventions
    from scoring.replay.walk_rules import WalkRule

    monkeypatch.setattr(WalkRule, "conventions", lambda self, family: Conventions(nextn_feed_normed=True))


@pytest.mark.parametrize("wrong", [_vllm_feedback, _no_lead_slot], ids=["vllm feedback", "no lead slot"])
def test_a_rule_llama_cpp_does_not_run_differs_from_it(setup, wrong, monkeypatch):
    engine_walk = _engine_walk(setup)
    found, drafter = setup[0], setup[1]
    wrong(monkeypatch)
    out = found.tmp / f"wrong-{wrong.__name__}"
    walk = engine.walk_counts(parity.score(drafter, found.shards, out, force=True, walk_rule="llama.cpp", steps=STEPS))
    differ = sum(walk[sid] != steps for sid, steps in engine_walk.items())
    print(f"\n{wrong.__name__} under --walk-rule llama.cpp: {differ}/{len(engine_walk)} samples' counts differ")
    assert differ > 0


# -- vLLM's rule (the default walk rule): the online loop on transformers' own decoder layer ---------


@pytest.fixture(scope="module")
def online_runs(setup):
    found, _, _, target, head = setup
    return replay.online_runs(head, target, found.shards, STEPS, found.max_new)


def test_greedy_walks_equal_vllms_online_loop(setup, online_runs):
    found, drafter, *_ = setup
    walks = chains.walks(parity.scored(found, drafter, STEPS, "dflash"))
    stepped = {k: r.produced for k, r in online_runs.items() if r.produced}  # a response of a stop token alone: none
    assert {sid: w["produced"].to_list() for sid, w in walks.items()} == stepped
    accepted = [n for run in online_runs.values() for n in run.accepted]
    produced = [n for run in online_runs.values() for n in run.produced]
    print(f"\nvLLM rule: {len(stepped)} walks equal, {len(produced)} steps, tau {np.mean(produced):.3f}")
    assert np.mean(accepted) > 1.0 and STEPS in accepted, accepted  # a head that accepts


@pytest.fixture(scope="module")
def reference_chains(setup) -> dict:
    """The online reference's own chain at every anchor of every sample, computed once."""
    from pipeline.shards import ShardSet

    found, _, _, target, head = setup
    samples = ShardSet(found.shards).samples(tensors=[])
    return {s.sample_id: replay.reference_chains(head, target, s, STEPS) for s in samples}


def _anchors_equal(setup, chains, change=None) -> tuple[int, int, int]:
    found, _, _, target, head = setup
    return replay.anchors_equal(found.target, head, target, found.shards, found.max_new, STEPS, change, chains)


def test_every_anchor_equals_vllms_reference(setup, reference_chains):
    same, total, compared = _anchors_equal(setup, reference_chains)
    print(f"\nvLLM rule all-anchor: {same}/{total} anchors equal the reference ({compared} drafts)")
    assert same == total > 0


def _post_norm_feedback(drafter) -> None:
    drafter.feedback_under = lambda h, conventions: drafter.norm(h)


def _concat_swapped(drafter) -> None:
    def layer_input(layer, h, embeds):
        z = drafter.fc(torch.cat([drafter.pre_fc_norm_hidden(h), drafter.pre_fc_norm_embedding(embeds)], dim=-1))
        return layer.input_layernorm(z), z

    drafter.layer_input = layer_input


def _position_zero_kept(drafter) -> None:
    drafter.slot_embeds = lambda embeds, positions, conventions: embeds


def _no_shared_experts(drafter) -> None:
    with torch.no_grad():
        drafter.layers[0].mlp.shared_experts.down_proj.weight.zero_()


WRONG = [_post_norm_feedback, _concat_swapped, _position_zero_kept, _no_shared_experts]


@pytest.mark.parametrize("wrong", WRONG, ids=["post-norm feedback", "concat swapped", "position 0 kept", "no shared"])
def test_a_wrong_rule_differs_from_vllms_reference(setup, online_runs, reference_chains, wrong):
    found, *_ = setup
    same, total, _ = _anchors_equal(setup, reference_chains, wrong)
    walks = replay.offline_produced(found.target, found.shards, found.max_new, change=wrong)
    differ = sum(walks[k] != run.produced for k, run in online_runs.items())
    print(f"\n{wrong.__name__}: {total - same}/{total} anchors, {differ}/{len(online_runs)} walks differ")
    assert same < total


# -- the layer convention: the target's final state after its norm, as both engines feed it ------


def _diagnosed(ckpt: str, shards: str, out, variants: str) -> tuple[dict, list[str]]:
    """(variant -> chain tau, the verdict) of `specreplay diagnose`."""
    import polars as pl
    from click.testing import CliRunner

    from specreplay.cli import main

    args = ["diagnose", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--variants", variants]
    run = CliRunner().invoke(main, [*args, "--limit", "12", "--no-progress"])
    assert run.exit_code == 0, run.output
    [table] = [pl.read_parquet(path) for path in out.glob("*/diagnose.parquet")]
    verdict = json.loads(next(out.glob("*/diagnose.json")).read_text())["verdict"]
    return dict(table.filter(pl.col("metric") == "tau").select("variant", "value").iter_rows()), verdict


def test_the_pre_norm_state_scores_worse_and_diagnose_keeps_the_configured_one(setup, online_runs):
    from proposers.toolkit.conventions import Conventions

    found, *_ = setup
    prenorm = replay.offline_produced(found.target, found.shards, found.max_new, Conventions(prenorm_hidden=True))
    differ = sum(prenorm[k] != run.produced for k, run in online_runs.items())
    taus, verdict = _diagnosed(found.target, found.shards, found.tmp / "diagnose", "mtp-prenorm,nextn-feed-normed")
    print(f"\npre-norm reading: {differ}/{len(online_runs)} walks differ; diagnose tau {taus}; {verdict[0]}")
    assert differ > 0 and taus["mtp-prenorm"] < taus["as-configured"] - 0.1, taus
    assert "consistent" in verdict[0] or "mtp-prenorm" not in verdict[0], verdict


# -- sampled: the expected tau against seeded runs of vLLM's online loop -------------------------

TEMPERATURE = 0.05
SAMPLED_PROMPTS = 3  # the module's first prompts
SAMPLED_DRAWS = 10  # seeded online runs per prompt, each one's response extracted and scored


def test_sampled_expected_tau_equals_the_online_tau_run_by_run(setup):
    """T = TEMPERATURE, paired: SAMPLED_DRAWS seeded runs of vLLM's rule on the module's fitted head
    per prompt (each draft drawn from its q, z-lab's rejection sampling), each run's own response
    extracted and scored; the online tau minus the offline expected tau given those tokens has mean
    zero within 3 standard errors; fc reading its halves in the other order outside them."""
    from pipeline.shards import ShardSet
    from proposers.mtp.nextn import NextnDrafter
    from tests.helpers import mtp_online

    found, _, _, target, head = setup
    stop_ids = ShardSet(found.shards).settings["target"]["stop_token_ids"]

    def run(prompt):
        return mtp_online.online_mtp(head, target, prompt, STEPS, found.max_new, stop_ids, TEMPERATURE)

    runs = chains.paired_runs(run, SAMPLED_PROMPTS, SAMPLED_DRAWS, parity.prompt_ids(SAMPLED_PROMPTS))
    wrong = (NextnDrafter, "layer_input", replay.hidden_first)
    options = dict(max_new=found.max_new, layer_ids=[target.config.num_hidden_layers], temperature=TEMPERATURE)
    verdict = chains.paired_verdict(
        found.target, found.target, runs, found.tmp, wrong, "[hidden ; embedding]", **options
    )
    assert all(abs(v) < 3 for v in verdict.z_prompts.values()) and abs(verdict.z) < 3, verdict
    assert abs(verdict.z_wrong) > 3, verdict
