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
  layer deeper) lose most drafts, and diagnose keeps the configured reading;
- SpecForge's layout: the same fitted weights in SpecForge's own `PEagleDraftModel` (PyPI specforge
  0.2.0), saved by its own save_pretrained with the mask token and ids a vLLM user adds: every
  anchor's drafts equal SpecForge's own forward (its flex attention under its training mask), its
  walks and every anchor's drafts equal the speculators checkpoint's, and its ids read in the other
  numbering lose as the speculators checkpoint's do.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch

from pipeline.shards import ShardSet
from proposers.peagle.model import PEagleDrafter
from tests.helpers import chain_parity as parity, eagle3_online, peagle_online as online, peagle_specforge as specforge
from tests.helpers.dspark_online import target_states
from tests.helpers.dspark_reference import AUX_IDS, OUTPUT_IDS

pytestmark = pytest.mark.slow

MAX_NEW = 24
PROMPTS = 6
STEPS = 4  # drafts a step (vLLM's num_speculative_tokens; speculators' num_depths)
FIT_STEPS = 600
TEMPERATURE = 0.7
SAMPLED_DRAWS = 24  # seeded online runs per prompt, each one's response extracted and scored
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


def _specforge_checkpoint(setup, drafter, name: str, norm_before_residual: bool = False) -> str:
    """The fitted weights in SpecForge's own PEagleDraftModel, saved by its own save_pretrained."""
    tmp, target, *_ = setup
    width = target.config
    model = specforge.new_model(
        vocab=width.vocab_size, hidden=width.hidden_size, norm_before_residual=norm_before_residual
    )
    specforge.from_weights(model, drafter[0].state_dict())
    return specforge.save(model, str(tmp / name), mask_token=online.MASK_TOKEN, aux_ids=AUX_IDS, steps=STEPS)


@pytest.fixture(scope="module")
def specforge_ckpt(setup, drafter) -> str:
    return _specforge_checkpoint(setup, drafter, "specforge-ckpt")


def _anchor_drafts(ckpt: str, greedy: str, out) -> pl.DataFrame:
    out_dir = parity.score(ckpt, greedy, out, anchor_drafts=True)
    return pl.read_parquet(f"{out_dir}/anchors.parquet").select("sample_id", "anchor", "draft_tokens")


@pytest.fixture(scope="module")
def anchor_drafts(setup, drafter) -> pl.DataFrame:
    tmp, _, greedy, *_ = setup
    return _anchor_drafts(drafter[1], greedy, tmp / "results-anchors")


@pytest.fixture(scope="module")
def specforge_anchor_drafts(setup, specforge_ckpt) -> pl.DataFrame:
    tmp, _, greedy, *_ = setup
    return _anchor_drafts(specforge_ckpt, greedy, tmp / "results-specforge")


@pytest.fixture(scope="module")
def both_numberings(setup) -> str:
    """Shards holding each feature layer and the one above it."""
    tmp, _, _, _, model_dir, prompts = setup
    deeper = [i + 1 for i in OUTPUT_IDS]
    return parity.extract(tmp / "both-numberings", model_dir, prompts, MAX_NEW, sorted({*OUTPUT_IDS, *deeper}))


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


def _compare_to_reference(anchor_drafts: pl.DataFrame, blocks: dict) -> int:
    """Every anchor's drafts against the argmax of the reference's logits there (a draft whose two
    best logits tie within NEAR_TIE may rank either way); the number of drafts compared."""
    compared = 0
    for sample_id, anchor, offline in anchor_drafts.iter_rows():
        if (sample_id, anchor) not in blocks or not offline:
            continue
        logits = blocks[(sample_id, anchor)][: len(offline)]
        top2 = logits.topk(2, dim=-1).values
        for j, (mine, theirs) in enumerate(zip(offline, logits.argmax(dim=-1).tolist())):
            assert mine == theirs or float(top2[j, 0] - top2[j, 1]) < NEAR_TIE, (sample_id, anchor, j, offline)
        compared += len(offline)
    return compared


def test_every_anchors_drafts_equal_speculators_forward(setup, drafter, anchor_drafts, monkeypatch):
    _, target, greedy, *_ = setup
    compared = _compare_to_reference(anchor_drafts, _reference_blocks(drafter[0], target, greedy, monkeypatch))
    print(f"every anchor: {compared} drafts equal to speculators' forward's argmax")
    assert compared > 200


def _specforge_blocks(ckpt: str, target, greedy: str) -> dict[tuple[str, int], torch.Tensor]:
    """(sample id, anchor) -> SpecForge's own forward's draft logits [K, V] at every response anchor."""
    from specforge.modeling.draft.peagle import PEagleDraftModel

    model = PEagleDraftModel.from_pretrained(ckpt).eval()
    blocks = {}
    for sample in ShardSet(greedy).samples(tensors=[]):
        ids = sample.input_ids
        anchors = list(range(sample.prompt_len, ids.numel() - 1))
        _, features, _ = target_states(target, ids)
        logits = specforge.reference_logits(model, features, ids, anchors, STEPS, online.MASK_TOKEN)
        blocks |= {(sample.sample_id, t): block for t, block in zip(anchors, logits)}
    return blocks


