"""vLLM's n-gram proposer (proposers/ngram/): its lookup rule on hand-built token sequences, each case
written from vLLM's v1/spec_decode/ngram_proposer.py rule and chosen so that a plausible wrong rule
fails it (the later occurrence, an uncapped match length, no minimum, drafts past the tokens seen);
its config refused by name where vLLM would refuse or ignore it; and the whole path a proposer
without hidden states takes: shards extracted with `--layer-ids none`, `score --ckpt ngram.json`, and
walks equal to an online loop in which the tiny target itself verifies the proposer's drafts."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch
from click.testing import CliRunner

from pipeline.common.errors import UserError
from proposers.detect import parse_config
from proposers.ngram.llama_simple import simple_drafts
from proposers.ngram.occurrences import occurrences
from proposers.ngram.proposer import lookup_drafts
from proposers.toolkit.config import DrafterConfigError
from specreplay.cli import main
from tests.helpers import chain_parity as parity
from tests.helpers.prompts import write_prompts


def drafts(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The proposer's drafts after `tokens` (the anchor is the last of them)."""
    ids = np.array(tokens, dtype=np.int64)
    out, counts = np.full((1, k), -1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    chains = occurrences(ids, np.array([len(ids)]))
    lookup_drafts(
        ids, np.array([0]), np.array([len(tokens) - 1]), min_n, max_n, k, out, counts, chains.first, chains.nxt
    )
    return out[0, : counts[0]].tolist()


# (tokens, min_n, max_n, k, expected, what a wrong rule would give instead)
CASES = {
    # suffix [7, 8]: [7, 8] occurs at 0 and at 4 (followed by 9 and 5); the earliest wins
    "earliest occurrence wins a tie": ([7, 8, 9, 1, 7, 8, 5, 2, 7, 8], 1, 3, 2, [9, 1], "later: [5, 2]"),
    # suffix [3, 7, 8]: [7, 8] at 0 is only 2 long, [3, 7, 8] at 5 is 3 long: the longer wins
    "the longest match wins": ([7, 8, 9, 1, 2, 3, 7, 8, 4, 0, 3, 7, 8], 1, 3, 2, [4, 0], "earliest: [9, 1]"),
    # capped at max_n 2: both occurrences match 2 tokens, so the earliest wins though the later one is longer
    "match lengths are capped at max_n": ([6, 7, 8, 9, 1, 3, 7, 8, 4, 0, 3, 7, 8], 1, 2, 2, [9, 1], "uncapped: [4, 0]"),
    # the only match is 1 token long: below min_n 2, nothing is proposed
    "shorter than min_n proposes nothing": ([5, 9, 1, 2, 9], 2, 3, 3, [], "no minimum: [1, 2, 9]"),
    # [1, 1] matches overlapping the suffix itself; the drafts stop at the last token seen
    "drafts stop at the tokens seen": ([4, 1, 1, 1], 1, 3, 4, [1], "past the end: [1, ?, ...]"),
    "no earlier occurrence proposes nothing": ([1, 2, 3, 4], 1, 3, 3, [], "any: [...]"),
    "fewer tokens than min_n propose nothing": ([2], 2, 3, 3, [], "-"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_the_lookup_is_vllms_rule(case):
    tokens, min_n, max_n, k, expected, _ = CASES[case]
    assert drafts(tokens, min_n, max_n, k) == expected


def test_a_batch_of_anchors_looks_up_each_one_in_its_own_sample():
    a, b = CASES["earliest occurrence wins a tie"][0], CASES["the longest match wins"][0]
    ids = np.array(a + b, dtype=np.int64)
    starts, anchors = np.array([0, len(a), len(a)]), np.array([len(a) - 1, len(b) - 1, 1])
    out, counts = np.full((3, 2), -1, dtype=np.int64), np.zeros(3, dtype=np.int64)
    chains = occurrences(ids, np.array([len(a), len(b)]))
    lookup_drafts(ids, starts, anchors, 1, 3, 2, out, counts, chains.first, chains.nxt)
    assert [out[i, : counts[i]].tolist() for i in range(3)] == [[9, 1], [4, 0], []]  # b[:2] = [7, 8]: no repeat


def vllm_scan(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's rule as its docstring states it, every earlier end scanned: the longest match of the
    suffix (capped at max_n) ending at an earlier position, the earliest on ties, at least min_n."""
    t, best, best_end = len(tokens) - 1, 0, -1
    for e in range(t):
        length = 0
        while length < max_n and length <= e and tokens[e - length] == tokens[t - length]:
            length += 1
        if length > best:
            best, best_end = length, e
    return [] if best < min_n else tokens[best_end + 1 : best_end + 1 + k]


def llama_simple_scan(tokens: list[int], n: int, m: int) -> list[int]:
    """common_ngram_simple_draft (common/ngram-map.cpp:49-112) line by line: H = tokens[:-1], the last
    token apart; the latest start j in L-n-1 .. 1 whose n tokens are the pattern."""
    history, last = tokens[:-1], tokens[-1]
    size = len(history)
    if size <= n + m + 1:
        return []
    pattern = history[size - n + 1 :] + [last]
    match = next((j for j in range(size - n - 1, 0, -1) if history[j : j + n] == pattern), 0)
    if match == 0:
        return []
    count = min(m, size - (match + n))
    return [] if count < n else history[match + n : match + n + count]


@pytest.mark.parametrize("vocab", [2, 5, 40])
def test_the_occurrence_chains_find_what_a_scan_of_every_position_finds(vocab):
    """The lookups walk the earlier occurrences of the last token (proposers/ngram/occurrences.py);
    on random streams over small vocabularies (long runs, many ties) every anchor's drafts equal the
    scan of every earlier position, for both rules, samples laid end to end."""
    rng = np.random.default_rng(vocab)
    samples = [rng.integers(0, vocab, size).tolist() for size in (1, 7, 60, 200)]
    ids = np.array([t for s in samples for t in s], dtype=np.int64)
    lengths = np.array([len(s) for s in samples])
    chains = occurrences(ids, lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    sample_of = np.repeat(np.arange(len(samples)), lengths)
    anchors = np.concatenate([np.arange(n) for n in lengths])
    for min_n, max_n, k in ((1, 1, 3), (1, 3, 4), (2, 4, 5), (3, 3, 2)):
        out, counts = np.full((len(ids), k), -1, dtype=np.int64), np.zeros(len(ids), dtype=np.int64)
        lookup_drafts(ids, starts[sample_of], anchors, min_n, max_n, k, out, counts, chains.first, chains.nxt)
        for i, (s, t) in enumerate(zip(sample_of, anchors)):
            assert out[i, : counts[i]].tolist() == vllm_scan(samples[s][: t + 1], min_n, max_n, k), (s, t)
    for n, m in ((1, 1), (1, 4), (2, 3), (3, 8)):
        out, counts = np.full((len(ids), m), -1, dtype=np.int64), np.zeros(len(ids), dtype=np.int64)
        simple_drafts(ids, starts[sample_of], anchors, n, m, out, counts, chains.prev)
        for i, (s, t) in enumerate(zip(sample_of, anchors)):
            assert out[i, : counts[i]].tolist() == llama_simple_scan(samples[s][: t + 1], n, m), (s, t, n, m)


# --------------------------------------------------------------------------------------------- config


def test_config_resolves_vllms_defaults():
    def lookup(**fields) -> tuple[int, int, int]:
        config = parse_config({"method": "ngram", "num_speculative_tokens": 4, **fields}, "ngram.json").config
        return config.min_n, config.max_n, config.block_size

    assert lookup() == (5, 5, 4)  # vLLM: both 5 when neither is given
    assert lookup(prompt_lookup_max=3) == (3, 3, 4) and lookup(prompt_lookup_min=2) == (2, 2, 4)
    assert lookup(prompt_lookup_min=1, prompt_lookup_max=4) == (1, 4, 4)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min 4 exceeds prompt_lookup_max 2"),
        ({"prompt_lookup_max": 3, "max_model_len": 100}, "unknown field 'max_model_len'"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ],
)
def test_a_config_vllm_would_not_run_as_given_is_refused_by_name(fields, message):
    with pytest.raises(DrafterConfigError, match=message) as error:
        parse_config({"method": "ngram", "num_speculative_tokens": 4, **fields}, "ngram.json")
    assert str(error.value).startswith("ngram.json: ") and "\n" not in str(error.value)


# --------------------------------------------------------------------------------------------- end to end

MAX_NEW, K = 48, 3
LOOKUP = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def cycling_target(model_dir: str, out) -> str:
    """The tiny target with its layers' outputs zeroed and its lm_head row perm[x] set to the final
    norm of x's embedding: its greedy next token is perm[x] of the current token x, and perm is made
    of short cycles (lengths 5 to 9), so a response repeats itself and the lookup finds matches; the
    random tiny target's responses rarely do, which exercises the rejections."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.models import IM_END_ID, save_target

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab, order = (
        model.config.vocab_size,
        torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(3)),
    )
    order = order[order != IM_END_ID]  # the stop token stays out of the cycles: the budget ends the responses
    perm, begin, lengths = torch.arange(vocab), 0, [5, 6, 7, 8, 9]
    while begin < order.numel():
        cycle = order[begin : begin + lengths[begin % 5]]
        perm[cycle] = cycle.roll(-1)
        begin += cycle.numel()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight[perm] = model.model.norm(model.model.embed_tokens.weight)
    return save_target(model, out)


@pytest.fixture(scope="module", params=["random", "cycling"])
def scored(request, tiny_qwen3_dir, tmp_path_factory):
    """(the target, shards without feature layers, the n-gram results directory), for the random tiny
    target and for its cycling twin."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp(f"ngram_{request.param}")
    model_dir = tiny_qwen3_dir if request.param == "random" else cycling_target(tiny_qwen3_dir, tmp / "target")
    prompts = [ids + ids[:4] for ids in parity.prompt_ids(4)]  # a repeat in the prompt: a first match
    path = write_prompts(tmp / "prompts.jsonl", [{"id": f"p{i}", "input_ids": p} for i, p in enumerate(prompts)])
    shards = parity.extract(tmp / "shards", model_dir, path, MAX_NEW, [])
    config = tmp / "ngram.json"
    config.write_text(json.dumps(LOOKUP))
    run = CliRunner().invoke(main, ["score", "--ckpt", str(config), "--shards", shards, "--out", str(tmp / "out")])
    assert run.exit_code == 0, run.output
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return request.param, target, shards, tmp / "out" / f"{tmp.name}_ngram"


@torch.no_grad()
def online_walk(target, prompt: list[int], max_new: int, stop_ids: list[int]) -> tuple[list[int], list[int]]:
    """(the response, tokens produced per step) of the online loop vLLM runs: the proposer's drafts
    after the tokens so far, verified by the target's own greedy forward; each step appends the
    accepted drafts and the target's token, cut after a stop token or at max_new tokens."""
    ids = list(prompt) + [int(target(torch.tensor([prompt])).logits[0, -1].argmax())]  # prefill
    produced = []
    while len(ids) - len(prompt) < max_new and ids[-1] not in stop_ids:
        proposal = drafts(ids, LOOKUP["prompt_lookup_min"], LOOKUP["prompt_lookup_max"], K)
        greedy = target(torch.tensor([ids + proposal])).logits[0, len(ids) - 1 :].argmax(-1).tolist()
        n = next((j for j, (d, g) in enumerate(zip(proposal, greedy)) if d != g), len(proposal))
        step = (proposal[:n] + [greedy[n]])[: max_new - (len(ids) - len(prompt))]
        step = step[: next((i + 1 for i, t in enumerate(step) if t in stop_ids), len(step))]
        ids += step
        produced.append(len(step))
    return ids[len(prompt) :], produced


@pytest.mark.slow
def test_walks_on_shards_without_features_equal_the_online_loop(scored):
    from pipeline.shards import ShardSet

    kind, target, shards, results = scored
    walk = pl.read_parquet(results / "walk.parquet")
    assert set(walk["method"]) == {"chain"}  # no distribution: no DDTree
    shardset = ShardSet(shards)
    stop_ids = shardset.settings["target"]["stop_token_ids"]
    samples = list(shardset.samples(tensors=[]))
    for sample in samples:
        prompt = sample.input_ids[: sample.prompt_len].tolist()
        response, produced = online_walk(target, prompt, MAX_NEW, stop_ids)
        assert response == sample.input_ids[sample.prompt_len :].tolist(), sample.sample_id
        offline = walk.filter(pl.col("sample_id") == sample.sample_id).sort("step")
        assert offline["produced"].to_list() == produced, sample.sample_id
    accepted = walk["accepted_len"].to_list()
    print(
        f"n-gram walks equal ({kind} target): {len(samples)} samples, {len(accepted)} steps, {sum(accepted)} accepted"
    )
    assert len(samples) == 4 and 0 in accepted, accepted  # rejections, and (cycling) whole chains accepted
    assert sum(accepted) >= 3 and (kind == "random" or K in accepted), accepted


def test_diagnose_refuses_a_proposer_without_weights_in_one_line(tmp_path):
    """diagnose replays a trained drafter under each training convention: an n-gram config has
    none, so it is one error line pointing to score, before any shards are read, nothing written."""
    config = tmp_path / "ngram.json"
    config.write_text(json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
    (tmp_path / "shards").mkdir()
    out = tmp_path / "out"
    run = CliRunner().invoke(
        main, ["diagnose", "--ckpt", str(config), "--shards", str(tmp_path / "shards"), "--out", str(out)]
    )
    assert run.exit_code == 2, run.output
    lines = run.output.strip().splitlines()
    assert len(lines) == 1 and "no training convention to diagnose" in lines[0] and " score --ckpt " in lines[0]
    assert not out.exists()


# --------------------------------------------------------------------------------------------- llama.cpp

LLAMA_SIMPLE = {"spec-type": "ngram-simple"}


def test_llama_ngram_simple_config_takes_the_servers_flags_and_defaults():
    def sizes(**fields) -> tuple:
        config = parse_config({**LLAMA_SIMPLE, **fields}, "simple.json").config
        return config.layout, config.rule, config.min_n, config.max_n, config.block_size

    assert sizes() == ("llama.cpp", "ngram-simple", 12, 12, 48)  # common/common.h's defaults
    assert sizes(**{"spec-ngram-simple-size-n": 3, "spec-ngram-simple-size-m": 8}) == (
        "llama.cpp",
        "ngram-simple",
        3,
        3,
        8,
    )
    assert sizes(**{"spec-ngram-simple-min-hits": 4})[2:] == (12, 12, 48)  # the server parses it and reads it nowhere


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"spec-type": "draft-eagle3"}, "field .spec-type. is .draft-eagle3.: a drafter with weights"),
        ({"spec-type": "ngram-smart"}, r"field 'spec-type' is 'ngram-smart' \(a string\); expected one of \["),
        ({"spec-ngram-simple-size-n": 0}, "spec-ngram-simple-size-n"),
        ({"spec-ngram-simple-size-m": 1025}, "spec-ngram-simple-size-m"),
        ({"spec-ngram-simple-size-n": "3"}, "spec-ngram-simple-size-n"),  # a JSON string is not a size
        ({"spec-draft-n-max": 8}, "spec-draft-n-max"),  # the server ignores it for n-gram types: refused, not dropped
    ],
)
def test_a_llama_ngram_config_the_server_would_not_run_as_given_is_refused_by_name(fields, message):
    with pytest.raises(DrafterConfigError, match=message) as error:
        parse_config({**LLAMA_SIMPLE, **fields}, "simple.json")
    assert str(error.value).startswith("simple.json: ") and "\n" not in str(error.value)


