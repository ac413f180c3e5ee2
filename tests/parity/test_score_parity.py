"""Exactness: offline replay reports what an online speculative-decoding run reports.

Chain walks are compared with the public reference `dflash.model.dflash_generate` (PyPI
dflash 0.1.0); DDTree walks and hybrid / vision-language targets with an online loop that
recomputes the target from scratch (tests/helpers/online_reference.py). Drafters are first fitted to
the tiny target on the extracted shards so that most steps accept several tokens and some a
full block: a replay that got positions, masks or the tail wrong could not pass by luck.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import dflash.model as reference
import polars as pl
import pytest
import torch

from pipeline.extract.run import ExtractConfig, run_extract
from pipeline.shards import ShardSet
from scoring.config import ScoreConfig
from scoring.score.run import run_score
from tests.helpers.drafters import fitted_drafters
from tests.helpers.models import build_tiny_qwen3, build_tiny_qwen35_hybrid, build_tiny_qwen35_vlm
from tests.helpers.online_reference import online_generate
from tests.helpers.prompts import write_prompts

# dflash_generate(return_stats=True) times itself with torch.cuda.synchronize; on CPU use a plain clock.
reference._cuda_time = time.perf_counter

MAX_NEW_TOKENS = 40


def _token_prompts(path, count: int, seed: int, vocab: int = 400) -> str:
    """A prompts file of random token-id prompts, 6 to 10 tokens, no special tokens (ids 0-2)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [6 + i % 5 for i in range(count)]
    return write_prompts(
        path,
        [
            {"id": f"p{i}", "input_ids": torch.randint(3, vocab, (n,), generator=gen).tolist()}
            for i, n in enumerate(lengths)
        ],
    )


def _choose_stop_token(model_dir: str, prompts_path: str, auto_class) -> int:
    """A token the target emits mid-response in some prompts, so that some responses end at a
    stop token and others run into the max_new_tokens budget."""
    model = auto_class.from_pretrained(model_dir).eval()
    counts = Counter()
    with open(prompts_path) as f:
        for line in f:
            ids = torch.tensor(json.loads(line)["input_ids"])[None]
            out = model.generate(
                ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, ids.shape[1] :]
            counts.update(set(out[8:].tolist()))  # tokens that appear after a few steps
    # the token present in about half of the responses
    n = sum(1 for _ in open(prompts_path))
    token, _ = min(counts.items(), key=lambda kv: (abs(kv[1] - n / 2), kv[0]))
    return int(token)


def _set_stop_token(model_dir: str, token: int) -> None:
    path = f"{model_dir}/generation_config.json"
    with open(path) as f:
        config = json.load(f)
    config["eos_token_id"] = token
    with open(path, "w") as f:
        json.dump(config, f)


def _extract(tmp, model_dir, prompts, layer_ids):
    out = str(tmp / "shards")
    run_extract(
        ExtractConfig(
            model=model_dir,
            prompts=prompts,
            out=out,
            max_new_tokens=MAX_NEW_TOKENS,
            layer_ids=layer_ids,
            top_k=8,
            dtype="fp32",
            batch_size=4,
        )
    )
    return out


def _fit(shards: str, out_dir: str, block_size: int, layer_ids=None, layer_types=None, steps: int = 400) -> str:
    return fitted_drafters(
        shards,
        out_dir,
        block_size=block_size,
        layer_ids=layer_ids,
        layer_types=layer_types,
        sliding_window=4 if layer_types else None,
        steps=steps,
        lr=5e-3,
        anchors_per_step=24,
    )[-1]


def _score(ckpt: str, shards: str, out: str, budgets=(4, 16)) -> pl.DataFrame:
    [outcome] = run_score(ScoreConfig(ckpts=[ckpt], shards=shards, out=out, tree_nodes=list(budgets)))
    assert outcome.status == "scored", outcome.error
    return pl.read_parquet(f"{outcome.out_dir}/walk.parquet", glob=False)


