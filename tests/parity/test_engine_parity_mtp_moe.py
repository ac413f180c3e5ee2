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

import copy
import json

import pytest
import torch

from pipeline.shards import ShardSet
from tests.helpers import chain_parity as chains, engine_parity as parity, llama_engine as engine, mtp_online
from tests.helpers.models import _qwen35_text_config, seeded
from tests.helpers.prompts import write_prompts
from tools.llama_convert import convert

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


def _keep_saved_tokenizer_class(model_dir: str) -> None:
    """transformers 5.25's AutoTokenizer loads a qwen3_5_moe_text checkpoint's tokenizer as
    Qwen3_5Tokenizer whatever tokenizer_config.json says (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS),
    whose pre-tokenizer is not SmolLM2's: llama.cpp's converter then refuses its hash. An auto_map
    entry makes it load the saved class (TokenizersBackend), as for the dense qwen3_5_text target."""
    path = f"{model_dir}/tokenizer_config.json"
    with open(path) as f:
        config = json.load(f)
    config["auto_map"] = {"AutoTokenizer": [None, "TokenizersBackend"]}
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[parity.Setup, parity.Drafter, float]:
    tmp = tmp_path_factory.mktemp("engine_parity_mtp_moe")
    prompts = parity.prompt_ids(parity.PROMPTS)
    target = _qwen35_moe()
    model_dir = engine.engine_target(tmp / "target", prompts, parity.MAX_NEW, model=target)
    _keep_saved_tokenizer_class(model_dir)
    sequences = engine.continuations(model_dir, prompts, parity.MAX_NEW)
    head_config = copy.deepcopy(target.config)  # MtpHead builds layer 0 of it: a full-attention one
    head_config.layer_types = ["full_attention"] * LAYERS
    with seeded(1):
        head = mtp_online.MtpHead(head_config)
    loss = mtp_online.fit(head, target, [ids for ids, _ in sequences], steps=FIT_STEPS, lr=FIT_LR)
    mtp_online.save_head(head.eval(), model_dir, target)
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(prompts)]
    shards = chains.extract(
        tmp / "shards", model_dir, write_prompts(tmp / "prompts.jsonl", records), parity.MAX_NEW, [LAYERS]
    )
    finish = {s.finish_reason for s in ShardSet(shards).samples(tensors=[])}
    assert finish == {"eos", "length"}, finish
    gguf = str(convert(model_dir, tmp / "target.gguf"))  # the MTP block kept as blk.L.nextn.* and blk.L.ffn_*
    setup = parity.Setup(tmp, model_dir, gguf, shards, sequences, converter=None)
    return setup, parity.Drafter("mtp", "native", model_dir, None, "draft-mtp", STEPS), loss


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.threads_and_table("mtp ")


@pytest.mark.parametrize("n_max", [STEPS, 2])
def test_moe_mtp_native_counts_equal_llama_server(setup, n_max):
    setup, drafter, loss = setup
    print(f"\nfitted MoE MTP head: step-1 loss {loss:.3f}")
    parity.assert_engine_counts(setup, drafter, n_max, fresh_slots=True)
