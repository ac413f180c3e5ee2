"""vLLM's suffix decoding (proposers/suffix/) against Arctic Inference's own SuffixDecodingCache
(arctic-inference 0.3.0, built for CPU by `make setup`: tools/arctic_suffix.py), driven as vLLM's
SuffixDecodingProposer drives it: start_request at a request's first step, add_active_response with
each step's sampled tokens, speculate from the last max_tree_depth tokens, stop_request when it has
left the batch (vllm/v1/spec_decode/suffix_decoding.py:50-96), the samples served one after the other.

The drafts equal Arctic's at every anchor of token streams built to repeat themselves (copied spans
inside a sample and across samples, small vocabularies: many ties between equally frequent
continuations, where the order Arctic keeps a node's children decides), under vLLM's defaults and
settings that exercise each rule: a small tree, the global tree off, a cache of one response and
caches that evict. Plausible wrong rules (no global tree, the response of the sample itself left
out of the global tree or all of it in from the start, the prompt in the global tree, one response
more kept, the samples in another order) give other drafts on the same streams. End to end,
`score --ckpt suffix.json` on shards without feature layers writes Arctic's drafts at every anchor
and records the order it served the samples in."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch
from click.testing import CliRunner

from pipeline.common.distributed import Dist
from pipeline.common.errors import UserError
from pipeline.shards import Sample
from proposers.detect import parse_config
from proposers.suffix.cache import SuffixCache
from proposers.suffix.proposer import SuffixProposer
from scoring.replay.anchors import replay_sample
from scoring.replay.packing import ReplayOptions
from scoring.score.steps import served_order
from specreplay.cli import main
from tests.helpers import chain_parity as parity
from tests.helpers.prompts import write_prompts
from tools.arctic_suffix import import_reference


@pytest.fixture(scope="module")
def arctic():
    """arctic_inference.suffix_decoding as `make setup` built it; never downloaded here."""
    try:
        return import_reference()
    except ImportError as error:
        pytest.fail(f"{error}", pytrace=False)


def test_a_missing_reference_says_what_to_run(monkeypatch, tmp_path):
    import tools.arctic_suffix as tool

    monkeypatch.setattr(tool, "SHARE", tmp_path / "arctic_suffix")
    with pytest.raises(ImportError, match=r"not built in .*: run `make setup`") as error:
        tool.import_reference()
    assert "\n" not in str(error.value)


# (max_tree_depth, max_cached_requests, num_speculative_tokens, max_spec_factor, min_token_prob)
SETTINGS = {
    "vLLM's defaults": (24, 10000, 24, 1.0, 0.1),
    "small tree, a cache of 2 evicting": (8, 2, 5, 1.0, 0.1),
    "global tree off": (6, 0, 4, 2.0, 0.0),
    "a cache of 1: the response itself": (12, 1, 8, 0.5, 0.3),
    "short tree, every tie": (3, 3, 6, 4.0, 0.0),
    "certain continuations only": (16, 10000, 10, 1.0, 1.0),
    "two tokens deep": (2, 2, 3, 1.0, 0.0),
}


def streams(seed: int, vocab: int, count: int = 6) -> list[tuple[np.ndarray, int]]:
    """(tokens, prompt length) of `count` samples over `vocab` ids: random tokens, spans copied inside
    a sample and from earlier samples' responses, so both trees find long matches."""
    rng, samples = np.random.default_rng(seed), []
    for _ in range(count):
        prompt_len, response_len = int(rng.integers(3, 12)), int(rng.integers(20, 160))
        tokens = rng.integers(0, vocab, prompt_len + response_len)
        for _ in range(4):
            size = int(rng.integers(2, 10))
            source, to = int(rng.integers(0, tokens.size - size)), int(rng.integers(0, tokens.size - size))
            tokens[to : to + size] = tokens[source : source + size].copy()
        if samples:
            earlier, earlier_prompt = samples[int(rng.integers(0, len(samples)))]
            size, to = min(15, earlier.size - earlier_prompt), int(rng.integers(prompt_len, tokens.size - 1))
            span = earlier[earlier_prompt : earlier_prompt + size][: tokens.size - to]
            tokens[to : to + span.size] = span
        samples.append((tokens.astype(np.int64), prompt_len))
    return samples


DATA = [streams(seed, vocab) for seed, vocab in ((0, 3), (1, 8), (2, 30), (3, 2))]


