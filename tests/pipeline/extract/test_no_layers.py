"""`extract --layer-ids none`: shards of tokens and top-k only, for proposers that read no hidden
states. They hold what an extract with feature layers of the same prompts holds, bit for bit,
minus the features (no features column in any shard); the manifest records layer_ids [];
`inspect` says so; features asked of them are one error naming the shards and the extract that
stores them; options about feature layers are refused with it. Served responses
(--responses-from) alike, from a fake llama.cpp server on 127.0.0.1 (no model behind it)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner
from pyarrow import ipc

from pipeline.extract.config import ExtractConfig
from pipeline.extract.run import run_extract
from pipeline.shards import ShardError, ShardSet, read_manifest
from specreplay.cli import main
from tests.helpers.prompts import write_prompts
from tests.helpers.serving import FakeServer, llamacpp_like
from tests.helpers.shards import same_bits

PROMPTS = [
    {"id": "p0", "prompt": "Janet's ducks lay 16 eggs per day."},
    {"id": "p1", "prompt": "Hello"},
    {"id": "p2", "prompt": "The quick brown fox", "response": "jumps over the lazy dog."},
]
STORED = ["topk_ids", "topk_logprobs", "argmax_mismatch"]


def extract(model_dir, prompts, out, layer_ids, **more) -> dict:
    fixed = dict(max_new_tokens=8, top_k=8, dtype="fp32", quiet=True)
    return run_extract(
        ExtractConfig(model=model_dir, prompts=prompts, out=str(out), layer_ids=layer_ids, **fixed, **more)
    )


@pytest.fixture(scope="module")
def extracts(tiny_qwen3_dir, tmp_path_factory):
    """(with layers [1, 4], with none) of the same prompts."""
    root = tmp_path_factory.mktemp("no_layers")
    prompts = write_prompts(root / "prompts.jsonl", PROMPTS)
    extract(tiny_qwen3_dir, prompts, root / "layers", [1, 4], batch_size=2)
    extract(tiny_qwen3_dir, prompts, root / "none", [], batch_size=2)
    return root / "layers", root / "none"


def assert_same_but_features(with_layers, without) -> None:
    """Every sample of `without` is its twin in `with_layers` minus the features: same tokens,
    same prompt and finish facts, the same top-k and mismatch bits."""
    twins = {s.sample_id: s for s in ShardSet(str(with_layers)).samples()}
    samples = list(ShardSet(str(without)).samples())
    assert sorted(s.sample_id for s in samples) == sorted(twins) and samples
    for sample in samples:
        twin = twins[sample.sample_id]
        assert sorted(sample.tensors) == sorted(STORED) and "features" in twin.tensors
        assert torch.equal(sample.input_ids, twin.input_ids)
        facts = ("prompt_text", "prompt_len", "finish_reason", "greedy", "dataset")
        assert [getattr(sample, f) for f in facts] == [getattr(twin, f) for f in facts]
        for name in STORED:
            assert same_bits(sample.tensors[name], twin.tensors[name]), (sample.sample_id, name)


def test_tokens_and_top_k_only(extracts):
    with_layers, without = extracts
    assert_same_but_features(with_layers, without)
    manifest = read_manifest(str(without))
    assert manifest["settings"]["layer_ids"] == [] and manifest["settings"]["feature_dtype"] is None
    assert sorted(manifest["tensors"]) == sorted(STORED)
    assert manifest["layer_uses"] == [{"by": "--layer-ids", "layer_ids": []}]
    assert manifest["totals"]["samples"] == len(PROMPTS) and manifest["totals"]["raw_bf16_feature_bytes"] == 0
    for path in sorted((without / "shards").glob("*.arrow")):  # no feature bytes anywhere
        names = ipc.open_file(pa.memory_map(str(path))).schema.names
        assert not [name for name in names if name.startswith("features")], path
    assert manifest["totals"]["bytes"] < read_manifest(str(with_layers))["totals"]["bytes"]


def test_rerun_resumes_and_other_layers_are_refused(extracts, tiny_qwen3_dir):
    _, without = extracts
    prompts = str(without.parent / "prompts.jsonl")
    assert extract(tiny_qwen3_dir, prompts, without, [], batch_size=2) == read_manifest(str(without))
    with pytest.raises(ShardError, match=r"layer_ids: \[\] -> \[1\]"):
        extract(tiny_qwen3_dir, prompts, without, [1])


def test_inspect_says_no_feature_layers(extracts):
    _, without = extracts
    result = CliRunner().invoke(main, ["inspect", str(without)])
    assert result.exit_code == 0, result.output
    assert (
        "  layer ids       none: no feature layers, tokens and top-k only "
        "(top-k 8, tensors argmax_mismatch, topk_ids, topk_logprobs)"
    ) in result.output
    assert "layers serve" not in result.output and "B/token; stored bytes" not in result.output
    assert "checksums       1/1 shards ok; target head ok" in result.output
    report = json.loads(CliRunner().invoke(main, ["inspect", str(without), "--json"]).output)
    assert report["layer_ids"] == [] and report["feature_dtype"] is None and report["samples"] == len(PROMPTS)


def test_features_asked_of_them_is_one_error(extracts):
    _, without = extracts
    shard_set = ShardSet(str(without))
    with pytest.raises(ShardError) as error:
        next(shard_set.samples(tensors=["features", "topk_ids"]))
    message = str(error.value)
    assert message.startswith(f"{without}: these shards hold no features (extracted with --layer-ids none")
    assert "`specreplay extract --layer-ids 1,9,17`" in message and "\n" not in message
    assert sorted(next(shard_set.samples(tensors=["topk_ids"])).tensors) == ["topk_ids"]


@pytest.mark.parametrize(
    "option", [["--draft-config", "drafter/config.json"], ["--neighbour-layers"], ["--feature-dtype", "bf16"]]
)
def test_options_about_feature_layers_are_refused(option, tmp_path, tiny_qwen3_dir):
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:1])
    out = tmp_path / "out"
    args = ["extract", "--model", tiny_qwen3_dir, "--prompts", prompts, "--out", str(out), "--layer-ids", "none"]
    result = CliRunner().invoke(main, [*args, *option, "--quiet"])
    assert result.exit_code == 2, result.output
    assert result.output == (
        f"error: --layer-ids none stores no feature layers, so {option[0]} would be ignored; leave {option[0]} "
        f"out, or drop --layer-ids none to store feature layers\n"
    )
    assert not out.exists()


def completion(body: bytes):
    """A llama.cpp /completion answer: n_predict token ids made of the prompt (any fixed ids do)."""
    asked = json.loads(body)
    tokens = [(sum(asked["prompt"]) + 7 * i) % 200 + 10 for i in range(asked["n_predict"])]
    return 200, json.dumps({"tokens": tokens, "stop_type": "limit", "truncated": False}).encode()


def test_served_responses_with_layer_ids_none(tiny_qwen3_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    server = FakeServer(llamacpp_like(tokenizer, n_vocab=len(tokenizer), completion=completion))
    try:
        prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
        extract(tiny_qwen3_dir, prompts, tmp_path / "layers", [1, 4], responses_from=[server.url])
        args = ["--model", tiny_qwen3_dir, "--prompts", prompts, "--out", str(tmp_path / "none"), "--top-k", "8"]
        served = ["--responses-from", server.url, "--layer-ids", "none", "--max-new-tokens", "8", "--dtype", "fp32"]
        result = CliRunner().invoke(main, ["extract", *args, *served, "--quiet"])
        assert result.exit_code == 0, result.output
    finally:
        server.close()
    assert_same_but_features(tmp_path / "layers", tmp_path / "none")
    settings = read_manifest(str(tmp_path / "none"))["settings"]
    assert settings["layer_ids"] == [] and settings["responses"]["engine"] == "llama.cpp"
    finish = read_manifest(str(tmp_path / "none"))["totals"]["finish_reasons"]
    assert finish == {"length": 2, "given": 1}  # the engine's responses, and the teacher-forced one