def test_steps_on_a_llama_ngram_config_is_one_error_line(scored, tmp_path):
    """--steps stands for the server's --spec-draft-n-max, which its n-gram types ignore."""
    _, _, shards, _ = scored
    config = tmp_path / "simple.json"
    config.write_text(json.dumps({**LLAMA_SIMPLE, "spec-ngram-simple-size-m": 8}))
    args = ["score", "--ckpt", str(config), "--shards", shards, "--out", str(tmp_path / "out"), "--steps", "4"]
    run = CliRunner().invoke(main, [*args, "--walk-rule", "llama.cpp"])
    assert run.exit_code == 1, run.output  # score's code for "a checkpoint failed", the line saying why
    line = run.output.strip().splitlines()[0]
    assert line == f"error: {config}: --steps: llama-server's ngram-simple drafts up to spec-ngram-simple-size-m " + (
        "tokens whatever --spec-draft-n-max says; set that key in its config instead"
    )
    assert not list((tmp_path / "out").glob("*/walk.parquet"))


@pytest.mark.parametrize(
    "name, message",
    [
        ("ngram:vllm:k=0", "field 'num_speculative_tokens'"),  # out of range
        ("ngram:llama.cpp:n=2000", "field 'spec-ngram-simple-size-n'"),  # above the server's 1024
        ("ngram:vllm:k=3,lookahead=2", "'lookahead'"),  # a key vLLM's config does not have
        ("ngram:vlm:k=3", "no such baseline"),
    ],
)
def test_a_bad_baseline_name_is_one_error_line_and_writes_nothing(scored, tmp_path, name, message):
    _, _, shards, _ = scored
    out = tmp_path / "out"
    run = CliRunner().invoke(main, ["score", "--ckpt", name, "--shards", shards, "--out", str(out)])
    assert run.exit_code in (1, 2), run.output
    errors = [line for line in run.output.strip().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and name in errors[0], run.output
    assert "Traceback" not in run.output and not list(out.glob("*/run.json"))


def test_llama_stateful_configs_take_the_servers_flags_and_defaults():
    def read(raw: dict) -> tuple:
        config = parse_config(raw, "state.json").config
        return config.rule, config.min_n, config.block_size, config.min_hits, config.n_min

    assert read({"spec-type": "ngram-map-k"}) == ("ngram-map-k", 12, 48, 1, 0)  # common/common.h's defaults
    assert read({"spec-type": "ngram-map-k4v", "spec-ngram-map-k4v-min-hits": 3}) == ("ngram-map-k4v", 12, 48, 3, 0)
    assert read({"spec-type": "ngram-mod"}) == ("ngram-mod", 24, 64, 1, 48)  # --spec-default's values
    with pytest.raises(DrafterConfigError, match="spec-ngram-map-k4v-size-n set for spec-type 'ngram-map-k'"):
        parse_config({"spec-type": "ngram-map-k", "spec-ngram-map-k4v-size-n": 3}, "state.json")
    with pytest.raises(DrafterConfigError, match="spec-ngram-mod-n-match"):
        parse_config({"spec-type": "ngram-mod", "spec-ngram-mod-n-match": 0}, "state.json")
    assert read({"spec-type": "ngram-cache"}) == ("ngram-cache", 1, 8, 1, 0)  # n-grams of 1..4 tokens, 8 drafts
    with pytest.raises(UserError, match="field 'lookup-cache-static': ngram-cache's cache files are not replayed"):
        parse_config({"spec-type": "ngram-cache", "lookup-cache-static": "static.bin"}, "state.json")


def test_a_stateful_type_outside_the_servers_loop_is_one_error_line(scored, tmp_path):
    """Its drafts depend on the server's own loop: another --walk-rule is refused by name."""
    _, _, shards, _ = scored
    config = tmp_path / "mod.json"
    config.write_text(json.dumps({"spec-type": "ngram-mod", "spec-ngram-mod-n-match": 2}))
    run = CliRunner().invoke(main, ["score", "--ckpt", str(config), "--shards", shards, "--out", str(tmp_path / "out")])
    assert run.exit_code == 1, run.output
    errors = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert (
        len(errors) == 1 and "keeps state along the server's loop" in errors[0] and "--walk-rule llama.cpp" in errors[0]
    )
    assert not list((tmp_path / "out").glob("*/run.json"))