def arctic_drafts(arctic, samples, setting, wrong: str | None = None) -> list[dict[int, list[int]]]:
    """Per sample, anchor t -> Arctic's draft after x_0 .. x_t, its cache driven as vLLM drives it
    (or by the rule `wrong` names instead)."""
    depth, cached, k, factor, min_prob = setting
    cache = arctic.SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=cached + (wrong == "one more kept"))
    order = list(range(len(samples)))[:: -1 if wrong == "reversed order" else 1]
    drafts, previous = [dict() for _ in samples], None
    for i in order:
        tokens, prompt_len = samples[i]
        wrong_extra(cache, wrong, i, tokens[:prompt_len], tokens[prompt_len:])
        cache.start_request(i, tokens[:prompt_len].astype(np.int32))  # vllm:64-71, at the first sampled token
        if wrong == "own response left out while served":
            cache.evict_cached_response(i)
        if previous is not None:
            cache.stop_request(previous)  # vllm:92-96: after the requests in the batch
        for t in range(prompt_len, tokens.size):
            cache.add_active_response(i, [int(tokens[t])])  # vllm:74: the step's sampled tokens
            if t + 1 < tokens.size:
                pattern = tokens[max(0, t + 1 - depth) : t + 1].astype(np.int32)  # vllm:78-79
                found = cache.speculate(i, pattern, max_spec_tokens=k, max_spec_factor=factor, min_token_prob=min_prob)
                drafts[i][t] = list(found.token_ids)
        if wrong == "own response left out while served":  # in for the later samples
            wrong_extra(cache, "late", f"late{i}", np.zeros(0), tokens[prompt_len:])
        previous = i
    return drafts


def wrong_extra(cache, wrong: str | None, i, prompt: np.ndarray, response: np.ndarray) -> None:
    """The request of its own (so taking a slot) by which a wrong rule puts more into the global tree."""
    extra = {"prompt in the global tree": prompt, "whole response in from the start": response, "late": response}
    if wrong in extra:
        cache.start_request(f"extra{i}", np.zeros(0, dtype=np.int32))
        cache.add_active_response(f"extra{i}", extra[wrong].tolist())
        cache.stop_request(f"extra{i}")


def our_drafts(samples, setting) -> list[dict[int, list[int]]]:
    """Per sample, anchor t -> the proposer's cache's draft after x_0 .. x_t, the samples in order."""
    depth, cached, k, factor, min_prob = setting
    cache = SuffixCache(depth, cached, factor, min_prob)
    found = []
    for tokens, prompt_len in samples:
        out, counts = cache.serve(tokens, prompt_len, k)
        found.append({t: out[t, : counts[t]].tolist() for t in range(prompt_len, tokens.size - 1)})
    return found


def differing(a: list[dict], b: list[dict]) -> int:
    return sum(x[t] != y[t] for x, y in zip(a, b) for t in x)


@pytest.mark.parametrize("name", SETTINGS, ids=list(SETTINGS))
def test_drafts_equal_arctics_at_every_anchor(arctic, name):
    setting, compared, drafted = SETTINGS[name], 0, 0
    for samples in DATA:
        expected, found = arctic_drafts(arctic, samples, setting), our_drafts(samples, setting)
        assert [sorted(d) for d in found] == [sorted(d) for d in expected]
        for s, (mine, theirs) in enumerate(zip(found, expected)):
            for t in theirs:
                assert mine[t] == theirs[t], (name, s, t)
                compared += 1
                drafted += bool(theirs[t])
    print(f"suffix decoding, {name}: {compared} anchors, {drafted} with a draft, 0 differing from Arctic")
    assert compared > 1500 and drafted > 40


@pytest.mark.parametrize("min_prob, drafted", [(0.1, [10]), (0.1000001, []), (0.0999999, [10])])
def test_a_probability_of_exactly_min_token_prob_drafts(arctic, min_prob, drafted):
    """After 7, nine earlier continuations once each and the anchor's own 7: count 1 of 10, which in
    Arctic's float32 equals min_token_prob 0.1 (also a C++ float): drafted, as Arctic does."""
    prompt = [t for k in range(10, 19) for t in (7, k)]
    samples = [(np.array([*prompt, 7, 5, 5], dtype=np.int64), len(prompt))]
    setting = (4, 0, 3, 1.0, min_prob)
    assert our_drafts(samples, setting)[0][len(prompt)] == drafted == arctic_drafts(arctic, samples, setting)[0][18]


WRONG = (
    "no global tree",
    "own response left out while served",
    "whole response in from the start",
    "prompt in the global tree",
    "one more kept",
    "reversed order",
)


