"""Exactness of P-EAGLE replay against the public references (tests/helpers/peagle_online.py).

The drafter is speculators' own `PEagleDraftModel`, built by its own config classes, fitted with
its own training forward (its COD sampling of anchors and depths) on the tiny target's real
features until steps accept several drafts, and saved by its own save_pretrained; specreplay
scores the saved checkpoint from extracted shards.

- every anchor: anchors.parquet's K drafts at every response anchor (score --anchor-drafts) equal
  the argmax of speculators' own forward run at those anchors, its COD sampler replaced by the rows
  wanted (a depth-d row of anchor t sees the verified rows up to t - 1 and its own earlier depths);
- greedy walks: walk.parquet equals an online loop of vLLM's parallel drafting rule (one drafter
  pass a step over the verified slots and K - 1 mask slots, the cache cut back after verification)
  over speculators' modules: every step's produced count and its accepted drafts;
- a wrong rule, EAGLE-3's feedback (each mask slot reading the previous step's hidden state instead
  of the mask hidden state), drafts other tokens at the same anchors;
- T = 0.7: per prompt, the offline expected tau equals the mean over seeds of the online loop's
  tau (each slot's draft drawn from its own q, z-lab's rejection sampling) within 3 combined
  standard errors, and the same statistic rejects EAGLE-3's feedback;
- layer numbering: the same weights with their before-layer ids read as output-of-layer ids (one
  layer deeper) lose most drafts, and diagnose keeps the configured reading.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch

from pipeline.shards import ShardSet
from proposers.peagle.model import PEagleDrafter
from tests.helpers import chain_parity as parity, eagle3_online, peagle_online as online
from tests.helpers.dspark_online import target_states
from tests.helpers.dspark_reference import AUX_IDS, OUTPUT_IDS

pytestmark = pytest.mark.slow

MAX_NEW = 24
PROMPTS = 6
STEPS = 4  # drafts a step (vLLM's num_speculative_tokens; speculators' num_depths)
FIT_STEPS = 600
TEMPERATURE = 0.7
SAMPLED_DRAWS = 40  # extracted responses per prompt, and online runs per prompt
NEAR_TIE = 1e-4  # logits this close may rank apart between two kernels' float sums


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.one_thread()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tmp, the tiny target loaded, its greedy shards, their stop ids, its directory, the prompts file)."""
    tmp, model_dir, prompts, target, greedy, stop_ids = parity.tiny_target_setup(
        tmp_path_factory.mktemp("peagle_parity"), PROMPTS, MAX_NEW
    )
    return tmp, target, greedy, stop_ids, model_dir, prompts


@pytest.fixture(scope="module")
def drafter(setup):
    """(speculators' PEagleDraftModel fitted to the greedy responses, its saved checkpoint)."""
    tmp, target, greedy, *_ = setup
    sequences = [(s.input_ids, s.prompt_len) for s in ShardSet(greedy).samples(tensors=[])]
    model = online.new_drafter(target, aux_ids=AUX_IDS, steps=STEPS)
    documents = eagle3_online.training_documents(target, [ids for ids, _ in sequences], [n for _, n in sequences])
    online.fit(model, documents, steps=FIT_STEPS)
    ckpt = str(tmp / "ckpt")
    model.save_pretrained(ckpt)
    return model, ckpt


@pytest.fixture(scope="module")
def anchor_drafts(setup, drafter) -> pl.DataFrame:
    tmp, _, greedy, *_ = setup
    out_dir = parity.score(drafter[1], greedy, tmp / "results-anchors", anchor_drafts=True)
    return pl.read_parquet(f"{out_dir}/anchors.parquet").select("sample_id", "anchor", "draft_tokens")


def _reference_blocks(model, target, greedy, monkeypatch) -> dict[tuple[str, int], torch.Tensor]:
    """(sample id, anchor) -> speculators' forward's draft logits [K, V] at every response anchor."""
    blocks = {}
    for sample in ShardSet(greedy).samples(tensors=[]):
        ids = sample.input_ids
        anchors = list(range(sample.prompt_len, ids.numel() - 1))
        _, features, _ = target_states(target, ids)
        logits = online.reference_logits(model, features, ids, anchors, monkeypatch)
        blocks |= {(sample.sample_id, t): block for t, block in zip(anchors, logits)}
    return blocks


def test_every_anchors_drafts_equal_speculators_forward(setup, drafter, anchor_drafts, monkeypatch):
    """The replay's K drafts at every response anchor are the argmax of speculators' own forward
    there (a draft whose two best logits tie within NEAR_TIE may rank either way)."""
    _, target, greedy, *_ = setup
    blocks = _reference_blocks(drafter[0], target, greedy, monkeypatch)
    compared = 0
    for sample_id, anchor, offline in anchor_drafts.iter_rows():
        if (sample_id, anchor) not in blocks or not offline:
            continue
        logits = blocks[(sample_id, anchor)][: len(offline)]
        top2 = logits.topk(2, dim=-1).values
        for j, (mine, theirs) in enumerate(zip(offline, logits.argmax(dim=-1).tolist())):
            assert mine == theirs or float(top2[j, 0] - top2[j, 1]) < NEAR_TIE, (sample_id, anchor, j, offline)
        compared += len(offline)
    print(f"every anchor: {compared} drafts equal to speculators' forward's argmax")
    assert compared > 200


