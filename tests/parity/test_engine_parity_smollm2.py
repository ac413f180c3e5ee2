"""Exactness against a real engine on a real target (test_engine_parity.py's comparison, split off
so that pytest-xdist's loadscope runs it beside the tiny target's module rather than after it):
the real SmolLM2-135M as extract loads it, converted to an F32 GGUF by llama.cpp's converter and
served by llama-server, with a DFlash drafter (speculators' own class fitted to SmolLM2's
features, z-lab's layout) and a standalone draft model (draft-simple); specreplay's llama.cpp walk
equals the server's per-step accepted-draft counts for every prompt whose engine response is the
stored one (tests/helpers/engine_parity.py assert_engine_counts).
"""

from __future__ import annotations

import json

import pytest

from pipeline.shards import ShardSet
from tests.helpers import chain_parity as chains, engine_parity as parity, family_fits as fits, llama_engine as engine
from tests.helpers.prompts import write_prompts

pytestmark = pytest.mark.slow

# The real SmolLM2-135M (extract's `--model smollm2`, the package's Q4_1 weights dequantized to fp32),
# converted to an F32 GGUF by llama.cpp's converter; its greedy responses to chat prompts have no
# margins made for the test, so a near-tie may flip a token in llama.cpp's kernels: counted, bounded.
SMOLLM2_AUX = (2, 16, 29)  # speculators' ids (before layer i) of its 30 layers; z-lab's 1, 15, 28
SMOLLM2_DIFFERING = 4
SMOLLM2_PROMPTS = [
    "What is 12 times 7?",
    "Name three primary colors.",
    "Write a Python function that returns the square of a number.",
    "What is the capital of France?",
    "Give me a short greeting.",
    "Count from one to ten.",
    "What is the opposite of hot?",
    "List the days of the week.",
    "How many legs does a spider have?",
    "Translate 'thank you' into Spanish.",
    "What color is the sky on a clear day?",
    "Spell the word 'cat' backwards.",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.threads_and_table("")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, converter) -> parity.Setup:
    """The real SmolLM2-135M as extract loads it, its F32 GGUF, greedy shards of chat prompts, and
    the drafters' fit data: the stored responses run on greedily past their stop token to the
    budget (the 27 s of generating them from the prompts again drop to the few early-stopped)."""
    from pipeline.extract.target import resolve_model_dir

    tmp = tmp_path_factory.mktemp("engine_smollm2")
    model_dir = str(resolve_model_dir("smollm2")[2])
    records = [{"id": f"s{i}", "prompt": text} for i, text in enumerate(SMOLLM2_PROMPTS)]
    layers = [i - 1 for i in SMOLLM2_AUX]
    shards = chains.extract(
        tmp / "shards", "smollm2", write_prompts(tmp / "prompts.jsonl", records), parity.MAX_NEW, layers
    )
    samples = list(ShardSet(shards).samples(tensors=[]))
    prompts = [s.input_ids[: s.prompt_len].tolist() for s in samples]
    responses = [s.input_ids[s.prompt_len :].tolist() for s in samples]
    sequences = engine.continuations(model_dir, prompts, parity.MAX_NEW, responses)
    return parity.Setup(
        tmp, model_dir, converter.convert(model_dir, tmp / "smollm2.gguf"), shards, sequences, converter
    )


def test_dflash_zlab_on_the_real_smollm2_counts_equal_llama_server(smollm2):
    """A real target: speculators' DFlashDraftModel fitted to SmolLM2's own features, in z-lab's
    layout, served by llama-server beside SmolLM2's F32 GGUF (a Llama target: the converter and the
    server read its layers as they read Qwen3's)."""
    recipe = fits.Recipe("dflash", aux_ids=SMOLLM2_AUX, steps=200, anchors=32, lr=2e-2)
    ckpt = fits.fitted(recipe, smollm2.target, smollm2.sequences, smollm2.tmp / "speculators-dflash")
    twin = fits.zlab_layout(ckpt, smollm2.tmp / "zlab-dflash", num_target_layers=30)
    drafter = parity.converted(smollm2, "dflash", "z-lab-smollm2", twin, "draft-dflash", recipe.block_size - 1)
    # a drafter of a 576-wide target fitted for seconds accepts fewer drafts a step than the tiny
    # target's: a lower bar, still many steps accepting drafts for every rule to be compared on
    parity.assert_engine_counts(smollm2, drafter, drafter.drafts, most_differing=SMOLLM2_DIFFERING, per_step=0.1)


def test_draft_simple_on_the_real_smollm2_counts_equal_llama_server(smollm2):
    """A standalone draft model for the real target: a 2-layer Qwen3 at SmolLM2's vocabulary fitted
    to SmolLM2's own greedy continuations, saved with its tokenizer, converted by llama.cpp's
    converter and served with `--spec-type draft-simple -md` beside SmolLM2's F32 GGUF."""
    draft = engine.fitted_draft_model(smollm2.target, smollm2.sequences, smollm2.tmp / "draft", **parity.DRAFT_FIT)
    path = smollm2.tmp / "draft-simple.json"
    path.write_text(json.dumps({"spec-type": "draft-simple", "model-draft": "draft", "spec-draft-n-max": 4}))
    gguf = smollm2.converter.convert(draft, smollm2.tmp / "draft.gguf")
    drafter = parity.Drafter("draft", "llama.cpp", str(path), gguf, "draft-simple", 4)
    parity.assert_engine_counts(smollm2, drafter, 4, most_differing=SMOLLM2_DIFFERING, per_step=0.05)