@pytest.mark.parametrize("wrong", WRONG)
def test_a_plausible_wrong_rule_gives_other_drafts(arctic, wrong):
    """Each wrong rule, Arctic's cache driven by it, differs from Arctic driven as vLLM drives it on
    the streams the exactness test compares: that test would catch a proposer following it."""
    setting = SETTINGS["small tree, a cache of 2 evicting"]
    total = 0
    for samples in DATA:
        right = arctic_drafts(arctic, samples, setting)
        if wrong == "no global tree":
            other = arctic_drafts(arctic, samples, (*setting[:1], 0, *setting[2:]))
        else:
            other = arctic_drafts(arctic, samples, setting, wrong)
        total += differing(right, other)
    print(f"suffix decoding, wrong rule {wrong!r}: {total} anchors differ")
    assert total > 0


def test_the_order_of_the_samples_changes_the_drafts():
    """State across requests: the same samples served in another order draft otherwise, so run.json
    records the order (`requests`)."""
    setting, samples = SETTINGS["vLLM's defaults"], DATA[1]
    forward = our_drafts(samples, setting)
    backward = our_drafts(samples[::-1], setting)[::-1]
    assert differing(forward, backward) > 0
    assert forward[0] != backward[0] and forward == our_drafts(samples, setting)  # deterministic


def sample(sample_id: str, tokens: list[int], prompt_len: int) -> Sample:
    rows = len(tokens) - prompt_len + 1
    return Sample(
        sample_id, "d", "", torch.tensor(tokens), prompt_len, "length", True,
        {"topk_ids": torch.zeros(rows, 2, dtype=torch.long), "topk_logprobs": torch.zeros(rows, 2)},
    )  # fmt: skip


def test_a_sample_without_an_anchor_still_enters_the_global_tree(arctic):
    """A one-token response has no anchor, but vLLM's first step (its prefill's token) starts the
    request and caches that token: the replay serves it too, and later drafts see it."""
    setting = (4, 10, 3, 2.0, 0.0)
    config = parse_config({"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 4,
                           "suffix_decoding_max_cached_requests": 10, "suffix_decoding_max_spec_factor": 2.0,
                           "suffix_decoding_min_token_prob": 0.0}, "s.json").config  # fmt: skip
    proposer = SuffixProposer(config)
    short = [5, 6, 7, 9]  # prompt 5 6 7, response 9
    result = replay_sample(proposer, None, sample("a", short, 3), lambda f: f, 16, ReplayOptions(methods={}))
    assert result.anchors.numel() == 0 and len(proposer.cache.cached) == 1
    later = np.array([1, 2, 9, 9, 3, 9, 9, 4], dtype=np.int64)
    out, counts = proposer.cache.serve(later, 2, 3)
    expected = arctic_drafts(arctic, [(np.array(short), 3), (later, 2)], setting)[1]
    assert {t: out[t, : counts[t]].tolist() for t in expected} == expected


def test_a_stateful_proposer_is_scored_in_one_process():
    proposer = SuffixProposer(parse_config({"method": "suffix"}, "s.json").config)
    info = type("Info", (), {"name": "suffix"})()
    assert "in the shards' sample order" in served_order(proposer, info, Dist())
    with pytest.raises(UserError, match="score it in one process, not under torchrun"):
        served_order(proposer, info, Dist(rank=0, world=2))


# --------------------------------------------------------------------------------------------- end to end

MAX_NEW = 40
SUFFIX = {
    "method": "suffix",
    "num_speculative_tokens": 4,
    "suffix_decoding_max_tree_depth": 8,
    "suffix_decoding_max_cached_requests": 3,  # 6 samples: evictions
    "suffix_decoding_min_token_prob": 0.0,
}


@pytest.fixture(scope="module")
def scored(tiny_qwen3_dir, tmp_path_factory):
    """(shards without feature layers, a config file, the results of every anchor, of the walks only)."""
    tmp = tmp_path_factory.mktemp("suffix")
    prompts = [ids + ids[:5] for ids in parity.prompt_ids(6)]  # a repeat in the prompt: the sample's own tree
    path = write_prompts(tmp / "prompts.jsonl", [{"id": f"p{i}", "input_ids": p} for i, p in enumerate(prompts)])
    shards = parity.extract(tmp / "shards", tiny_qwen3_dir, path, MAX_NEW, [])
    config = tmp / "suffix.json"
    config.write_text(json.dumps(SUFFIX))
    results = {}
    for anchors in ("all", "walk"):
        out = tmp / anchors
        args = ["score", "--ckpt", str(config), "--shards", shards, "--out", str(out), "--anchors", anchors]
        run = CliRunner().invoke(main, [*args, "--anchor-drafts"] if anchors == "all" else args)
        assert run.exit_code == 0, run.output
        results[anchors] = out / f"{tmp.name}_suffix"
    return shards, config, results


