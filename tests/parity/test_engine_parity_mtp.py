"""Exactness against a real engine for MTP: `specreplay score --ckpt <target dir> --walk-rule
llama.cpp` (the target's native MTP head, layout native) reports, step for step, the
accepted-draft counts llama-server reports with `--spec-type draft-mtp` for the same head, which
llama.cpp reads from the target's own GGUF (convert_hf_to_gguf.py keeps the `mtp.*` tensors as
the NextN block unless told --no-mtp) and runs as a chain of n_max greedy steps: the head's
post-norm output fed back, the target's post-final-norm hidden state as step 1's features
(src/models/qwen35.cpp:206-209 and 624-631, common/speculative.cpp:1584-1731).

The target is test_engine_parity's (llama_engine.engine_target: SmolLM2's vocabulary and tokenizer,
64 live ids, the stop token moved to <|im_end|>) built as a tiny hybrid Qwen3.5 (models.
build_tiny_qwen35_hybrid's layers, a trained-looking final norm as mtp_online.build_target's), its `mtp.*` head fitted
briefly by mtp_online.fit on the target's own greedy continuations; the comparison is
engine_parity.assert_engine_counts (per-step counts of every sample whose engine response
is the stored one, their sums equal to the timings, at most one differing response, blocks that
accept drafts, drafts cut near the budget, and the default `--walk-rule dflash` differing somewhere).

A difference from vLLM's rule, modelled by `--walk-rule llama.cpp` (Conventions.lead_slot,
docs/walk-rules.md): llama.cpp's draft KV holds one slot more. process() pairs every token of a
target batch with the hidden row before it, the batch's first token with `pending_h`
(common/speculative.cpp:1519-1527), so the prompt's first token x_0 gets a slot at position 0
paired with `pending_h`, and every other slot sits one position later (slot k reads x_k, h_{k-1};
vLLM's slot s reads x_{s+1}, h_s). `pending_h` is zeros on a server slot's first request (1433),
afterwards the last accepted row of the slot's previous request (1577, 1745; never reset per
request), which the replay of one sample cannot know: each request goes to a slot of its own
(`--parallel 12`, `id_slot`). Replayed without the lead slot, sample p3's counts differ.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scoring.replay import walk_rules
from tests.helpers import engine_parity as parity, llama_engine as engine
from tests.helpers.models import _qwen35_text_config, seeded

pytestmark = pytest.mark.slow

LAYERS = 4
STEPS = 3  # the native head's default (mtp.DEFAULT_STEPS): what --walk-rule dflash runs
FIT_STEPS = 400
FIT_LR = 5e-3


def _qwen35(seed: int = 0):
    """models.build_tiny_qwen35_hybrid's Qwen3_5ForCausalLM (Gated DeltaNet and full-attention
    layers; llama.cpp's hybrid memory aborts on a qwen35 without recurrent layers) at SmolLM2's
    vocabulary, its final norm's weight drawn as mtp_online.build_target draws it (a trained
    norm's: the pre- and post-norm hidden states then differ by more than a scale)."""
    from transformers import Qwen3_5ForCausalLM

    config = _qwen35_text_config(LAYERS)
    config.vocab_size = engine.SMOLLM2_VOCAB
    with seeded(seed):
        model = Qwen3_5ForCausalLM(config).eval()
        with torch.no_grad():
            model.model.norm.weight.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[parity.Setup, parity.Drafter, float]:
    tmp = tmp_path_factory.mktemp("engine_parity_mtp")
    return parity.native_mtp_setup(tmp, _qwen35(), layers=LAYERS, steps=STEPS, fit_steps=FIT_STEPS, fit_lr=FIT_LR)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.threads_and_table("mtp ")


@pytest.mark.parametrize("n_max", [STEPS, 2])
def test_mtp_native_counts_equal_llama_server(setup, n_max):
    setup, drafter, loss = setup
    print(f"\nfitted MTP head: step-1 loss {loss:.3f}")
    walk = parity.assert_engine_counts(setup, drafter, n_max, fresh_slots=True)
    if n_max == STEPS:  # the comparison can fail on the lead slot: without it some sample's counts differ
        without = dataclasses.replace(walk_rules.RULES["llama.cpp"], mtp_lead_slot=False)
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(walk_rules.RULES, "llama.cpp", without)
            plain = parity.score(drafter, setup.shards, setup.tmp / "mtp-no-lead", walk_rule="llama.cpp", steps=n_max)
        assert engine.walk_counts(plain) != walk
