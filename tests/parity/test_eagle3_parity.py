"""Exactness of EAGLE-3 replay: offline walks and expected tau against an online decoding loop.

The online loop (tests/helpers/eagle3_online.py) is written from the public reference's modules
only: speculators' `Eagle3DraftModel` (its fc, first decoder layer, norm, lm_head and d2t) on a
real growing transformers KV cache, one step at a time as vLLM's EagleProposer runs it (the draft
KV of verified positions written from target features only, the draft slots cut after each
verification), and z-lab's `dflash_generate` step, budget and stop rules (its `_rejection_sample`
at T > 0). The drafter, with a reduced draft vocabulary, is fitted with speculators' own training
forward on the tiny target's real features until chains accept several tokens, and saved with its
own save_pretrained; specreplay then scores the saved checkpoint from extracted shards.

- greedy: walk.parquet's `produced` per sample equals the online loop's list, and each step's
  accepted drafts inside the response and the first rejected one equal the online proposal's (the
  rejected one may differ only where the online drafter's two best logits tie within 1e-4); at every response anchor the
  replay's chain (anchors.parquet, --anchor-drafts) equals the online proposer's on a fresh cache;
- the same weights in SpecForge's layout (`LlamaForCausalLMEagle3`, `midlayer.*`, output-of-layer
  ids) walk exactly as the speculators checkpoint;
- sglang's dynamic tree (eagle-tree-*): at every response anchor each tree's candidates (every
  token path of the beam, with its score) and accepted depth equal a naive online tree drafted
  with speculators' modules, one cache copy per node (tests/helpers/eagle3_tree_online.py), the
  walks equal that tree's online loop, the trees accept more than the chain, both layouts score
  identical trees, and two wrong rules (children ranked by their own probability; a node
  attending to its lane's keys instead of its ancestors') draft other candidates;
- T = 0.7: the offline expected tau per prompt equals the mean over seeds of the online tau within
  3 combined standard errors, and the same statistic rejects the post-norm hidden state fed back
  to the next step where the config says pre-norm.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import polars as pl
import pytest
import torch

from pipeline.shards import ShardSet
from proposers.eagle3.model import Eagle3Drafter
from proposers.toolkit.eagle import tree as eagle_tree
from tests.helpers import (
    chain_parity as parity,
    eagle3_online as online,
    eagle3_tree_online as tree_online,
    eagle_tree_checks as tree_checks,
)
from tests.helpers.dspark_reference import AUX_IDS, OUTPUT_IDS
from tests.helpers.eagle3_reference import write_specforge
from tests.helpers.family_fits import frequent_tokens

MAX_NEW = 24
PROMPTS = 6
STEPS = 4  # speculative tokens a step drafts
DRAFT_VOCAB = 48  # of the target's 64
TEMPERATURE = 0.7
# seeded online runs per prompt, each one's response extracted and scored (paired): enough for the
# wrong rule (post-norm fed back) to stand far past the 3 standard errors asserted (`-s` prints it)
SAMPLED_DRAWS = 32
TARGET_LAYERS = 6
NEAR_TIE = 1e-4  # logits this close may rank apart between two kernels' float sums


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.one_thread()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tmp, target dir, prompts file, the target loaded, its greedy shards, their stop ids)."""
    return parity.tiny_target_setup(tmp_path_factory.mktemp("eagle3_parity"), PROMPTS, MAX_NEW)


def _sequences(shards: str) -> list[tuple[torch.Tensor, int]]:
    return [(s.input_ids, s.prompt_len) for s in ShardSet(shards).samples(tensors=[])]


