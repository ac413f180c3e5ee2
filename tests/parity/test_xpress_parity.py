"""Exactness of XPress replay against speculators' own classes (tests/helpers/xpress_online.py).

The drafter is speculators' own `XPressDraftModel`, built by its own config classes at the tiny
target's shapes, fitted with its own training forward (teacher-forced refine pass, consistency
rounds; its base-logits anchor term off, so the refiner carries the drafts) until blocks accept
several drafts, and saved by its own
save_pretrained; specreplay scores the saved checkpoint from extracted greedy shards.

K = 2 Jacobi passes on a block of 4 (3 drafts): the third draft is still unconverged after two
passes, so the replay must run exactly K passes, not the serial rule they converge to.

- every anchor: anchors.parquet's drafts at every response anchor (score --anchor-drafts) equal the
  drafts of speculators' backbone and refiner run at that anchor with K passes;
- greedy walks: walk.parquet equals an online loop of that rule verified by the real target: every
  step's produced count and its accepted drafts;
- plausible wrong rules (one pass fewer; slot k reading the token at its own position, DSpark's
  sample_from_anchor predecessor, instead of the one before it; the anchor's slot reading the anchor
  instead of x_{t-1}) draft other tokens at the same anchors, or are reported as not caught;
- vLLM's layout (the same weights as vLLM 0.33.0 loads them, tests/helpers/xpress_vllm.py): every
  anchor's drafts equal vLLM's refiner written rule by rule (its anchor slot reading the anchor, its
  top-C), with its default top-C and one that binds; diagnose's xpress-slot0 variant gives back the
  speculators checkpoint's tau.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import polars as pl
import pytest
import torch

from pipeline.shards import ShardSet
from proposers.toolkit.conventions import REFERENCE
from proposers.xpress.model import XPressDrafter
from tests.helpers import chain_parity as parity, dspark_online, xpress_online as online, xpress_vllm as vllm
from tests.helpers.dspark_online import target_states

pytestmark = pytest.mark.slow

MAX_NEW = 24
PROMPTS = 6
BLOCK = 4
PASSES = 2
FIT_STEPS = 300


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.one_thread()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tmp, the tiny target loaded, its greedy shards, their stop ids)."""
    tmp, _, _, target, greedy, stop_ids = parity.tiny_target_setup(
        tmp_path_factory.mktemp("xpress_parity"), PROMPTS, MAX_NEW
    )
    return tmp, target, greedy, stop_ids


@pytest.fixture(scope="module")
def drafter(setup):
    """(speculators' XPressDraftModel fitted to the greedy responses, its saved checkpoint)."""
    tmp, target, greedy, _ = setup
    samples = list(ShardSet(greedy).samples(tensors=[]))
    model = online.new_drafter(target, block_size=BLOCK, passes=PASSES)
    documents = dspark_online.training_documents(
        target, [s.input_ids for s in samples], [s.prompt_len for s in samples]
    )
    # without the base-logits anchor term (speculators' base_anchor_weight, default 0.6) the backbone
    # alone is not trained to draft, so the refiner carries the drafts: most anchors' drafts are not
    # the backbone's argmax, and a wrong refiner rule shows
    dspark_online.fit(model, documents, steps=FIT_STEPS, lr=5e-3, base_anchor_weight=0.0)
    ckpt = str(tmp / "ckpt")
    model.save_pretrained(ckpt)
    return model, ckpt


def _anchor_drafts(ckpt: str, greedy: str, out) -> pl.DataFrame:
    out_dir = parity.score(ckpt, greedy, out, anchor_drafts=True)
    return pl.read_parquet(f"{out_dir}/anchors.parquet").select("sample_id", "anchor", "draft_tokens")


@pytest.fixture(scope="module")
def anchor_drafts(setup, drafter) -> pl.DataFrame:
    tmp, _, greedy, _ = setup
    return _anchor_drafts(drafter[1], greedy, tmp / "results-anchors")


@pytest.fixture(scope="module")
def reference(setup, drafter) -> dict[tuple[str, int], list[int]]:
    """(sample id, anchor) -> speculators' drafts at every response anchor."""
    _, target, greedy, _ = setup
    blocks = {}
    for sample in ShardSet(greedy).samples(tensors=[]):
        ids = sample.input_ids
        _, features, _ = target_states(target, ids)
        for t in range(sample.prompt_len, ids.numel() - 1):
            blocks[(sample.sample_id, t)] = online.anchor_drafts(drafter[0], features, ids, t).tolist()
    return blocks