def _walk_lists(walk: pl.DataFrame, method: str) -> dict[str, list[int]]:
    rows = walk.filter(pl.col("method") == method).sort("sample_id", "step")
    return {sid: group["produced"].to_list() for (sid,), group in rows.group_by("sample_id", maintain_order=True)}


@pytest.fixture(scope="module")
def qwen3_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity_qwen3")
    model_dir = build_tiny_qwen3(tmp / "target", num_layers=6, seed=3)
    prompts = _token_prompts(tmp / "prompts.jsonl", count=8, seed=0)
    from transformers import AutoModelForCausalLM

    _set_stop_token(model_dir, _choose_stop_token(model_dir, prompts, AutoModelForCausalLM))
    # all six layers stored: every drafter below picks (and orders) its own subset
    shards = _extract(tmp, model_dir, prompts, layer_ids=[0, 1, 2, 3, 4, 5])
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tmp, model_dir, shards, target


DRAFTERS = [
    # (block size, explicit layer ids or None for the DFlash formula, layer_types)
    pytest.param(4, [1, 3, 4], None, id="block4-explicit-ids"),
    pytest.param(8, None, ["sliding_attention", "full_attention"], id="block8-formula-ids-sliding"),
    pytest.param(16, [4, 1], None, id="block16-explicit-reordered"),
    pytest.param(16, None, ["full_attention", "sliding_attention"], id="block16-sliding"),
]


# Slow: fits of up to 800 steps, then the reference's generate loop; 3-10 min each (measured on 2 shared cores).
@pytest.mark.slow
@pytest.mark.parametrize("block_size,layer_ids,layer_types", DRAFTERS)
def test_chain_walk_equals_dflash_generate(qwen3_setup, block_size, layer_ids, layer_types):
    tmp, model_dir, shards, target = qwen3_setup
    name = f"b{block_size}-{layer_ids}-{layer_types}".translate(str.maketrans("", "", " []',"))
    # longer blocks need a better fit before full blocks get accepted
    ckpt = _fit(shards, str(tmp / f"ckpt-{name}"), block_size, layer_ids, layer_types, steps=max(400, 50 * block_size))
    walk = _walk_lists(_score(ckpt, shards, str(tmp / f"results-{name}"), budgets=()), "chain")

    draft = reference.DFlashDraftModel.from_pretrained(ckpt, dtype=torch.float32).eval()
    shardset = ShardSet(shards)
    stop_ids = shardset.settings["target"]["stop_token_ids"]
    all_steps, finish = [], Counter()
    for sample in shardset.samples(tensors=[]):
        prompt = sample.input_ids[: sample.prompt_len][None]
        stats = reference.dflash_generate(draft, target, prompt, MAX_NEW_TOKENS, stop_ids, return_stats=True)
        assert stats.output_ids[0].tolist() == sample.input_ids.tolist(), sample.sample_id
        assert walk.get(sample.sample_id, []) == stats.acceptance_lengths, sample.sample_id
        all_steps += stats.acceptance_lengths
        finish[sample.finish_reason] += 1
    # non-trivial: both endings occur, several tokens per step on average, some full blocks
    assert finish["eos"] and finish["length"], finish
    assert sum(all_steps) / len(all_steps) > 2.0, all_steps
    assert block_size in all_steps, all_steps