@pytest.fixture(scope="module")
def drafter(setup):
    """(speculators' Eagle3DraftModel fitted to the target, its saved checkpoint, the same weights
    in SpecForge's layout). Fitted on the greedy responses (repeated: the greedy walks should accept
    several tokens) and on sampled responses of another seed than the T > 0 test's, so the responses
    that test scores are fresh draws for the drafter, as the online loop's are; its draft vocabulary
    the DRAFT_VOCAB most frequent response tokens, as speculators' data prep selects them."""
    tmp, model_dir, prompts, target, greedy, _ = setup
    train = parity.extract(tmp / "train", model_dir, prompts, MAX_NEW, OUTPUT_IDS, TEMPERATURE, 48, seed=5)
    sequences = _sequences(greedy) * 6 + _sequences(train)
    t2d, _ = frequent_tokens(sequences, DRAFT_VOCAB, target.config.vocab_size)
    model = online.new_drafter(target, aux_ids=AUX_IDS, steps=STEPS, draft_vocab=t2d.nonzero().flatten())
    documents = online.training_documents(target, [ids for ids, _ in sequences], [n for _, n in sequences])
    online.fit(model, documents, steps=1500, lr=5e-3)
    ckpt = str(tmp / "ckpt")
    model.save_pretrained(ckpt)
    return model, ckpt, write_specforge(ckpt, tmp / "ckpt-specforge", TARGET_LAYERS)


def _online_walks(model, target, shards, stop_ids) -> dict[str, online.OnlineRun]:
    """The online loop on every stored greedy response's prompt; it must emit that response."""
    runs = {}
    for sample in ShardSet(shards).samples(tensors=[]):
        run = online.online_eagle3(model, target, sample.input_ids[: sample.prompt_len], MAX_NEW, stop_ids)
        assert run.output_ids.tolist() == sample.input_ids.tolist(), sample.sample_id
        runs[sample.sample_id] = run
    return runs


# ---------------------------------------------------------------------------------------------
# greedy


@pytest.mark.slow
def test_greedy_walks_equal_the_online_loop(setup, drafter):
    tmp, _, _, target, greedy, stop_ids = setup
    model, ckpt, _ = drafter
    runs = _online_walks(model, target, greedy, stop_ids)
    walks = parity.walks(parity.score(ckpt, greedy, tmp / "results"))
    equal, flips = 0, []
    for sample_id, run in runs.items():
        walk = walks[sample_id]
        assert walk["produced"].to_list() == run.produced, sample_id
        for step, (offline, drafts, accepted, produced, margins) in enumerate(
            zip(walk["draft_tokens"].to_list(), run.drafts, run.accepted, run.produced, run.margins)
        ):
            # the accepted drafts the response holds (a stop token or the length cap may end it first)
            kept = min(accepted, produced)
            assert offline[:kept] == drafts[:kept], (sample_id, step)
            if kept < min(produced, len(drafts)) and offline[kept] != drafts[kept]:
                # the first rejected draft: its token may flip only where the online drafter's two
                # best logits tie to float rounding (batched and one-at-a-time kernels sum apart)
                flips.append((sample_id, step, margins[accepted]))
        equal += 1
    assert all(margin < NEAR_TIE for *_, margin in flips), flips
    accepted = [n for run in runs.values() for n in run.accepted]
    produced = [n for run in runs.values() for n in run.produced]
    finish = Counter(s.finish_reason for s in ShardSet(greedy).samples(tensors=[]))
    print(
        f"greedy: walks equal {equal}/{len(runs)} (first rejected drafts at near-ties {flips}), {len(produced)} steps, tau {np.mean(produced):.3f}, "
        f"mean accepted {np.mean(accepted):.3f}, finish {dict(finish)}"
    )
    # non-trivial: both endings, several drafts accepted a step, whole chains accepted
    assert finish["eos"] and finish["length"], finish
    assert np.mean(accepted) > 1.5, accepted
    assert STEPS in accepted, accepted


@torch.no_grad()
def _online_chain(model, target, ids: torch.Tensor, anchor: int, count: int) -> list[int]:
    """The online proposer's greedy drafts at `anchor` of the committed sequence `ids`, on a fresh
    cache: the target's causal features of the committed positions are those of the whole sequence."""
    _, features, _ = online.target_states(target, ids)
    return online.propose(online.DraftCache(model), features, ids, anchor, count, 0.0).drafts.tolist()


@pytest.mark.slow
def test_every_anchors_chain_equals_the_online_proposer(setup, drafter):
    """anchors.parquet's draft block at every response anchor (score --anchor-drafts) equals the
    online proposer's greedy chain there up to its first draft that is not the stored token (after
    it the online chain reads its own wrong draft, the replay the stored token, and it is never
    verified)."""
    tmp, _, _, target, greedy, _ = setup
    model, ckpt, _ = drafter

    def chain_at(ids, anchor, count):
        return _online_chain(model, target, ids, anchor, count)

    compared, _ = parity.anchor_chains_compared(ckpt, greedy, tmp / "results-anchors", chain_at)
    assert compared > 60


