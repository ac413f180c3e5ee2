"""Exactness against a real engine for a standalone draft model: `specreplay score --ckpt draft.json
--walk-rule llama.cpp` (llama-server's draft-simple flags, `model-draft` the draft's transformers
directory) reports, step for step, the accepted-draft counts llama-server reports with `--spec-type
draft-simple -md draft.gguf` (the same draft converted by llama.cpp's converter), for every sample
whose engine response is the stored one (engine_parity.assert_engine_counts).

The target is a tiny random Qwen3 of llama_engine.engine_target's recipe; the draft model a smaller
Qwen3 at the same vocabulary and tokenizer, fitted briefly by next-token loss on the target's own
greedy continuations (a random draft accepts nothing). The shards hold no feature layer: a draft
model reads the tokens alone. draft-simple keeps no state between requests.
"""

from __future__ import annotations

import json

import pytest

from pipeline.shards import ShardSet
from tests.helpers import chain_parity as chains, engine_parity as parity, llama_engine as engine
from tests.helpers.prompts import write_prompts

pytestmark = pytest.mark.slow

MAX_NEW = 48


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.threads_and_table("draft")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, converter) -> tuple[parity.Setup, str, str]:
    tmp = tmp_path_factory.mktemp("engine_parity_draft")
    prompts = parity.prompt_ids(parity.PROMPTS)
    model_dir = engine.engine_target(tmp / "target", prompts, MAX_NEW, layers=4)
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(prompts)]
    shards = chains.extract(tmp / "shards", model_dir, write_prompts(tmp / "prompts.jsonl", records), MAX_NEW, [])
    finish = {s.finish_reason for s in ShardSet(shards).samples(tensors=[])}
    assert finish == {"eos", "length"}, finish
    sequences = engine.continuations(model_dir, prompts, MAX_NEW)
    draft = engine.fitted_draft_model(tmp / "target", sequences, tmp / "draft", **parity.DRAFT_FIT)
    gguf = converter.convert(model_dir, tmp / "target.gguf")
    draft_gguf = converter.convert(draft, tmp / "draft.gguf")
    return parity.Setup(tmp, model_dir, gguf, shards, sequences, converter, max_new=MAX_NEW), draft, draft_gguf


def draft_simple(setup: parity.Setup, draft: str, gguf: str, n_max: int) -> parity.Drafter:
    path = setup.tmp / f"draft-simple-{n_max}.json"
    path.write_text(json.dumps({"spec-type": "draft-simple", "model-draft": "draft", "spec-draft-n-max": n_max}))
    return parity.Drafter("draft", "llama.cpp", str(path), gguf, "draft-simple", n_max)


@pytest.mark.parametrize("n_max", [4, 1])
def test_draft_simple_counts_equal_llama_server(setup, n_max):
    """n-max greedy drafts a step, cut to the budget."""
    setup, draft, gguf = setup
    parity.assert_engine_counts(setup, draft_simple(setup, draft, gguf, n_max), n_max, per_step=0.1)
