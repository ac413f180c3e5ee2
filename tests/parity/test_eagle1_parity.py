"""Exactness of EAGLE-1/2 replay against the EAGLE repository's own drafter (PyPI eagle-llm 1.2.1,
`eagle/model/cnets.py` `Model`), driven online.

The drafter is the repository's `Model` (two Llama layers, the first without an input norm, fc
over [embedding ; the target's post-norm last hidden state] with its bias), fitted with the
repository's own training loss (eagle/train/main.py) on the tiny target's real states until chains
accept several tokens, and saved as the repository saves it (config.json with `bias`,
pytorch_model.bin). The online loops are tests/helpers/eagle3_online.py's (vLLM's EagleProposer
rule, z-lab's step, budget and stop rules) and eagle3_tree_online.py's (sglang's dynamic tree,
EAGLE-2's), calling the reference model on its own KV cache (tests/helpers/eagle1_online.py).

- greedy: walk.parquet equals the online loop's per step (produced, and the accepted drafts);
- every response anchor's chain (anchors.parquet, --anchor-drafts) equals the online proposer's;
- the same checkpoint under vLLM's architecture and under the repository's own (`--family eagle`)
  walks identically;
- EAGLE-2's tree (eagle-tree-*): every anchor's candidates and accepted depth equal the naive
  online tree's, and the walks its loop's;
- T = 0.7: the offline expected tau per prompt equals the online mean over seeds within 3 combined
  standard errors;
- a wrong rule, fc reading [hidden ; embedding] (EAGLE-3's first layer reads its halves in that
  order), changes the greedy walks and falls outside 3 standard errors at T > 0.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch

from pipeline.shards import ShardSet
from proposers.eagle.model import Eagle1Drafter
from tests.helpers import (
    chain_parity as parity,
    eagle1_online as eagle1,
    eagle3_online as online,
    eagle3_tree_online as tree_online,
    eagle_tree_checks as tree_checks,
)

MAX_NEW = 24
PROMPTS = 6
STEPS = 4
FIT_STEPS = 1000
LAYERS = 2  # the drafter's: two layers over this tiny target's one feature accept several drafts a step
TEMPERATURE = 0.7
SAMPLED_DRAWS = 24
TARGET_LAYERS = 6
FEATURE = [TARGET_LAYERS - 1]  # the post-norm last hidden state
NEAR_TIE = 1e-4
TREES = {"4x5-8": (4, 5, 8)}  # sglang's default; the tree code is EAGLE-3's, checked there with a second
SCORE_TOLERANCE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.one_thread()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return parity.tiny_target_setup(tmp_path_factory.mktemp("eagle1_parity"), PROMPTS, MAX_NEW, FEATURE)


def _sequences(shards: str) -> list[tuple[torch.Tensor, int]]:
    return [(s.input_ids, s.prompt_len) for s in ShardSet(shards).samples(tensors=[])]


@pytest.fixture(scope="module")
def drafter(setup):
    """(the reference wrapped for the online loops, its checkpoint in SGLang's layout). Fitted on the
    greedy responses (repeated) and on sampled ones of another seed than the T > 0 test's."""
    tmp, model_dir, prompts, target, greedy, _ = setup
    train = parity.extract(tmp / "train", model_dir, prompts, MAX_NEW, FEATURE, TEMPERATURE, 48, seed=5)
    examples = [eagle1.training_example(target, ids, n) for ids, n in _sequences(greedy) * 6 + _sequences(train)]
    model = eagle1.new_model(target, layers=LAYERS)
    eagle1.fit(model, target, examples, steps=FIT_STEPS, lr=5e-3)
    return eagle1.Eagle1Reference(model, target, STEPS), eagle1.save_for(model, target, tmp / "ckpt")


def _score(ckpt, shards, out, **options) -> str:
    return parity.score(ckpt, shards, out, steps=STEPS, **options)


def _swapped_inputs(self, layer, h, embeds):
    """Eagle1Drafter.layer_input with a wrong rule: fc reading [hidden ; embedding], EAGLE-3's order
    of the two halves its first layer reads, where the repository's fc reads [embedding ; hidden]."""
    if layer is not self.layers[0]:
        return layer.attention_input(h, None)
    z = self.fc(torch.cat([h, embeds], dim=-1))
    return z, z


WRONG = (Eagle1Drafter, "layer_input", _swapped_inputs)


@pytest.fixture(scope="module")
def online_walks(setup, drafter) -> dict[str, online.OnlineRun]:
    """The online loop on every stored greedy response's prompt; it must emit that response."""
    _, _, _, target, greedy, stop_ids = setup
    runs = {}
    for sample in ShardSet(greedy).samples(tensors=[]):
        run = online.online_eagle3(drafter[0], target, sample.input_ids[: sample.prompt_len], MAX_NEW, stop_ids)
        assert run.output_ids.tolist() == sample.input_ids.tolist(), sample.sample_id
        runs[sample.sample_id] = run
    return runs


def _walk_differences(walks: dict, runs: dict) -> tuple[int, list]:
    """(samples whose produced lists differ, the steps whose accepted drafts differ or whose first
    rejected draft differs away from a near-tie)."""
    produced, steps = 0, []
    for sample_id, run in runs.items():
        walk = walks[sample_id]
        produced += walk["produced"].to_list() != run.produced
        rows = zip(walk["draft_tokens"].to_list(), run.drafts, run.accepted, run.produced, run.margins)
        for step, (offline, drafts, accepted, made, margins) in enumerate(rows):
            kept = min(accepted, made)
            rejected_differs = kept < min(made, len(drafts)) and offline[kept] != drafts[kept]
            if offline[:kept] != drafts[:kept] or (rejected_differs and margins[accepted] >= NEAR_TIE):
                steps.append((sample_id, step))
    return produced, steps


@pytest.mark.slow
def test_greedy_walks_equal_the_online_loop_and_reject_the_wrong_rule(setup, drafter, online_walks, monkeypatch):
    tmp, _, _, _, greedy, _ = setup
    walks = parity.walks(_score(drafter[1], greedy, tmp / "results"))
    assert _walk_differences(walks, online_walks) == (0, [])
    accepted = [n for run in online_walks.values() for n in run.accepted]
    produced = [n for run in online_walks.values() for n in run.produced]
    monkeypatch.setattr(*WRONG)
    wrong = _walk_differences(parity.walks(_score(drafter[1], greedy, tmp / "results-wrong")), online_walks)
    print(
        f"greedy: {len(produced)} steps equal, tau {np.mean(produced):.3f}, mean accepted {np.mean(accepted):.3f}; "
        f"[hidden ; embedding]: {wrong[0]} of {len(online_walks)} walks and {len(wrong[1])} steps differ"
    )
    assert np.mean(accepted) > 1.25 and STEPS in accepted, accepted  # several drafts a step, whole chains
    assert wrong[0] >= len(online_walks) // 2, wrong


@pytest.mark.slow
def test_every_anchors_chain_equals_the_online_proposer(setup, drafter):
    """anchors.parquet's chain at every response anchor equals the online proposer's greedy chain on a
    fresh cache, up to its first draft that is not the stored token."""
    tmp, _, _, target, greedy, _ = setup
    reference = drafter[0]

    def chain_at(ids, anchor, count):
        _, features, _ = reference.states(target, ids)
        return online.propose(reference.new_cache(), features, ids, anchor, count, 0.0).drafts.tolist()

    compared, _ = parity.anchor_chains_compared(drafter[1], greedy, tmp / "anchors", chain_at, steps=STEPS)
    assert compared > 60


@pytest.mark.slow
def test_vllm_and_the_repositorys_layouts_walk_alike(setup, drafter):
    """The same weights under vLLM's architecture and the repository's own (read with --family eagle)."""
    tmp, _, _, target, greedy, _ = setup
    reference = drafter[0]
    vllm = eagle1.save_for(reference.model, target, tmp / "ckpt-vllm", architecture="EagleLlamaForCausalLM")
    repo = eagle1.save_for(reference.model, target, tmp / "ckpt-repo", architecture="LlamaForCausalLM")
    tables = {
        "sglang": parity.walk_table(_score(drafter[1], greedy, tmp / "layout-sglang")),
        "vllm": parity.walk_table(_score(vllm, greedy, tmp / "layout-vllm")),
        "eagle": parity.walk_table(_score(repo, greedy, tmp / "layout-repo", family="eagle")),
    }
    assert tables["sglang"].height > PROMPTS
    assert tables["vllm"].equals(tables["sglang"]) and tables["eagle"].equals(tables["sglang"])


@pytest.mark.slow
def test_eagle2_trees_equal_the_online_tree_at_every_anchor_and_walk(setup, drafter, monkeypatch):
    tmp, _, _, target, greedy, stop_ids = setup
    reference = drafter[0]
    online_trees = {}
    for sample in ShardSet(greedy).samples(tensors=[]):
        for anchor in range(sample.prompt_len, sample.input_ids.numel() - 1):
            alphas, scores = tree_online.anchor_trees(reference, target, sample.input_ids, anchor, list(TREES.values()))
            online_trees[(sample.sample_id, anchor)] = dict(zip(TREES, alphas)), scores
    with tree_checks.drafted_candidates(monkeypatch, greedy) as drafted:
        out_dir = _score(drafter[1], greedy, tmp / "trees", eagle_trees=list(TREES))
    table = tree_checks.tree_alphas(out_dir, TREES)
    assert table.height == len(online_trees) and len(drafted) == len(online_trees)
    differ, largest = tree_checks.candidate_mismatches(drafted, online_trees, SCORE_TOLERANCE)
    assert differ == 0, (differ, largest)
    assert tree_checks.mismatches(table, online_trees, TREES) == dict.fromkeys(TREES, 0)
    walk = pl.read_parquet(f"{out_dir}/walk.parquet")
    for name, tree in TREES.items():
        mine = walk.filter(pl.col("method") == f"eagle-tree-{name}")
        for sample in ShardSet(greedy).samples(tensors=[]):
            prompt = sample.input_ids[: sample.prompt_len]
            run = tree_online.online_tree_walk(reference, target, prompt, MAX_NEW, stop_ids, tree)
            offline = mine.filter(pl.col("sample_id") == sample.sample_id).sort("step")["produced"].to_list()
            assert offline == run.produced, (name, sample.sample_id)
    streak = {name: table[tree_checks.column(name)].mean() for name in TREES}
    print(
        f"trees: {table.height} anchors equal (largest score gap {largest:.1e}); chain {table['accepted_len'].mean():.3f}, {streak}"
    )
    assert all(s > table["accepted_len"].mean() for s in streak.values()), streak


@pytest.mark.slow
def test_sampled_expected_tau_equals_the_online_tau_run_by_run(setup, drafter):
    """T 0.7, paired: SAMPLED_DRAWS seeded online runs per prompt, each run's own response extracted
    and scored; the online tau minus the offline expected tau given those tokens has mean zero within
    3 standard errors; the swapped fc inputs fall outside."""
    tmp, model_dir, _, target, _, stop_ids = setup

    def run(prompt):
        return online.online_eagle3(drafter[0], target, prompt, MAX_NEW, stop_ids, TEMPERATURE)

    runs = parity.paired_runs(run, PROMPTS, SAMPLED_DRAWS)
    options = dict(max_new=MAX_NEW, layer_ids=FEATURE, temperature=TEMPERATURE, steps=STEPS)
    verdict = parity.paired_verdict(drafter[1], model_dir, runs, tmp, WRONG, "[hidden ; embedding]", **options)
    assert all(abs(v) < 3 for v in verdict.z_prompts.values()) and abs(verdict.z) < 3, verdict
    assert abs(verdict.z_wrong) > 3, verdict


@pytest.mark.slow
def test_the_pre_norm_state_is_the_other_convention_and_diagnose_keeps_the_configured_one(setup, drafter):
    """The target's last hidden state in the other numbering (before-layer id L: the state before the
    final norm, which the project stores as its id L) is what a drafter trained on the wrong one
    would read; for this drafter it loses most drafts, and diagnose keeps the configured reading."""
    tmp, model_dir, prompts, _, _, _ = setup
    shards = parity.extract(tmp / "both-states", model_dir, prompts, MAX_NEW, [*FEATURE, TARGET_LAYERS])
    taus, verdict = _diagnosed_taus(drafter[1], shards, tmp / "diagnose", "layers+1")
    print(f"tau: the post-norm state (configured) {taus['as-configured']:.3f}, the pre-norm one {taus['layers+1']:.3f}")
    assert taus["as-configured"] > 1.8 and taus["layers+1"] < 0.7 * taus["as-configured"], taus
    assert "consistent" in verdict[0], verdict


@pytest.mark.slow
def _diagnosed_taus(ckpt: str, shards: str, out, variants: str) -> tuple[dict, list[str]]:
    """(variant -> chain tau, the verdict) of `specreplay diagnose`."""
    from click.testing import CliRunner

    from specreplay.cli import main

    args = ["diagnose", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--variants", variants]
    run = CliRunner().invoke(main, [*args, "--no-progress"])
    assert run.exit_code == 0, run.output
    [table] = [pl.read_parquet(path) for path in out.glob("*/diagnose.parquet")]
    verdict = json.loads(next(out.glob("*/diagnose.json")).read_text())["verdict"]
    return dict(table.filter(pl.col("metric") == "tau").select("variant", "value").iter_rows()), verdict


@pytest.mark.slow
def test_diagnoses_rope_10000_variant_replays_the_repositorys_rope(setup, drafter):
    """The repository's inference builds RoPE with base 10000 whatever rope_theta says; vLLM, SGLang
    and specreplay read rope_theta. The fitted weights saved with rope_theta 500000 (as a Llama-3
    target's config states it) score lower, and diagnose's rope-10000 variant gives back exactly the
    tau of the weights under base 10000."""
    tmp, _, _, target, greedy, _ = setup
    reference = drafter[0]
    fields = eagle1.config_fields(target.config, LAYERS) | {"rope_theta": 500000.0}
    stated = eagle1.save(reference.model, fields, tmp / "ckpt-rope-500000")
    right, _ = _diagnosed_taus(drafter[1], greedy, tmp / "diagnose-rope-right", "as-configured")
    wrong, verdict = _diagnosed_taus(stated, greedy, tmp / "diagnose-rope-wrong", "rope-10000")
    print(
        f"tau: rope_theta 10000 {right['as-configured']:.3f}; 500000 {wrong['as-configured']:.3f}, with the "
        f"rope-10000 variant {wrong['rope-10000']:.3f}"
    )
    assert wrong["rope-10000"] == right["as-configured"] != wrong["as-configured"], (right, wrong)
    print(verdict[0])
