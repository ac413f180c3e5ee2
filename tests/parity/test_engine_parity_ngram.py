"""Exactness against a real engine for the n-gram proposers llama-server runs without a draft model:
`specreplay score --ckpt ngram.json --walk-rule llama.cpp` reports, step for step, the accepted-draft
counts llama-server reports with `--spec-type ngram-simple` and the same sizes (the config's keys are
the server's flags), for every sample whose engine response is the stored one
(engine_parity.assert_engine_counts: per-step counts, their sums equal to the timings, at most one
differing response).

The target is a tiny random Qwen3 of llama_engine.engine_target's recipe emitting 16 live ids, so
its greedy responses repeat themselves and the lookups find matches; its stop token ends some of
them early. The shards hold no feature layer (`--layer-ids none`): an n-gram proposer reads the
tokens alone. ngram-simple keeps no state, so the order of the requests does not matter.
"""

from __future__ import annotations

import json

import pytest

from pipeline.shards import ShardSet
from tests.helpers import chain_parity as chains, engine_parity as parity, llama_engine as engine
from tests.helpers.prompts import write_prompts
from tools.llama_convert import convert

pytestmark = pytest.mark.slow

LIVE = 16  # ids the target emits: short loops, which an n-gram lookup finds
MAX_NEW = 64  # long enough for the lookups to draft many steps


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.threads_and_table("ngram")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> parity.Setup:
    tmp = tmp_path_factory.mktemp("engine_parity_ngram")
    prompts = parity.prompt_ids(parity.PROMPTS)
    model_dir = engine.engine_target(tmp / "target", prompts, MAX_NEW, live=LIVE, layers=4)
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(prompts)]
    shards = chains.extract(tmp / "shards", model_dir, write_prompts(tmp / "prompts.jsonl", records), MAX_NEW, [])
    finish = {s.finish_reason for s in ShardSet(shards).samples(tensors=[])}
    assert finish == {"eos", "length"}, finish
    gguf = str(convert(model_dir, tmp / "target.gguf"))
    return parity.Setup(tmp, model_dir, gguf, shards, sequences=[], converter=None, max_new=MAX_NEW)


def ngram_simple(setup: parity.Setup, n: int, m: int) -> parity.Drafter:
    """The config file of llama-server's ngram-simple with size-n n and size-m m, and those flags."""
    path = setup.tmp / f"ngram-simple-{n}-{m}.json"
    sizes = {"spec-ngram-simple-size-n": n, "spec-ngram-simple-size-m": m}
    path.write_text(json.dumps({"spec-type": "ngram-simple", **sizes}))
    flags = tuple(x for key, value in sizes.items() for x in (f"--{key}", str(value)))
    return parity.Drafter("ngram", "llama.cpp", str(path), None, "ngram-simple", m, flags=flags, steps=False)


@pytest.mark.parametrize("n, m", [(2, 6), (1, 4), (3, 12)])
def test_ngram_simple_counts_equal_llama_server(setup, n, m):
    """Sizes where the lookup's rules decide: the latest match, no draft when fewer than n tokens
    follow it, drafts of up to m cut to the budget."""
    walk = parity.assert_engine_counts(setup, ngram_simple(setup, n, m), m, per_step=0.02)
    # the comparison can fail on the lookup: vLLM's (the earliest longest match, any draft length) drafts otherwise
    vllm = setup.tmp / f"vllm-{n}-{m}.json"
    vllm.write_text(
        json.dumps({"method": "ngram", "num_speculative_tokens": m, "prompt_lookup_min": n, "prompt_lookup_max": n})
    )
    other = chains.score(str(vllm), setup.shards, setup.tmp / f"vllm-{n}-{m}", walk_rule="llama.cpp", eagle_trees=[])
    assert engine.walk_counts(other) != walk