def assert_arctics_drafts(arctic, shards: str, results, k: int) -> None:
    """anchors.parquet's draft at every anchor is Arctic's, its cache driven over the shards' samples
    in their order with SUFFIX's settings and k drafts."""
    from pipeline.shards import ShardSet

    samples = [(s.input_ids.numpy(), s.prompt_len) for s in ShardSet(shards).samples(tensors=[])]
    setting = tuple(SUFFIX.get(key, default) for key, default in (
        ("suffix_decoding_max_tree_depth", 24), ("suffix_decoding_max_cached_requests", 10000), ("-", k),
        ("suffix_decoding_max_spec_factor", 1.0), ("suffix_decoding_min_token_prob", 0.1),
    ))  # fmt: skip
    expected = arctic_drafts(arctic, samples, setting)
    anchors = pl.read_parquet(results / "anchors.parquet").sort("sample_id", "anchor")
    ids = sorted(set(anchors["sample_id"]), key=lambda sid: int(sid[1:]))
    assert len(ids) == len(samples) == 6
    compared = drafted = 0
    for i, sid in enumerate(ids):
        rows = anchors.filter(pl.col("sample_id") == sid)
        assert rows["anchor"].to_list() == sorted(expected[i]), sid
        assert rows["draft_tokens"].to_list() == [expected[i][t] for t in rows["anchor"].to_list()], sid
        compared += rows.height
        drafted += sum(bool(expected[i][t]) for t in expected[i])
    print(f"suffix decoding end to end, k={k}: {compared} anchors of {len(ids)} samples, {drafted} drafted, as Arctic")
    assert drafted > 0


def test_score_writes_arctics_drafts_at_every_anchor(arctic, scored):
    shards, _, results = scored
    assert_arctics_drafts(arctic, shards, results["all"], SUFFIX["num_speculative_tokens"])
    record = json.loads((results["all"] / "run.json").read_text())
    assert record["requests"].startswith("one at a time, each to its end, in the shards' sample order")
    assert "up to 2 requests before" in record["requests"] and record["checkpoint"]["family"] == "suffix"


def test_steps_is_num_speculative_tokens(arctic, scored, tmp_path):
    """--steps 2: Arctic's drafts with max_spec_tokens 2, which are not always the first two of its
    drafts with 4 (the cap enters each match's score): the proposer reads it after --steps set it."""
    short, long = (our_drafts(DATA[1], (8, 3, k, 1.0, 0.0)) for k in (2, 4))
    assert any(a[t] != b[t][:2] for a, b in zip(short, long) for t in a)
    shards, config, _ = scored
    args = ["score", "--ckpt", str(config), "--shards", shards, "--out", str(tmp_path), "--steps", "2"]
    run = CliRunner().invoke(main, [*args, "--anchor-drafts"])
    assert run.exit_code == 0, run.output
    [results] = tmp_path.glob("*_suffix")
    assert_arctics_drafts(arctic, shards, results, 2)
    assert json.loads((results / "run.json").read_text())["chain_steps"] == 2


def test_walk_only_replay_serves_the_same_samples_in_the_same_order(scored):
    _, _, results = scored
    walks = [parity.walk_table(str(results[a])) for a in ("all", "walk")]
    assert walks[0].equals(walks[1])
    assert set(pl.read_parquet(results["all"] / "walk.parquet")["method"]) == {"chain"}  # a point mass: no DDTree


@pytest.mark.parametrize(
    "field, value",
    [
        ("suffix_decoding_min_token_prob", 1.5),
        ("suffix_decoding_max_tree_depth", 0),
        ("suffix_decoding_max_cached_requests", -1),
        ("suffix_decoding_max_spec_factor", -1.0),
        ("prompt_lookup_max", 4),  # ngram's, not a field of the method
    ],
)
def test_a_bad_field_is_one_error_line_naming_file_and_field_and_writes_nothing(scored, tmp_path, field, value):
    shards, _, _ = scored
    config, out = tmp_path / "suffix.json", tmp_path / "out"
    config.write_text(json.dumps({**SUFFIX, field: value}))
    run = CliRunner().invoke(main, ["score", "--ckpt", str(config), "--shards", shards, "--out", str(out)])
    assert run.exit_code in (1, 2), run.output
    errors = [line for line in run.output.strip().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(config) in errors[0] and f"'{field}'" in errors[0], run.output
    assert "Traceback" not in run.output and not list(out.glob("**/*.parquet")) and not list(out.glob("**/run.json"))
