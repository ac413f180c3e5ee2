"""Exactness end to end for the DFlash families beside z-lab DFlash v1: speculators DFlash (full and
reduced draft vocabulary) and DFlash2 (z-lab and speculators layouts), against the public references.

Each drafter is speculators' own model, fitted by its own training forward to a tiny target and
saved by its own save_pretrained (tests/helpers/family_fits.py); its z-lab twin holds the same
tensors beside a z-lab config. `specreplay score` reads the shards extracted from the target; the
reference is `dflash.model.dflash_generate` driving the z-lab twin (for DFlash2, z-lab's own
DFlash2DraftModel, which it drives through `propose`):

- greedy: walk.parquet's `produced` per sample equals dflash_generate's acceptance lengths, list
  for list, on a target whose responses some stop token ends early and others run to the budget;
- the layer-id conventions: one drafter saved in both layouts scores identically, and the
  speculators ids read as z-lab's (the mistake users report) lose almost every draft;
- a reduced draft vocabulary: dflash_generate with the twin's logits taken, as vLLM's
  compute_logits takes them, from the drafter's own lm_head rows mapped through d2t;
- sampled: the expected tau per prompt equals the mean over seeds of dflash_generate's tau within
  3 combined standard errors, and a plausible wrong rule for q lies beyond them.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import dflash.model as reference
import numpy as np
import polars as pl
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import scoring.score.steps as score_module
from pipeline.common.sampling import Sampling, token_logprob
from pipeline.extract.run import ExtractConfig, run_extract
from pipeline.shards import ShardSet
from proposers.dflash2.model import DFlash2Drafter
from scoring import results
from specreplay.cli import main
from tests.helpers import chain_parity as chains, family_fits as fits
from tests.helpers.models import seeded
from tests.helpers.prompts import write_prompts

pytestmark = pytest.mark.slow
# dflash_generate(return_stats=True) times itself with torch.cuda.synchronize; on CPU use a plain clock.
reference._cuda_time = time.perf_counter

MAX_NEW = 32
LAYERS = [1, 2, 3, 4]  # both conventions' ids of the drafters' features (z-lab 1, 3 = speculators 2, 4)
DFLASH = fits.Recipe("dflash", steps=100, anchors=96)
DFLASH2 = fits.Recipe("dflash2", steps=100, anchors=96)
DRAFT_VOCAB = 48  # of the target's 512: the most frequent response tokens, as speculators selects them
REDUCED = fits.Recipe("dflash", draft_vocab_size=DRAFT_VOCAB, steps=30, anchors=96)


def _prompt_ids(count: int, seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (6 + i % 4,), generator=gen).tolist() for i in range(count)]


def _extract(out, model_dir, prompts, max_new: int, sampling: Sampling | None = None, samples: int = 1, seed=11):
    options = {}
    if sampling is not None:
        options = dict(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            sample_top_k=sampling.top_k,
            num_samples=samples,
            seed=seed,
        )
    run_extract(
        ExtractConfig(
            model=model_dir,
            prompts=prompts,
            out=str(out),
            max_new_tokens=max_new,
            layer_ids=LAYERS,
            top_k=8,
            dtype="fp32",
            **options,
        )
    )
    return str(out)


def _sequences(shards: str) -> list[tuple[torch.Tensor, int]]:
    return [(s.input_ids.clone(), s.prompt_len) for s in ShardSet(shards).samples(tensors=[])]


def _walks(out_dir: str) -> dict[str, list[int]]:
    walk = pl.read_parquet(f"{out_dir}/walk.parquet").filter(pl.col("method") == "chain").sort("sample_id", "step")
    return {sid: g["produced"].to_list() for (sid,), g in walk.group_by("sample_id", maintain_order=True)}


def _chain_tau(out_dir: str) -> float:
    summary = pl.read_parquet(f"{out_dir}/summary.parquet")
    return summary.filter((pl.col("method") == "chain") & (pl.col("dataset") == results.ALL_DATASETS))["tau"].item()


def _stop_token(model_dir: str, prompts: list[list[int]]) -> int:
    """A token the target's greedy responses emit after a few steps in about half of them, so
    that some responses end at a stop token and others run to the budget."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    counts = Counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        counts.update(set(out[0, ids.shape[1] + 8 :].tolist()))
    token, _ = min(counts.items(), key=lambda kv: (abs(kv[1] - len(prompts) / 2), kv[0]))
    return int(token)