def test_greedy_walks_equal_vllms_parallel_drafting(setup, drafter):
    tmp, target, greedy, stop_ids, *_ = setup
    model, ckpt = drafter
    walks = parity.walks(parity.score(ckpt, greedy, tmp / "results"))
    accepted = []
    for sample in ShardSet(greedy).samples(tensors=[]):
        run = online.online_peagle(model, target, sample.input_ids[: sample.prompt_len], MAX_NEW, stop_ids)
        assert run.output_ids.tolist() == sample.input_ids.tolist(), sample.sample_id
        walk = walks[sample.sample_id]
        assert walk["produced"].to_list() == run.produced, sample.sample_id
        for step, (offline, drafts, n, produced) in enumerate(
            zip(walk["draft_tokens"].to_list(), run.drafts, run.accepted, run.produced)
        ):
            kept = min(n, produced)
            assert offline[:kept] == drafts[:kept], (sample.sample_id, step)
        accepted += run.accepted
    print(f"greedy: {len(accepted)} steps, mean accepted {np.mean(accepted):.3f}, all {STEPS}: {accepted.count(STEPS)}")
    # non-trivial: several drafts accepted a step, whole blocks accepted
    assert np.mean(accepted) > 1.0, accepted
    assert STEPS in accepted, accepted


def _eagle3_feedback(self, h):
    """The wrong rule: a mask slot reads the previous step's hidden state, as EAGLE-3's steps do."""
    return h


def test_eagle3_feedback_drafts_other_tokens(setup, drafter, anchor_drafts, monkeypatch):
    tmp, _, greedy, *_ = setup
    monkeypatch.setattr(PEagleDrafter, "feedback", _eagle3_feedback)
    out_dir = parity.score(drafter[1], greedy, tmp / "results-wrong", anchor_drafts=True)
    wrong = pl.read_parquet(f"{out_dir}/anchors.parquet").select("sample_id", "anchor", "draft_tokens")
    joined = anchor_drafts.join(wrong, on=["sample_id", "anchor"], suffix="_wrong")
    differ = sum(
        a[1:] != b[1:] for a, b in zip(joined["draft_tokens"].to_list(), joined["draft_tokens_wrong"].to_list())
    )
    print(f"EAGLE-3's feedback: {differ}/{joined.height} anchors' later drafts differ")
    assert differ > joined.height // 4


def test_sampled_expected_tau_equals_the_online_mean_over_seeds(setup, drafter):
    """Per prompt and over the prompts, the offline expected tau (samples.parquet, SAMPLED_DRAWS
    extracted responses at T 0.7) against the mean tau of as many seeded online runs: within 3
    combined standard errors; EAGLE-3's feedback (`_eagle3_feedback`) outside them."""
    tmp, target, _, stop_ids, model_dir, prompts = setup
    model, ckpt = drafter
    shards = parity.extract(tmp / "sampled", model_dir, prompts, MAX_NEW, OUTPUT_IDS, TEMPERATURE, SAMPLED_DRAWS)

    def run(prompt):
        return online.online_peagle(model, target, prompt, MAX_NEW, stop_ids, TEMPERATURE)

    online_taus = parity.online_taus(run, PROMPTS, SAMPLED_DRAWS)
    wrong = (PEagleDrafter, "feedback", _eagle3_feedback)
    verdict = parity.sampled_verdict(ckpt, shards, tmp, online_taus, wrong, "EAGLE-3's feedback")
    z_prompts, z, z_wrong_prompts, z_wrong = verdict.z_prompts, verdict.z, verdict.z_wrong_prompts, verdict.z_wrong
    assert all(abs(v) < 3 for v in z_prompts.values()) and abs(z) < 3, (z_prompts, z)
    assert abs(z_wrong) > 3, (z_wrong_prompts, z_wrong)


def test_the_other_layer_numbering_loses_and_diagnose_keeps_the_configured_one(setup, drafter):
    """The same weights with their before-layer ids read as output-of-layer ids (one layer deeper
    each, the z-lab numbering's reading of speculators' ids) lose most drafts, and diagnose names
    the configured reading the consistent one."""
    from click.testing import CliRunner

    from specreplay.cli import main

    tmp, _, _, _, model_dir, prompts = setup
    deeper = [i + 1 for i in OUTPUT_IDS]
    shards = parity.extract(tmp / "both-numberings", model_dir, prompts, MAX_NEW, sorted({*OUTPUT_IDS, *deeper}))
    out = tmp / "diagnose"
    args = ["diagnose", "--ckpt", drafter[1], "--shards", shards, "--out", str(out), "--variants", "layers-convention"]
    run = CliRunner().invoke(main, [*args, "--no-progress"])
    assert run.exit_code == 0, run.output
    [table] = [pl.read_parquet(path) for path in out.glob("*/diagnose.parquet")]
    taus = dict(table.filter(pl.col("metric") == "tau").select("variant", "value").iter_rows())
    verdict = json.loads(next(out.glob("*/diagnose.json")).read_text())["verdict"]
    print(
        f"tau: before-layer ids as configured {taus['as-configured']:.3f}, read as output ids {taus['layers-convention']:.3f}"
    )
    assert taus["as-configured"] > 1.8 and taus["layers-convention"] < 0.7 * taus["as-configured"], taus
    assert "consistent" in verdict[0], verdict