# ---------------------------------------------------------------------------------------------
# the same weights in SpecForge's layout


@pytest.mark.slow
def test_specforge_layout_walks_as_speculators(setup, drafter):
    tmp, _, _, _, greedy, _ = setup
    _, ckpt, specforge = drafter
    layouts = {"speculators": ckpt, "specforge": specforge}
    tables = {
        name: parity.walk_table(parity.score(path, greedy, tmp / f"layout-{name}")) for name, path in layouts.items()
    }
    assert tables["speculators"].height > PROMPTS
    assert tables["specforge"].equals(tables["speculators"])
    print(f"SpecForge layout: {tables['specforge'].height} walk steps equal to the speculators checkpoint's")


# ---------------------------------------------------------------------------------------------
# sampled, T = 0.7


def _post_norm_feedback(self, h):
    """Eagle3Drafter.feedback with the wrong rule: the post-norm hidden state fed to the next step
    where the config (norm_output false) says pre-norm."""
    return self.norm(h)


@pytest.mark.slow
def test_sampled_expected_tau_equals_the_online_tau_run_by_run(setup, drafter):
    """T 0.7, paired: SAMPLED_DRAWS seeded online runs per prompt, each run's own response extracted
    and scored; the online tau minus the offline expected tau given those tokens has mean zero within
    3 standard errors, per prompt and over every run. The wrong rule is the same replay re-run with
    the post-norm hidden state fed back (`_post_norm_feedback`): outside 3 standard errors."""
    tmp, model_dir, _, target, _, stop_ids = setup
    model, ckpt, _ = drafter

    def run(prompt):
        return online.online_eagle3(model, target, prompt, MAX_NEW, stop_ids, TEMPERATURE)

    runs = parity.paired_runs(run, PROMPTS, SAMPLED_DRAWS)
    assert np.mean([tau for *_, tau in runs]) > 1.5  # several tokens a step
    wrong = (Eagle3Drafter, "feedback", _post_norm_feedback)
    options = dict(max_new=MAX_NEW, layer_ids=OUTPUT_IDS, temperature=TEMPERATURE)
    verdict = parity.paired_verdict(ckpt, model_dir, runs, tmp, wrong, "post-norm fed back", **options)
    assert all(abs(v) < 3 for v in verdict.z_prompts.values()) and abs(verdict.z) < 3, verdict
    assert abs(verdict.z_wrong) > 3, verdict


# ---------------------------------------------------------------------------------------------
# sglang's dynamic tree (eagle-tree-*), against a naive online tree on the same weights

TREES = {"4x5-8": (4, 5, 8), "2x4-6": (2, 4, 6)}  # sglang's default, and a narrower deeper one
SCORE_TOLERANCE = 1e-5  # a candidate's path probability, float32 products of softmaxes
# plausible wrong rules, each patched into specreplay's tree (proposers/toolkit/eagle/tree.py)
MUTANTS = {
    # children ranked by their own probability, not their path's
    "own-prob": ("child_scores", lambda parents, p: p.expand(parents.shape[0], *p.shape[1:])),
    # a new beam node continues the keys of the lane it lands in (sglang v1's draft KV layout),
    # not its parent's: it attends to another branch's steps
    "lane-keys": ("path_rows", lambda parents: torch.arange(parents.numel(), device=parents.device)),
}


@pytest.fixture(scope="module")
def online_trees(setup, drafter) -> dict[tuple[str, int], tuple[dict, dict]]:
    """(sample id, anchor) -> (tree name -> the online tree's accepted depth there, topk -> every
    candidate's path -> its score)."""
    _, _, _, target, greedy, _ = setup
    model = drafter[0]
    found = {}
    for sample in ShardSet(greedy).samples(tensors=[]):
        for anchor in range(sample.prompt_len, sample.input_ids.numel() - 1):
            alphas, scores = tree_online.anchor_trees(model, target, sample.input_ids, anchor, list(TREES.values()))
            found[(sample.sample_id, anchor)] = dict(zip(TREES, alphas)), scores
    return found