def _set_stop_token(model_dir: str, token: int) -> None:
    path = os.path.join(model_dir, "generation_config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "eos_token_id": token}, f)


def _reference_walks(draft, target, shards: str) -> dict[str, list[int]]:
    """dflash_generate's acceptance lengths per sample of the greedy shards, each run checked to
    emit the stored response (the shards are that target's)."""
    shardset = ShardSet(shards)
    stop_ids = shardset.settings["target"]["stop_token_ids"]
    walks = {}
    for sample in shardset.samples(tensors=[]):
        prompt = sample.input_ids[: sample.prompt_len][None]
        stats = reference.dflash_generate(draft, target, prompt, MAX_NEW, stop_ids, return_stats=True)
        assert stats.output_ids[0].tolist() == sample.input_ids.tolist(), sample.sample_id
        walks[sample.sample_id] = stats.acceptance_lengths
    return walks


# ---------------------------------------------------------------------------------------------
# greedy: a random target whose adjacent layers are unlike each other


@pytest.fixture(scope="module")
def greedy(tmp_path_factory):
    """(tmp, target dir, greedy shards, the target model, speculators sequences to fit on)."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("families_greedy")
    model_dir = fits.random_target(tmp / "target")
    prompts = _prompt_ids(8)
    _set_stop_token(model_dir, _stop_token(model_dir, prompts))
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(prompts)]
    shards = _extract(tmp / "shards", model_dir, write_prompts(tmp / "prompts.jsonl", records), MAX_NEW)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tmp, model_dir, shards, target, _sequences(shards)


@pytest.fixture(scope="module")
def dflash(greedy):
    """(speculators checkpoint, its z-lab twin, the twin's dflash_generate walks)."""
    tmp, model_dir, shards, target, sequences = greedy
    ckpt = fits.fitted(DFLASH, model_dir, sequences, tmp / "speculators-dflash")
    twin = fits.zlab_layout(ckpt, tmp / "zlab-dflash", num_target_layers=6)
    return ckpt, twin, _reference_walks(fits.load_zlab(twin), target, shards)


def test_speculators_dflash_walks_equal_dflash_generate_on_its_zlab_twin(greedy, dflash):
    tmp, model_dir, shards, target, sequences = greedy
    ckpt, twin, online = dflash
    assert json.load(open(f"{ckpt}/config.json"))["speculators_model_type"] == "dflash"
    walks = _walks(chains.score(ckpt, shards, tmp / "results-speculators-dflash"))
    assert walks == online
    steps = [n for lengths in online.values() for n in lengths]
    finish = Counter(s.finish_reason for s in ShardSet(shards).samples(tensors=[]))
    # non-trivial: both endings occur, several tokens per step, some full blocks
    assert finish["eos"] and finish["length"], finish
    assert sum(steps) / len(steps) > 1.5 and DFLASH.block_size in steps, steps


def test_layer_convention_both_layouts_agree_and_the_mislabelled_one_does_not(greedy, dflash):
    """The same weights saved as speculators (before-layer ids 2, 4) and as z-lab (output ids 1,
    3) score identically; the speculators ids read as z-lab's (features of layers 2, 4: one
    layer too deep) lose almost every draft."""
    tmp, model_dir, shards, target, sequences = greedy
    ckpt, twin, _ = dflash
    runs = {
        name: chains.score(path, shards, tmp / f"results-convention-{name}")
        for name, path in [("s", ckpt), ("z", twin)]
    }
    identity = [field.name for field in results.IDENTITY]
    frames = {name: pl.read_parquet(f"{out}/walk.parquet").drop(identity) for name, out in runs.items()}
    assert frames["s"].sort("sample_id", "method", "step").equals(frames["z"].sort("sample_id", "method", "step"))
    taus = {
        name: pl.read_parquet(f"{out}/summary.parquet").sort("dataset", "method")["tau"].to_list()
        for name, out in runs.items()
    }
    assert taus["s"] == taus["z"]

    mislabelled = fits.zlab_layout(ckpt, tmp / "zlab-mislabelled", num_target_layers=6, layer_ids=[2, 4])
    right, wrong = _chain_tau(runs["s"]), _chain_tau(chains.score(mislabelled, shards, tmp / "results-mislabelled"))
    print(f"chain tau: ids as saved {right:.3f}, speculators ids read as z-lab's {wrong:.3f}")
    assert right > 2.0 and wrong < 1.2, (right, wrong)

    # diagnose names the mis-export: the ids read in the other convention win, by a clear margin
    diagnosis = tmp / "diagnose-mislabelled"
    run = CliRunner().invoke(
        main, ["diagnose", "--ckpt", mislabelled, "--shards", shards, "--out", str(diagnosis), "--no-progress"]
    )
    assert run.exit_code == 0, run.output
    [record] = [json.load(open(path)) for path in diagnosis.glob("*/diagnose.json")]
    assert record["verdict"][0].startswith(f"tau {wrong:.2f} as configured"), record["verdict"]
    assert "with the feature layer ids read in the other convention" in record["verdict"][0], record["verdict"]
    assert "the same replay as layers-convention" in run.output  # layers-1 is not replayed twice


def _draft_vocab_logits(ckpt: str):
    """vLLM's compute_logits for a reduced draft vocabulary, written from its rule: the drafter's
    own lm_head rows give scores over the draft ids; draft id d is target id d + d2t[d]; every
    other target id is -inf."""
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    head, d2t = tensors["lm_head.weight"].float(), tensors["d2t"].long()
    ids = torch.arange(d2t.numel()) + d2t

    def compute_logits(hidden, output_head):
        full = torch.full((*hidden.shape[:-1], output_head.weight.shape[0]), float("-inf"))
        full[..., ids] = hidden.float() @ head.T
        return full

    return compute_logits


def test_reduced_draft_vocabulary_walks_equal_the_online_loop(greedy, dflash):
    tmp, model_dir, shards, target, sequences = greedy
    full_ckpt, _, _ = dflash
    # speculators fits the reduced head's drafter from scratch too; a warm start from the full one's
    # body keeps this short (its head is the target's rows t2d, frozen, as speculators loads it)
    ckpt = fits.fitted(REDUCED, model_dir, sequences, tmp / "speculators-reduced", start_from=full_ckpt)
    saved = json.load(open(f"{ckpt}/config.json"))
    assert saved["draft_vocab_size"] == DRAFT_VOCAB < saved["transformer_layer_config"]["vocab_size"]
    draft = fits.load_zlab(fits.zlab_layout(ckpt, tmp / "zlab-reduced", num_target_layers=6))
    restricted = _draft_vocab_logits(ckpt)
    differs = []

    def compute_logits(hidden, output_head):
        logits = restricted(hidden, output_head)
        differs.append(int((logits.argmax(-1) != output_head(hidden).argmax(-1)).sum()))
        return logits

    draft.compute_logits = compute_logits
    online = _reference_walks(draft, target, shards)
    assert _walks(chains.score(ckpt, shards, tmp / "results-reduced")) == online
    steps = [n for lengths in online.values() for n in lengths]
    # the draft vocabulary binds (some drafts are not the full vocabulary's argmax) and blocks still accept
    assert sum(differs) > 0 and sum(steps) / len(steps) > 1.5, (sum(differs), steps)


@pytest.fixture(scope="module")
def dflash2(greedy):
    """(speculators checkpoint, its z-lab twin, z-lab's dflash_generate walks, how many drafts the
    selector took from another candidate than the unary argmax)."""
    tmp, model_dir, shards, target, sequences = greedy
    ckpt = fits.fitted(DFLASH2, model_dir, sequences, tmp / "speculators-dflash2")
    twin = fits.zlab_layout(ckpt, tmp / "zlab-dflash2", num_target_layers=6)
    draft = fits.load_zlab(twin)
    assert isinstance(draft, reference.DFlash2DraftModel)
    propose, overturned = draft.propose, []

    def counting_propose(hidden, anchor_ids, output_head, temperature):
        tokens, candidates, q = propose(hidden, anchor_ids, output_head, temperature)
        overturned.append(int((tokens != draft.compute_logits(hidden, output_head).argmax(-1)).sum()))
        return tokens, candidates, q

    draft.propose = counting_propose
    return ckpt, twin, _reference_walks(draft, target, shards), sum(overturned)


@pytest.mark.parametrize("layout", ["speculators", "z-lab"])
def test_dflash2_walks_equal_dflash_generate(greedy, dflash2, layout):
    tmp, model_dir, shards, target, sequences = greedy
    ckpt, twin, online, overturned = dflash2
    path = ckpt if layout == "speculators" else twin
    saved = json.load(open(f"{path}/config.json"))
    assert saved["architectures"] == ["DFlash2DraftModel"] and ("speculators_model_type" in saved) == (
        layout == "speculators"
    )
    assert _walks(chains.score(path, shards, tmp / f"results-dflash2-{layout}")) == online
    steps = [n for lengths in online.values() for n in lengths]
    assert overturned > 0 and sum(steps) / len(steps) > 1.5, (overturned, steps)


# ---------------------------------------------------------------------------------------------
# sampled: a Markov target with three successors per token

SAMPLED_NEW = 20
PROMPTS = 5
RUNS = 40  # responses per prompt: extracted offline, and seeded dflash_generate runs online
SAMPLED = {
    # drafter without top-k: where top-k 2 cuts the drafter's third successor
    "dflash": (fits.Recipe("dflash", steps=60, anchors=64), Sampling(0.7, 1.0, 2)),
    # z-lab's DFlash2 q is softmax(S / T) over the candidates: temperature alone, so top-p 1, top-k 0;
    # its selector learns at a tenth of the rate (family_fits.Recipe.selector_lr_scale)
    "dflash2": (fits.Recipe("dflash2", steps=60, anchors=64, selector_lr_scale=0.1), Sampling(0.6, 1.0, 0)),
}


@pytest.fixture(scope="module")
def markov(tmp_path_factory):
    """(tmp, target dir, prompts file, the target model, sampled sequences to fit on)."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("families_sampled")
    model_dir = fits.markov_target(tmp / "target")
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(_prompt_ids(8))]
    train = _extract(
        tmp / "train", model_dir, write_prompts(tmp / "train.jsonl", records), SAMPLED_NEW, Sampling(0.7), 8, seed=99
    )
    prompts = write_prompts(tmp / "prompts.jsonl", records[:PROMPTS])
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tmp, model_dir, prompts, target, _sequences(train)


def _online_taus(draft, target, sampling: Sampling, stop_ids) -> dict[str, list[float]]:
    """Per prompt, the tau of RUNS seeded dflash_generate runs at `sampling`."""
    out = {}
    for i, prompt in enumerate(_prompt_ids(PROMPTS)):
        taus = []
        for run in range(RUNS):
            with seeded(1000 * run + i):
                stats = reference.dflash_generate(
                    draft,
                    target,
                    torch.tensor([prompt]),
                    SAMPLED_NEW,
                    stop_ids,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,
                    return_stats=True,
                )
            lengths = stats.acceptance_lengths
            if lengths:  # a response whose first token is a stop token has no step
                taus.append(sum(lengths) / len(lengths))
        out[f"p{i}"] = taus
    return out


def _z(offline, online) -> tuple[float, str]:
    (m_off, se_off), (m_on, se_on) = chains.mean_se(offline), chains.mean_se(online)
    z = (m_off - m_on) / np.hypot(se_off, se_on)
    return z, f"offline {m_off:.4f} ± {se_off:.4f}, online {m_on:.4f} ± {se_on:.4f}, z {z:+.2f}"


@pytest.fixture(scope="module", params=list(SAMPLED))
def sampled(request, markov):
    """(family, its sampling, speculators checkpoint, sampled shards, online taus per prompt)."""
    tmp, model_dir, prompts, target, sequences = markov
    family = request.param
    recipe, sampling = SAMPLED[family]
    ckpt = fits.fitted(recipe, model_dir, sequences, tmp / f"speculators-{family}")
    shards = _extract(tmp / f"sampled-{family}", model_dir, prompts, SAMPLED_NEW, sampling, RUNS)
    draft = fits.load_zlab(fits.zlab_layout(ckpt, tmp / f"zlab-{family}", num_target_layers=6))
    stop_ids = ShardSet(shards).settings["target"]["stop_token_ids"]
    return family, sampling, ckpt, shards, _online_taus(draft, target, sampling, stop_ids)


def test_sampled_expected_tau_equals_the_reference_mean_over_seeds(sampled, tmp_path):
    family, sampling, ckpt, shards, online = sampled
    offline = chains.offline_taus(chains.score(ckpt, shards, tmp_path / "results"))
    assert sorted(offline) == sorted(online) and all(len(v) == RUNS for v in offline.values())
    for prompt in sorted(online):
        z, line = _z(offline[prompt], online[prompt])
        print(f"{family} {sampling.describe()} {prompt}: {line}")
        assert abs(z) < 3.5, line  # 3 standard errors, Bonferroni over PROMPTS prompts
    pooled = [t for v in online.values() for t in v]
    z, line = _z([t for v in offline.values() for t in v], pooled)
    print(f"{family} {sampling.describe()} all prompts: {line}")
    assert chains.mean_se(pooled)[0] > 1.5, line  # several tokens per step: there is something to measure
    assert abs(z) < 3, line


def _wrong_rule(family: str, sampling: Sampling):
    """(what it is, module or class, attribute, replacement) of the plausible wrong q of `family`."""
    if family == "dflash":
        drafter_sampling = Sampling(sampling.temperature, sampling.top_p, 0)
        return "q without top-k", score_module, "sampling_of", lambda settings: drafter_sampling
    # vLLM's rejection sampler: the realized scores S softmaxed without the temperature
    return (
        "q = softmax(S)",
        DFlash2Drafter,
        "draft_logprob",
        lambda self, logits, tokens, _: token_logprob(logits, tokens, Sampling(temperature=1.0)),
    )


def test_sampled_wrong_rule_is_rejected(sampled, tmp_path, monkeypatch):
    """The same statistic, with the drafter's q computed by a plausible wrong rule in the replay,
    falls beyond 3 combined standard errors of the reference's mean."""
    family, sampling, ckpt, shards, online = sampled
    name, owner, attribute, replacement = _wrong_rule(family, sampling)
    monkeypatch.setattr(owner, attribute, replacement)
    offline = chains.offline_taus(chains.score(ckpt, shards, tmp_path / "results-wrong"))
    z, line = _z([t for v in offline.values() for t in v], [t for v in online.values() for t in v])
    print(f"{family} {sampling.describe()} {name}: {line}")
    assert abs(z) > 3, line


# ---------------------------------------------------------------------------------------------
# block attention z-lab's dflash 0.1.0 reads: is_causal (every layer's block causal, a JetSpec-style
# causal block) and layer_types' sliding layers with sliding_window, windowed both ways inside the
# block when is_causal is false (dflash/model.py:157-170, 363-367)

ZLAB_ATTENTION = {  # name -> (fields set on the twin, the plausible wrong reading)
    "causal": ({"is_causal": True}, {"is_causal": False}),
    "window": ({"sliding_window": 12, "use_sliding_window": True, "is_causal": False}, {"sliding_window": 13}),
}


def _with_fields(source: str, out, fields: dict) -> str:
    """A copy of the z-lab checkpoint at `source` with top-level `fields` set (a window on every layer)."""
    config = json.load(open(f"{source}/config.json"))
    if "sliding_window" in fields:
        config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    os.makedirs(out)
    os.link(f"{source}/model.safetensors", f"{out}/model.safetensors")
    json.dump(config | fields, open(f"{out}/config.json", "w"))
    return str(out)


@pytest.mark.parametrize("name", list(ZLAB_ATTENTION))
def test_zlab_block_attention_walks_equal_dflash_generate(greedy, dflash, name):
    tmp, model_dir, shards, target, _ = greedy
    fields, wrong = ZLAB_ATTENTION[name]
    path = _with_fields(dflash[1], tmp / f"zlab-{name}", fields)
    online = _reference_walks(fits.load_zlab(path), target, shards)
    assert _walks(chains.score(path, shards, tmp / f"results-{name}")) == online
    misread = _walks(chains.score(_with_fields(path, tmp / f"zlab-{name}-wrong", wrong), shards, tmp / f"wrong-{name}"))
    steps = [n for lengths in online.values() for n in lengths]
    differing = sum(misread[sid] != walk for sid, walk in online.items())
    print(
        f"{name}: {sum(steps) / len(steps):.2f} tokens a step; {wrong} differs on {differing} of {len(online)} samples"
    )
    assert sum(steps) / len(steps) > 1.3 and differing > 0