def test_every_anchors_drafts_equal_speculators_jacobi_rule(setup, drafter, anchor_drafts, reference):
    _, target, greedy, _ = setup
    model = drafter[0]
    compared = refined = anchors = 0
    # every response anchor, and a whole block of drafts at each (the last ones reach past the response)
    assert set(zip(anchor_drafts["sample_id"], anchor_drafts["anchor"])) == set(reference)
    for sample_id, anchor, offline in anchor_drafts.iter_rows():
        theirs = reference[(sample_id, anchor)]
        assert offline == theirs, (sample_id, anchor, offline, theirs)
        compared += len(offline)
    # the refiner binds: at some anchors its drafts are not the backbone's argmax (zero passes)
    for sample in ShardSet(greedy).samples(tensors=[]):
        ids = sample.input_ids
        _, features, _ = target_states(target, ids)
        for t in range(sample.prompt_len, ids.numel() - 1):
            hidden, base = dspark_online.block_hidden(model, features, ids, t, BLOCK)
            refined += bool((base[1:].argmax(dim=-1) != torch.tensor(reference[(sample.sample_id, t)])).any())
            anchors += 1
    print(
        f"every anchor: {compared} drafts equal to speculators' K={PASSES} Jacobi drafts; at {refined}/{anchors} "
        "anchors the refiner overturned the backbone's argmax"
    )
    assert compared > 200 and refined > anchors // 2


def test_greedy_walks_equal_the_online_loop(setup, drafter):
    tmp, target, greedy, stop_ids = setup
    model, ckpt = drafter
    walks = parity.walks(parity.score(ckpt, greedy, tmp / "results"))
    accepted = []
    for sample in ShardSet(greedy).samples(tensors=[]):
        run = online.online_xpress(model, target, sample.input_ids[: sample.prompt_len], MAX_NEW, stop_ids)
        assert run.output_ids.tolist() == sample.input_ids.tolist(), sample.sample_id
        walk = walks[sample.sample_id]
        assert walk["produced"].to_list() == run.produced, sample.sample_id
        for step, (offline, drafts, produced) in enumerate(
            zip(walk["draft_tokens"].to_list(), run.drafts, run.produced)
        ):
            kept = produced - 1
            assert offline[:kept] == drafts[:kept], (sample.sample_id, step)
        accepted += run.accepted
    print(
        f"greedy: {len(accepted)} steps, mean accepted {np.mean(accepted):.3f}, all {BLOCK - 1}: {accepted.count(BLOCK - 1)}"
    )
    # non-trivial: several drafts accepted a step, whole blocks accepted, and both endings occur (a
    # response run to the budget ends with blocks reaching past it, which are never cut)
    assert np.mean(accepted) > 1.5 and BLOCK - 1 in accepted, accepted
    assert {s.finish_reason for s in ShardSet(greedy).samples(tensors=[])} == {"eos", "length"}


def _shifted_predecessor(before, anchor, pred):
    """Wrong: slot k reads the token at its own position (DSpark's sample_from_anchor convention)."""
    return torch.cat([anchor, pred[:, 1:]], dim=1)


def _anchor_before_the_anchor(before, anchor, pred):
    """Wrong: the anchor's slot reads the anchor, not x_{t-1}."""
    return torch.cat([anchor, anchor, pred[:, 1:-1]], dim=1)


WRONG = {
    "one pass fewer": ("passes", PASSES - 1),
    "slot k reads its own position's token": ("refiner_inputs", staticmethod(_shifted_predecessor)),
    "the anchor's slot reads the anchor": ("refiner_inputs", staticmethod(_anchor_before_the_anchor)),
}


@pytest.mark.parametrize("rule", list(WRONG))
def test_a_wrong_rule_drafts_other_tokens(setup, drafter, anchor_drafts, rule, monkeypatch):
    tmp, _, greedy, _ = setup
    monkeypatch.setattr(XPressDrafter, *WRONG[rule])
    wrong = _anchor_drafts(drafter[1], greedy, tmp / f"results-wrong-{rule.replace(' ', '-')}")
    joined = anchor_drafts.join(wrong, on=["sample_id", "anchor"], suffix="_wrong")
    differ = sum(a != b for a, b in zip(joined["draft_tokens"].to_list(), joined["draft_tokens_wrong"].to_list()))
    print(f"{rule}: {differ}/{joined.height} anchors' drafts differ")
    assert differ > 0


# ---------------------------------------------------------------------------------------------
# vLLM's layout and rule (tests/helpers/xpress_vllm.py): the same fitted weights as vLLM loads them

SMALL_TOPC = 2  # a top-C that binds on the tiny vocabulary