@pytest.mark.slow
def test_eagle_trees_equal_the_online_tree_at_every_anchor_and_walk(setup, drafter, online_trees, monkeypatch):
    """Every anchor's candidates (token paths and scores) and alpha of each tree equal the online
    tree's, the walks' produced lists equal the online tree loop's, and the trees accept more than
    the chain (else this proves little)."""
    tmp, _, _, target, greedy, stop_ids = setup
    model, ckpt, _ = drafter
    with tree_checks.drafted_candidates(monkeypatch, greedy) as drafted:
        out_dir = parity.score(ckpt, greedy, tmp / "results-trees", eagle_trees=list(TREES))
    table = tree_checks.tree_alphas(out_dir, TREES)
    assert table.height == len(online_trees) and len(drafted) == 2 * len(online_trees)  # two topks
    differ, largest = tree_checks.candidate_mismatches(drafted, online_trees, SCORE_TOLERANCE)
    assert differ == 0, (differ, largest)
    assert tree_checks.mismatches(table, online_trees, TREES) == dict.fromkeys(TREES, 0)
    walk = pl.read_parquet(f"{out_dir}/walk.parquet")
    for name, tree in TREES.items():
        mine = walk.filter(pl.col("method") == f"eagle-tree-{name}").sort("sample_id", "step")
        for sample in ShardSet(greedy).samples(tensors=[]):
            run = tree_online.online_tree_walk(
                model, target, sample.input_ids[: sample.prompt_len], MAX_NEW, stop_ids, tree
            )
            assert run.output_ids.tolist() == sample.input_ids.tolist(), (name, sample.sample_id)
            offline = mine.filter(pl.col("sample_id") == sample.sample_id)["produced"].to_list()
            assert offline == run.produced, (name, sample.sample_id)
    summary = pl.read_parquet(f"{out_dir}/summary.parquet").filter(pl.col("dataset") == "(all)")
    tau = dict(summary.select("method", "tau").iter_rows())
    streak = {name: table[f"eagle_tree_{name.replace('-', '_')}_accepted_len"].mean() for name in TREES}
    print(
        f"trees: {table.height} anchors equal, candidates' largest score difference {largest:.1e}; chain streak {table['accepted_len'].mean():.3f}, tree {streak}; tau {tau}"
    )
    assert all(s > table["accepted_len"].mean() for s in streak.values()), streak
    # sglang's default beats the chain along the walk too; the narrow 2x4-6 keeps 5 nodes against the
    # chain's 4 drafts and may not (measured: tau 3.197 against 3.518, streak 2.411 against 2.274)
    assert tau["eagle-tree-4x5-8"] > tau["chain"], tau


@pytest.mark.slow
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_eagle_trees_reject_a_wrong_rule(setup, drafter, online_trees, mutant, monkeypatch):
    """The same comparison fails when specreplay's tree follows a plausible wrong rule: its
    candidates differ from the online tree's (the accepted depths too, where the rule binds there;
    the lane rule seldom does: a side lane's deep nodes are rarely kept and accepted)."""
    tmp, _, _, _, greedy, _ = setup
    monkeypatch.setattr(eagle_tree, *MUTANTS[mutant])
    with tree_checks.drafted_candidates(monkeypatch, greedy) as drafted:
        out_dir = parity.score(drafter[1], greedy, tmp / f"results-trees-{mutant}", eagle_trees=list(TREES))
    differ, _ = tree_checks.candidate_mismatches(drafted, online_trees, SCORE_TOLERANCE)
    counts = tree_checks.mismatches(tree_checks.tree_alphas(out_dir, TREES), online_trees, TREES)
    print(f"{mutant}: candidates differ at {differ} of {len(drafted)} (anchor, topk); alphas differ {counts}")
    assert differ > len(drafted) // 4, (differ, counts)


@pytest.mark.slow
def test_eagle_trees_specforge_layout_as_speculators(setup, drafter):
    tmp, _, _, _, greedy, _ = setup
    _, ckpt, specforge = drafter
    tables = [
        tree_checks.tree_alphas(parity.score(path, greedy, tmp / f"trees-{name}", eagle_trees=list(TREES)), TREES)
        for name, path in (("speculators", ckpt), ("specforge", specforge))
    ]
    assert tables[0].equals(tables[1])