def test_specforge_layouts_drafts_equal_specforges_forward(setup, specforge_ckpt, specforge_anchor_drafts):
    """SpecForge's checkpoint scored: every anchor's K drafts the argmax of SpecForge's own forward."""
    _, target, greedy, *_ = setup
    compared = _compare_to_reference(specforge_anchor_drafts, _specforge_blocks(specforge_ckpt, target, greedy))
    print(f"SpecForge's layout: {compared} drafts equal to SpecForge's forward's argmax")
    assert compared > 200


def test_specforges_norm_before_residual_is_read_as_saved(setup, drafter, specforge_anchor_drafts):
    """SpecForge's training switch norm_before_residual (saved in its config.json, read by vLLM):
    the drafts follow SpecForge's forward with it, and differ from those without it."""
    tmp, target, greedy, *_ = setup
    ckpt = _specforge_checkpoint(setup, drafter, "specforge-nbr", norm_before_residual=True)
    drafts = _anchor_drafts(ckpt, greedy, tmp / "results-specforge-nbr")
    compared = _compare_to_reference(drafts, _specforge_blocks(ckpt, target, greedy))
    joined = drafts.join(specforge_anchor_drafts, on=["sample_id", "anchor"], suffix="_without")
    differ = sum(a != b for a, b in zip(joined["draft_tokens"].to_list(), joined["draft_tokens_without"].to_list()))
    print(f"norm_before_residual: {compared} drafts equal SpecForge's forward; {differ}/{joined.height} anchors differ")
    assert compared > 200 and differ > joined.height // 10


def test_specforge_and_speculators_layouts_score_alike(
    setup, drafter, specforge_ckpt, anchor_drafts, specforge_anchor_drafts
):
    """The same weights in both layouts: every anchor's drafts and every walk equal."""
    tmp, _, greedy, *_ = setup
    assert specforge_anchor_drafts.sort("sample_id", "anchor").equals(anchor_drafts.sort("sample_id", "anchor"))
    walks = [
        parity.walks(parity.score(c, greedy, tmp / f"walks-{i}")) for i, c in enumerate((drafter[1], specforge_ckpt))
    ]
    assert walks[0].keys() == walks[1].keys()
    for sample_id, walk in walks[0].items():
        assert walk.equals(walks[1][sample_id]), sample_id


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


def test_sampled_expected_tau_equals_the_online_tau_run_by_run(setup, drafter):
    """T 0.7, paired: SAMPLED_DRAWS seeded online runs per prompt, each run's own response extracted
    and scored; the online tau minus the offline expected tau given those tokens has mean zero within
    3 standard errors, per prompt and over every run; EAGLE-3's feedback (`_eagle3_feedback`) outside."""
    tmp, target, _, stop_ids, model_dir, _ = setup
    model, ckpt = drafter

    def run(prompt):
        return online.online_peagle(model, target, prompt, MAX_NEW, stop_ids, TEMPERATURE)

    runs = parity.paired_runs(run, PROMPTS, SAMPLED_DRAWS)
    wrong = (PEagleDrafter, "feedback", _eagle3_feedback)
    options = dict(max_new=MAX_NEW, layer_ids=OUTPUT_IDS, temperature=TEMPERATURE)
    verdict = parity.paired_verdict(ckpt, model_dir, runs, tmp, wrong, "EAGLE-3's feedback", **options)
    assert all(abs(v) < 3 for v in verdict.z_prompts.values()) and abs(verdict.z) < 3, verdict
    assert abs(verdict.z_wrong) > 3, verdict


@pytest.mark.parametrize("layout", ["speculators", "specforge"])
def test_the_other_layer_numbering_loses_and_diagnose_keeps_the_configured_one(
    setup, drafter, specforge_ckpt, both_numberings, layout
):
    """The same weights with their before-layer ids read as output-of-layer ids (one layer deeper
    each: the z-lab numbering's reading of speculators' ids, SpecForge's training capture's
    reading of the ids vLLM reads before the layer) lose most drafts, and diagnose names the
    configured reading the consistent one."""
    from click.testing import CliRunner

    from specreplay.cli import main

    tmp = setup[0]
    ckpt = drafter[1] if layout == "speculators" else specforge_ckpt
    out = tmp / f"diagnose-{layout}"
    args = [
        "diagnose",
        "--ckpt",
        ckpt,
        "--shards",
        both_numberings,
        "--out",
        str(out),
        "--variants",
        "layers-convention",
    ]
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