def test_ddtree_walk_equals_online_tree_verification(qwen3_setup):
    tmp, model_dir, shards, target = qwen3_setup
    ckpt = _fit(shards, str(tmp / "ckpt-tree"), 8, [1, 3, 4], None, steps=250)
    budgets = (3, 8)
    walk = _score(ckpt, shards, str(tmp / "results-tree"), budgets=budgets)
    draft = reference.DFlashDraftModel.from_pretrained(ckpt, dtype=torch.float32).eval()
    embed, lm_head = target.get_input_embeddings().weight, target.lm_head.weight
    shardset = ShardSet(shards)
    stop_ids = shardset.settings["target"]["stop_token_ids"]
    samples = list(shardset.samples(tensors=[]))[:3]
    differs_from_chain = False
    for budget in budgets:
        lists = _walk_lists(walk, f"ddtree-{budget}")
        chain = _walk_lists(walk, "chain")
        for sample in samples:
            prompt = sample.input_ids[: sample.prompt_len]
            output, produced = online_generate(
                draft, target, embed, lm_head, prompt, MAX_NEW_TOKENS, stop_ids, tree_budget=budget
            )
            assert output.tolist() == sample.input_ids.tolist()
            assert lists.get(sample.sample_id, []) == produced, (budget, sample.sample_id)
            differs_from_chain |= produced != chain.get(sample.sample_id, [])
    assert differs_from_chain, "trees of these budgets should walk differently from the chain somewhere"


@pytest.mark.parametrize("builder", [build_tiny_qwen35_hybrid, build_tiny_qwen35_vlm], ids=["hybrid", "vlm"])
def test_hybrid_and_vlm_targets_match_online_loop_from_scratch(tmp_path, builder):
    model_dir = builder(tmp_path / "target", num_layers=4, seed=1)
    prompts = _token_prompts(tmp_path / "prompts.jsonl", count=3, seed=1)
    shards = _extract(tmp_path, model_dir, prompts, layer_ids=[1, 2])
    ckpt = _fit(shards, str(tmp_path / "ckpt"), 4, [1, 2], None, steps=250)
    walk_table = _score(ckpt, shards, str(tmp_path / "results"), budgets=())
    walk = _walk_lists(walk_table, "chain")
    blocks = {
        sid: group.sort("step")["draft_tokens"].to_list()
        for (sid,), group in walk_table.filter(pl.col("method") == "chain").group_by("sample_id")
    }

    from pipeline.extract.target import load_target

    target, _, info = load_target(model_dir, dtype="fp32")
    draft = reference.DFlashDraftModel.from_pretrained(ckpt, dtype=torch.float32).eval()
    embed, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    steps = []
    for sample in ShardSet(shards).samples(tensors=[]):
        prompt = sample.input_ids[: sample.prompt_len]
        drafts = []
        output, produced = online_generate(
            draft, target, embed, lm_head, prompt, MAX_NEW_TOKENS, info.stop_token_ids, drafts=drafts
        )
        assert output.tolist() == sample.input_ids.tolist()
        assert walk.get(sample.sample_id, []) == produced, sample.sample_id
        # walk.parquet keeps each chain step's draft block: the online loop's drafts, step by step
        assert blocks.get(sample.sample_id, []) == drafts, sample.sample_id
        steps += produced
    assert max(steps) > 1, steps


def test_walk_only_mode_gives_the_same_walks_with_fewer_anchors(qwen3_setup):
    tmp, model_dir, shards, target = qwen3_setup
    ckpt = _fit(shards, str(tmp / "ckpt-walkmode"), 8, None, ["sliding_attention", "full_attention"], steps=300)
    runs = {}
    for mode in ("all", "walk"):
        out = str(tmp / f"results-walkmode-{mode}")
        # a small group size packs a few samples per round, so rounds mix samples
        [outcome] = run_score(
            ScoreConfig(
                ckpts=[ckpt],
                shards=shards,
                out=out,
                tree_nodes=[4, 16],
                anchors=mode,
                walk_group_tokens=120,
            )
        )
        runs[mode] = (pl.read_parquet(f"{outcome.out_dir}/walk.parquet", glob=False), outcome.record)
    all_walk, all_run = runs["all"]
    walk_walk, walk_run = runs["walk"]
    assert all_walk.equals(walk_walk)
    assert walk_run["anchors"] < all_run["anchors"]
    chain_steps = all_walk.filter(pl.col("method") == "chain").height
    assert walk_run["anchors"] >= chain_steps
