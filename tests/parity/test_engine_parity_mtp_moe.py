"""Exactness against a real engine for an MTP head whose MLP is a mixture of experts:
`specreplay score --ckpt <target dir> --walk-rule llama.cpp` of a Qwen3.5-MoE target's native head
reports, step for step, the accepted-draft counts llama-server reports with `--spec-type draft-mtp`,
which reads the head from the target's own GGUF (llama.cpp's converter registers
Qwen3_5MoeForCausalLM with the MTP export, conversion/qwen.py `_QwenMtpMixin`, and stacks the
per-expert tensors) and runs it as the qwen35moe MTP graph: softmax top-k routing renormalized, the
shared expert behind its sigmoid gate (src/models/qwen35moe.cpp:550-741).

Built as test_engine_parity_mtp.py builds the dense one: the engine target's recipe
(llama_engine.engine_target: SmolLM2's vocabulary, 64 live ids, the stop token moved) on
transformers' own Qwen3_5MoeForCausalLM (Gated DeltaNet and full-attention layers, 4 experts,
top-2, a shared expert); its head transformers' own Qwen3_5MoeDecoderLayer, fitted briefly by
mtp_online.fit and saved as save_pretrained names experts (one at a time); each request on a
server slot of its own; compared by engine_parity.assert_engine_counts.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import engine_parity as parity, llama_engine as engine
from tests.helpers.models import _qwen35_text_config, seeded

pytestmark = pytest.mark.slow

LAYERS = 4
STEPS = 3  # the native head's default (mtp.DEFAULT_STEPS): what --walk-rule dflash runs
FIT_STEPS = 300
FIT_LR = 5e-3
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96)


def _qwen35_moe(seed: int = 0):
    """models.build_tiny_qwen35_hybrid's layers as a Qwen3_5MoeForCausalLM (every MLP a sparse MoE
    block) at SmolLM2's vocabulary, its final norm's weight drawn as mtp_online.build_target draws it."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    dense = _qwen35_text_config(LAYERS).to_dict()
    fields = {k: v for k, v in dense.items() if k not in ("intermediate_size", "model_type", "transformers_version")}
    config = Qwen3_5MoeTextConfig(**{**fields, **EXPERTS, "vocab_size": engine.SMOLLM2_VOCAB})
    with seeded(seed):
        model = Qwen3_5MoeForCausalLM(config).eval()
        with torch.no_grad():
            model.model.norm.weight.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[parity.Setup, parity.Drafter, float]:
    tmp = tmp_path_factory.mktemp("engine_parity_mtp_moe")
    options = dict(layers=LAYERS, steps=STEPS, fit_steps=FIT_STEPS, fit_lr=FIT_LR)
    return parity.native_mtp_setup(
        tmp, _qwen35_moe(), prepare=parity.keep_saved_tokenizer_class, experts=True, **options
    )


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.threads_and_table("mtp ")


@pytest.mark.parametrize("n_max", [STEPS, 2])
def test_moe_mtp_native_counts_equal_llama_server(setup, n_max):
    setup, drafter, loss = setup
    print(f"\nfitted MoE MTP head: step-1 loss {loss:.3f}")
    parity.assert_engine_counts(setup, drafter, n_max, fresh_slots=True)
