"""Exactness of DeepSpec's Gemma 4 DSpark drafter (`Gemma4DSparkModel`, proposers/dspark/gemma4.py), scored
by `specreplay score`, against both engines' rule on one fitted drafter:

- llama-server (`--spec-type draft-dspark`, the drafter converted by llama.cpp's converter,
  conversion/gemma.py:813-911, run as src/models/dflash.cpp's graph): every sample's (accepted,
  drafted) steps equal the replay's under `--walk-rule llama.cpp`, step for step, at n_max 4 and 2;
- vLLM's rule (tests/helpers/gemma4_dspark.py's reference, written from gemma4_dspark.py on
  transformers' own Gemma 4 modules): at every anchor the replay's block equals the reference's
  greedy chain up to its first draft the response does not hold;
- the wrong rules (V from K after its norm's weight, V without its norm, layer_scalar ignored, no
  embedding scale, attention scale 1/sqrt(d), plain RoPE for proportional) each change anchors'
  drafts and samples' walks.

The target: transformers' Gemma4ForCausalLM (a sliding and two full layers, proportional RoPE), made
the engine target (llama_engine.engine_target) with a byte-fallback BPE tokenizer; the drafter (two
layers, layer scalars 0.6 and 1.4) fitted through the reference's own forward.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers import chain_parity as chains, engine_parity as parity, gemma4_dspark as g4, llama_engine as engine

pytestmark = pytest.mark.slow

FIT_STEPS = 120
FIT_LR = 1e-2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from tests.helpers.models import seeded
    from tests.helpers.prompts import write_prompts
    from tools.llama_convert import convert

    tmp = tmp_path_factory.mktemp("engine_parity_dspark_gemma4")
    prompts = parity.prompt_ids(parity.PROMPTS)
    model_dir = engine.engine_target(tmp / "target", prompts, parity.MAX_NEW, model=g4.target_model())
    g4.save_tokenizer(model_dir)
    sequences = engine.continuations(model_dir, prompts, parity.MAX_NEW)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    raw = g4.drafter_config()
    with seeded(1):
        reference = g4.ReferenceGemma4DSpark(raw)
    loss = g4.fit(reference, target, sequences, FIT_STEPS, FIT_LR)
    ckpt = g4.save(reference.eval().requires_grad_(False), raw, tmp / "drafter")
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(prompts)]
    prompts_file = write_prompts(tmp / "prompts.jsonl", records)
    shards = chains.extract(tmp / "shards", model_dir, prompts_file, parity.MAX_NEW, g4.FEATURES)
    served = g4.for_converter(model_dir, tmp / "target-conv", global_head_dim=16, num_global_key_value_heads=2)
    target_gguf = str(convert(served, tmp / "target.gguf"))
    drafter_gguf = str(convert(ckpt, tmp / "drafter.gguf", target_dir=served))
    found = parity.Setup(tmp, model_dir, target_gguf, shards, sequences, converter=None)
    drafter = parity.Drafter("dspark", "gemma4", ckpt, drafter_gguf, "draft-dspark", g4.BLOCK)
    return found, drafter, reference, target, loss


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.threads_and_table("dspark ")


@pytest.mark.parametrize("n_max", [g4.BLOCK, 2])
def test_gemma4_dspark_counts_equal_llama_server(setup, n_max):
    found, drafter, _, _, loss = setup
    print(f"\nfitted Gemma 4 DSpark drafter: block loss {loss:.3f}")
    parity.assert_engine_counts(found, drafter, n_max)
