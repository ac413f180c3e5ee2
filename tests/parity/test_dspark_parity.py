"""Exactness of DSpark replay: offline walks and expected tau against an online decoding loop.

The online loop (tests/helpers/dspark_online.py) is written from the public references'
modules only: speculators' `DSparkDraftModel` (its `_backbone_forward`, `markov_head`,
`confidence_head`), DeepSpec's proposal rule (drafts slot by slot, each Markov bias given the
previous draft; the confidence cut) and z-lab's `dflash_generate` step, budget and stop rules
(its `_rejection_sample` at T > 0). The drafters are fitted with speculators' own training
forward on the tiny target's real features until blocks accept several tokens, and saved with
its save_pretrained; specreplay then scores the saved checkpoint from extracted shards.

- greedy: walk.parquet's `produced` per sample equals the online loop's list, for a vanilla
  and an rnn Markov head, also with a confidence threshold that cuts some proposals;
- the same weights in SpecForge's and DeepSpec's layouts walk exactly as the speculators one;
- T = 0.7, paired: each seeded online run's own response is extracted and scored; the online tau
  minus the offline expected tau given those tokens has mean zero within 3 standard errors, and
  the same statistic rejects the Markov head fed its own greedy draft as predecessor instead of
  the stored token (not teacher-forced).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import polars as pl
import pytest
import torch

from pipeline.shards import ShardSet
from proposers.dspark.model import DSparkDrafter
from tests.helpers import chain_parity as chains, dspark_online as online
from tests.helpers.dspark_reference import (
    OUTPUT_IDS,
    reference_drafts,
    speculators_dspark,
    write_deepspec,
    write_specforge,
)
from tests.helpers.prompts import write_prompts

MAX_NEW = 24
BLOCK = 4
PROMPTS = 6
TEMPERATURE = 0.7
HEADS = ["vanilla", "rnn"]


# ---------------------------------------------------------------------------------------------
# the online loop's backbone call is the reference's per-anchor output (fast)


def test_online_block_is_the_references_block_at_that_anchor(tmp_path):
    """The loop's block at anchor t (the sequence up to t padded, t the one anchor) equals the
    block speculators' training path computes at t with every anchor of the whole sequence at
    once (tests/helpers/dspark_reference.py `reference_drafts`), and the block at t of a call
    anchoring every position of the padded sequence. A full-attention drafter: speculators'
    sliding-window training mask differs from serving. The slot-by-slot proposal equals one
    call of the reference's heads given the proposal's own drafts as predecessors."""
    model, _, _ = speculators_dspark(tmp_path, head_type="rnn", block_size=BLOCK)
    generator = torch.Generator().manual_seed(3)
    length, hidden_size = 16, model.config.transformer_layer_config.hidden_size
    features = torch.randn(length, len(OUTPUT_IDS) * hidden_size, generator=generator)
    ids = torch.randint(0, model.config.draft_vocab_size, (length,), generator=generator)
    expected = reference_drafts(model, features, ids)
    for anchor in expected["anchors"].tolist():
        hidden, base = online.block_hidden(model, features, ids, anchor, BLOCK)
        torch.testing.assert_close(hidden, expected["hidden"][anchor], atol=1e-5, rtol=0)
        every, _ = online.block_hidden(model, features, ids, anchor, BLOCK, every_anchor=True)
        torch.testing.assert_close(every, hidden, atol=1e-5, rtol=0)
        # teacher-forced predecessors: base + the Markov bias are the reference's biased logits
        prev = expected["previous"][anchor][None]
        bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden[None])[0]
        torch.testing.assert_close(base + bias, expected["logits"][anchor], atol=1e-5, rtol=0)
        proposal = online.propose(model, hidden, base, int(ids[anchor]), 0.0, 0.0)
        own = torch.cat([ids[anchor : anchor + 1], proposal.drafts[:-1]])[None]
        logits = base + model.markov_head.block_bias(prev_token_ids=own, hidden_states=hidden[None])[0]
        assert torch.equal(proposal.drafts, logits.argmax(dim=-1))
        conf_in = torch.cat([hidden, model.markov_head.prev_embeddings(own)[0]], dim=-1)
        torch.testing.assert_close(proposal.confidence, model.confidence_head(conf_in).sigmoid(), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# the tiny target, its shards, the fitted drafters


def _extract(out, model_dir, prompts, temperature: float = 0.0, num_samples: int = 1, seed: int = 11) -> str:
    # the drafters' before-layer ids 1, 3, 5
    return chains.extract(out, model_dir, prompts, MAX_NEW, OUTPUT_IDS, temperature, num_samples, seed)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from chains.one_thread()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("dspark_parity")
    model_dir = online.build_target(tmp / "target")
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with open(f"{model_dir}/generation_config.json") as f:
        generation = json.load(f)
    generation["eos_token_id"] = chains.stop_token(target, chains.prompt_ids(PROMPTS), MAX_NEW)
    with open(f"{model_dir}/generation_config.json", "w") as f:
        json.dump(generation, f)
    prompts = write_prompts(
        tmp / "prompts.jsonl", [{"id": f"p{i}", "input_ids": p} for i, p in enumerate(chains.prompt_ids(PROMPTS))]
    )
    greedy = _extract(tmp / "greedy", model_dir, prompts)
    stop_ids = ShardSet(greedy).settings["target"]["stop_token_ids"]
    return tmp, model_dir, prompts, target, greedy, stop_ids


def _documents(target, shards: str) -> list[dict]:
    samples = list(ShardSet(shards).samples(tensors=[]))
    return online.training_documents(target, [s.input_ids for s in samples], [s.prompt_len for s in samples])


@pytest.fixture(scope="module")
def drafters(setup):
    """head type -> (speculators' DSparkDraftModel fitted to the target, its saved checkpoint).
    Fitted on the greedy responses (repeated: the greedy walks should accept several tokens)
    and on sampled responses of another seed than the T > 0 test's, so that the responses that
    test scores are fresh draws for the drafter as the online loop's are."""
    tmp, model_dir, prompts, target, greedy, _ = setup
    train = _extract(tmp / "train", model_dir, prompts, TEMPERATURE, num_samples=48, seed=5)
    documents = _documents(target, greedy) * 6 + _documents(target, train)
    out = {}
    for head in HEADS:
        model = online.new_drafter(target, head_type=head, block_size=BLOCK)
        online.fit(model, documents, steps=800, lr=5e-3)
        model.save_pretrained(str(tmp / f"ckpt-{head}"))
        out[head] = (model, str(tmp / f"ckpt-{head}"))
    return out


# ---------------------------------------------------------------------------------------------
# scoring


def _assert_walks_equal(walks: dict[str, pl.DataFrame], runs: dict[str, online.OnlineRun]) -> None:
    """Per sample, the offline `produced` list is the online loop's; at each step the offline
    drafts up to the first rejected one are the online proposal's (after a rejection the
    online Markov head conditions on its own wrong draft, the offline one on the stored token);
    the drafts proposed are the online proposal's count, its confidence cut read along its own
    drafts past a rejection too."""
    for sample_id, run in runs.items():
        walk = walks.get(sample_id, pl.DataFrame({"produced": [], "draft_tokens": [], "drafted": []}))
        assert walk["produced"].to_list() == run.produced, sample_id
        assert walk["drafted"].to_list() == [len(drafts) for drafts in run.drafts], sample_id
        for step, (offline, drafts, produced) in enumerate(
            zip(walk["draft_tokens"].to_list(), run.drafts, run.produced)
        ):
            verified = min(produced, len(drafts))  # the accepted drafts and the first rejected one
            assert offline[:verified] == drafts[:verified], (sample_id, step)


def _set_threshold(config_path, threshold: float) -> None:
    """`confidence_threshold` (DeepSpec's evaluator flag; this project's config field) where
    specreplay reads it: the top level, or SpecForge's `dflash_config`."""
    with open(config_path) as f:
        raw = json.load(f)
    (raw["dflash_config"] if "dflash_config" in raw else raw)["confidence_threshold"] = threshold
    with open(config_path, "w") as f:
        json.dump(raw, f, indent=2)


def _with_threshold(ckpt: str, out, threshold: float) -> str:
    shutil.copytree(ckpt, out)
    _set_threshold(f"{out}/config.json", threshold)
    return str(out)


def _online_walks(model, target, shards, stop_ids, threshold=0.0) -> dict[str, online.OnlineRun]:
    """The online loop on every stored greedy response's prompt; it must emit that response."""
    runs = {}
    for sample in ShardSet(shards).samples(tensors=[]):
        prompt = sample.input_ids[: sample.prompt_len]
        run = online.online_dspark(model, target, prompt, MAX_NEW, stop_ids, threshold=threshold)
        assert run.output_ids.tolist() == sample.input_ids.tolist(), sample.sample_id
        runs[sample.sample_id] = run
    return runs


def _cutting_threshold(runs: dict[str, online.OnlineRun]) -> float:
    """The median over the steps of the block's lowest sigmoid(c_k): cuts about half the proposals."""
    return float(np.median([float(c.min()) for run in runs.values() for c in run.confidence]))


# ---------------------------------------------------------------------------------------------
# greedy


@pytest.mark.slow
@pytest.mark.parametrize("head", HEADS)
def test_greedy_walks_equal_the_online_loop(setup, drafters, head):
    tmp, _, _, target, greedy, stop_ids = setup
    model, ckpt = drafters[head]
    runs = _online_walks(model, target, greedy, stop_ids)
    _assert_walks_equal(chains.walks(chains.score(ckpt, greedy, tmp / f"results-{head}"), "drafted"), runs)
    steps = [n for run in runs.values() for n in run.produced]
    finish = Counter(s.finish_reason for s in ShardSet(greedy).samples(tensors=[]))
    print(f"{head}: greedy tau {sum(steps) / len(steps):.3f} over {len(steps)} steps, finish {dict(finish)}")
    # non-trivial: both endings, several tokens a step, full blocks, blocks truncated at the budget
    assert finish["eos"] and finish["length"], finish
    assert sum(steps) / len(steps) > 1.5, steps
    assert BLOCK + 1 in steps, steps
    assert any(q < BLOCK for run in runs.values() for q in run.queries)

    threshold = _cutting_threshold(runs)
    cut_ckpt = _with_threshold(ckpt, tmp / f"ckpt-{head}-threshold", threshold)
    cut_runs = _online_walks(model, target, greedy, stop_ids, threshold=threshold)
    _assert_walks_equal(
        chains.walks(chains.score(cut_ckpt, greedy, tmp / f"results-{head}-threshold"), "drafted"), cut_runs
    )
    proposals = [(len(d), q) for run in cut_runs.values() for d, q in zip(run.drafts, run.queries)]
    cut = sum(n < q for n, q in proposals)
    print(f"{head}: threshold {threshold:.3f} cuts {cut} of {len(proposals)} proposals, {dict(Counter(proposals))}")
    assert 0 < cut < len(proposals), proposals
    assert (0, BLOCK) in proposals, proposals  # a whole block cut: the step verifies x_start alone
    assert any(run.produced != runs[sid].produced for sid, run in cut_runs.items())


# ---------------------------------------------------------------------------------------------
# the same weights in SpecForge's and DeepSpec's layouts


@pytest.mark.slow
@pytest.mark.parametrize("head", HEADS)
def test_specforge_and_deepspec_layouts_walk_as_speculators(setup, drafters, head):
    """The fitted weights written in DeepSpec's layout (with its own copies of the target's
    embedding and lm_head) and SpecForge's (tests/helpers/dspark_reference.py) walk exactly as
    the speculators checkpoint, step by step and draft by draft; also with a threshold."""
    tmp, _, _, target, greedy, stop_ids = setup
    model, ckpt = drafters[head]
    embed, lm_head = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    write_deepspec(tmp / f"deepspec-{head}", model, embed, lm_head)
    write_specforge(tmp / f"specforge-{head}", model)
    layouts = {
        "speculators": ckpt,
        "deepspec": str(tmp / f"deepspec-{head}"),
        "specforge": str(tmp / f"specforge-{head}"),
    }
    threshold = _cutting_threshold(_online_walks(model, target, greedy, stop_ids))
    for cut in (False, True):
        tables = {}
        for name, path in layouts.items():
            if cut:
                path = _with_threshold(path, tmp / f"{name}-{head}-threshold", threshold)
            results = chains.score(path, greedy, tmp / f"layouts-{head}-{name}-{cut}")
            tables[name] = chains.walk_table(results, "drafted")
        assert tables["speculators"].height > PROMPTS
        for name in ("deepspec", "specforge"):
            assert tables[name].equals(tables["speculators"]), (name, cut)
        if not cut:
            uncut = tables["speculators"]
    assert not tables["speculators"].equals(uncut)  # the threshold reached every layout


# ---------------------------------------------------------------------------------------------
# sampled, T = 0.7

SAMPLED_DRAWS = 64  # seeded online runs per prompt, each one's response extracted and scored


def _greedy_predecessors(drafts):
    """DSparkDrafter.drafts with the wrong predecessors: slot k's Markov head (and confidence
    head) fed the drafter's own greedy draft of slot k - 1 instead of the stored token before
    slot k's target (the anchor token stays the first), as an online loop that drafts greedily
    would; computed slot by slot, since slot k - 1's draft depends on its own predecessor."""

    def wrong(self, hidden, lm_head, previous, *args, **kwargs):
        previous = previous.clone()
        for k in range(1, previous.shape[1]):
            previous[:, k] = drafts(self, hidden, lm_head, previous, *args, **kwargs).logits[:, k - 1].argmax(dim=-1)
        return drafts(self, hidden, lm_head, previous, *args, **kwargs)

    return wrong


@pytest.mark.slow
def test_sampled_expected_tau_equals_the_online_tau_run_by_run(setup, drafters):
    """T 0.7, paired: SAMPLED_DRAWS seeded online runs per prompt, each run's own response extracted
    (its tokens given) and scored; the online tau minus the offline expected tau given those tokens
    has mean zero within 3 standard errors, per prompt and over every run. The wrong rule is the same
    replay re-run with DSparkDrafter.drafts patched to replace the stored predecessors it receives by
    the drafter's own greedy chain (`_greedy_predecessors`): far outside 3 standard errors."""
    tmp, model_dir, prompts, target, _, stop_ids = setup
    model, ckpt = drafters["vanilla"]

    def run(prompt):
        return online.online_dspark(model, target, prompt, MAX_NEW, stop_ids, TEMPERATURE)

    runs = chains.paired_runs(run, PROMPTS, SAMPLED_DRAWS)
    assert np.mean([tau for *_, tau in runs]) > 1.3  # several tokens a step: the test has something to measure
    wrong = (DSparkDrafter, "drafts", _greedy_predecessors(DSparkDrafter.drafts))
    options = dict(max_new=MAX_NEW, layer_ids=OUTPUT_IDS, temperature=TEMPERATURE)
    verdict = chains.paired_verdict(ckpt, model_dir, runs, tmp, wrong, "greedy predecessors", **options)
    assert all(abs(v) < 3 for v in verdict.z_prompts.values()) and abs(verdict.z) < 3, verdict
    assert abs(verdict.z_wrong) > 3, verdict