@pytest.fixture(scope="module")
def vllm_ckpts(setup, drafter) -> dict[int, str]:
    """top-C -> the fitted drafter in vLLM's layout with that `xpress_topc` (None: absent, vLLM's
    default 512, the whole tiny vocabulary)."""
    tmp, target, *_ = setup
    layers = target.config.num_hidden_layers
    return {c: vllm.vllm_layout(drafter[1], tmp / f"vllm-topc{c}", layers, topc=c) for c in (None, SMALL_TOPC)}


def _vllm_reference(model, ckpt: str, target, greedy: str, topc: int | None) -> dict[tuple[str, int], list[int]]:
    """(sample id, anchor) -> vLLM's refiner's drafts over speculators' own backbone's block."""
    head, blocks = vllm.refiner(ckpt), {}
    for sample in ShardSet(greedy).samples(tensors=[]):
        ids = sample.input_ids
        _, features, _ = target_states(target, ids)
        for t in range(sample.prompt_len, ids.numel() - 1):
            hidden, base = dspark_online.block_hidden(model, features, ids, t, BLOCK)
            blocks[(sample.sample_id, t)] = vllm.refine(head, hidden, base, int(ids[t]), PASSES, topc)
    return blocks


@pytest.mark.parametrize("topc", [None, SMALL_TOPC])
def test_vllms_layout_drafts_equal_vllms_refiner(setup, drafter, vllm_ckpts, anchor_drafts, reference, topc):
    """Every anchor's drafts of the vLLM-layout checkpoint equal vLLM's rule (its slot 0 reading the
    anchor, its top-C); they differ from speculators' rule where that rule reads x_{t-1}, and a
    binding top-C changes drafts too."""
    tmp, target, greedy, _ = setup
    offline = _anchor_drafts(vllm_ckpts[topc], greedy, tmp / f"results-vllm-{topc}")
    theirs = _vllm_reference(drafter[0], vllm_ckpts[topc], target, greedy, topc)
    assert set(zip(offline["sample_id"], offline["anchor"])) == set(theirs)
    rows = list(offline.iter_rows())
    for sample_id, anchor, drafts in rows:
        assert drafts == theirs[(sample_id, anchor)], (sample_id, anchor, drafts, theirs[(sample_id, anchor)])
    from_speculators = sum(drafts != reference[(s, a)] for s, a, drafts in rows)
    print(f"vLLM's rule, top-C {topc}: {len(rows)} anchors equal; {from_speculators} differ from speculators' rule")
    assert from_speculators > 0


def test_the_other_slot0_reading_is_speculators_rule(setup, vllm_ckpts, reference, monkeypatch):
    """The vLLM-layout checkpoint replayed under Conventions.xpress_other_slot0 (diagnose's
    xpress-slot0: the anchor slot reading x_{t-1}) drafts speculators' own rule at every anchor,
    the 2 anchors where vLLM's rule differs included."""
    tmp, _, greedy, _ = setup
    drafts = XPressDrafter.drafts

    def other_slot0(self, hidden, lm_head, previous, conventions=REFERENCE):
        return drafts(self, hidden, lm_head, previous, replace(conventions, xpress_other_slot0=True))

    monkeypatch.setattr(XPressDrafter, "drafts", other_slot0)
    offline = _anchor_drafts(vllm_ckpts[None], greedy, tmp / "results-vllm-other-slot0")
    assert {(s, a): d for s, a, d in offline.iter_rows()} == reference


def test_diagnose_names_the_speculators_slot0_reading(setup, drafter, vllm_ckpts):
    """The vLLM-layout checkpoint under diagnose's xpress-slot0 variant (the reading the test above
    checks anchor by anchor) is measured for XPress, and its tau is the speculators checkpoint's
    (here equal to vLLM's too: its two anchors that differ change no walk)."""
    from click.testing import CliRunner

    from specreplay.cli import main

    tmp, _, greedy, _ = setup
    out = tmp / "diagnose-slot0"
    args = ["diagnose", "--ckpt", vllm_ckpts[None], "--shards", greedy, "--out", str(out), "--variants", "xpress-slot0"]
    run = CliRunner().invoke(main, [*args, "--no-progress"])
    assert run.exit_code == 0, run.output
    [table] = [pl.read_parquet(path) for path in out.glob("*/diagnose.parquet")]
    taus = dict(table.filter(pl.col("metric") == "tau").select("variant", "value").iter_rows())
    speculators = pl.read_parquet(f"{parity.score(drafter[1], greedy, tmp / 'results-tau')}/summary.parquet")
    tau = speculators.filter(pl.col("method") == "chain")["tau"][0]
    print(
        f"tau: vLLM's slot 0 {taus['as-configured']:.4f}, xpress-slot0 {taus['xpress-slot0']:.4f}, speculators {tau:.4f}"
    )
    assert taus["xpress-slot0"] == pytest.approx(tau, abs=1e-9)
