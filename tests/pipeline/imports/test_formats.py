"""`import` of each producer's capture files equals what `extract` stores for the same tokens on
the same target: features layer by layer and the next-token top-k, bit for bit (fp32 captures of
the tiny Qwen3 target, 6 layers; extract's reference is its own output over the same prompts and
given responses). The capture files are written by the producers' own code where it runs here,
and checked against their readers or a real file where it does not (tests/helpers/captures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.imports.config import ImportConfig
from pipeline.imports.run import run_import
from pipeline.shards import ShardSet, read_manifest
from tests.helpers import captures as C

STORED = [0, 1, 2, 4, 5, 6]  # extract's superset: layers 0, 1, 2, 4; id 5 (L - 1, after the norm); id 6 (L, before it)
TOP_K = 8


@pytest.fixture(scope="module")
def ref(tiny_qwen3_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    samples, found = C.reference(tmp, tiny_qwen3_dir, C.teacher_forced_records(), STORED)
    return tiny_qwen3_dir, samples, found, tmp / "extract"


def imported(source, out, model_dir, fmt, **options) -> dict:
    run_import(ImportConfig(source=str(source), format=fmt, model=model_dir, out=str(out), top_k=TOP_K, **options))
    return {s.sample_id: s for s in ShardSet(str(out)).samples()}


def assert_equals_extract(got: dict, want: dict, layer_ids: list[int], ids_of=lambda k: k) -> None:
    """Every imported sample equals extract's of the same tokens: tokens, prompt, teacher-forced
    marking, the stored layers, top-k and argmax mismatches, all bit for bit."""
    assert len({ids_of(k) for k in got}) == len(got) and got
    for key, sample in got.items():
        other = want[ids_of(key)]
        assert torch.equal(sample.input_ids, other.input_ids) and sample.prompt_len == other.prompt_len, key
        assert (sample.finish_reason, sample.greedy) == ("given", False) == (other.finish_reason, other.greedy)
        assert torch.equal(sample.features, C.columns(other, STORED, layer_ids)), key
        for name in ("topk_ids", "topk_logprobs", "argmax_mismatch"):
            assert torch.equal(sample.tensors[name], other.tensors[name]), (key, name)


@pytest.mark.parametrize("layer_ids", [None, [4, 5, 6]])
def test_vllm_capture_equals_extract(ref, tmp_path, layer_ids):
    model_dir, samples, found, _ = ref
    before = [1, 3, 5, 6]  # vLLM numbering: the residual entering layers 1, 3, 5, and 6 = L, the final state
    for key, state in found.items():
        C.write_vllm(tmp_path / "cap" / f"{key}.safetensors", state, before)
    lens = C.write_prompt_lens(tmp_path / "lens.jsonl", {k: s.prompt_len for k, s in samples.items()})
    config = C.vllm_speculative_config(tmp_path / "speculative.json", before)
    got = imported(
        tmp_path / "cap",
        tmp_path / "out",
        model_dir,
        "vllm",
        capture_config=config,
        prompt_lens=lens,
        layer_ids=layer_ids,
    )
    # default: every captured decoder layer, translated (before-layer s = output of s - 1); id 5 is
    # the norm of the captured final state, id 6 that state itself
    assert sorted(got) == sorted(samples)
    assert_equals_extract(got, samples, layer_ids or [0, 2, 4])
    settings = read_manifest(str(tmp_path / "out"))["settings"]
    assert settings["layer_ids"] == (layer_ids or [0, 2, 4]) and settings["imported"]["captured_layer_ids"] == before


def test_speculators_capture_equals_extract(ref, tmp_path):
    from datasets import load_from_disk
    from hs_connectors import FileTransfer
    from speculators.data_generation.offline import check_hidden_states

    model_dir, samples, found, _ = ref
    keys = sorted(samples)
    tokenizer = C.make_tokenizer_for(model_dir)
    before = [2, 3, 3, 6]  # speculators' launch_vllm.py default [2, L // 2, L - 3, L] on this 6-layer target
    data = C.write_speculators(tmp_path / "data", [found[k] for k in keys], before, tokenizer, skip={1})
    # the files are what speculators reads: its own checks and its hs-connectors file transfer
    rows = load_from_disk(data)
    for index in (0, 2):
        loaded = FileTransfer(Path(data) / "hidden_states").get_cached(index)
        check_hidden_states(loaded, rows[index]["input_ids"].tolist())
        assert torch.equal(loaded["hidden_states"][:, -1], found[keys[index]].pre)  # its verifier_last_hidden_states
    got = imported(data, tmp_path / "out", model_dir, "speculators")  # no capture config: the launch default
    assert sorted(got) == [f"hs_{i}" for i in range(len(keys)) if i != 1]  # row 1's request failed: no file
    assert_equals_extract(got, samples, [1, 2], ids_of=lambda k: keys[int(k[3:])])
    imported_from = read_manifest(str(tmp_path / "out"))["settings"]["imported"]["captured_layer_ids_from"]
    assert "launch_vllm.py default" in imported_from


@pytest.mark.parametrize("layout, compress", [("eagle3", False), ("dspark", True)])
def test_specforge_capture_equals_extract(ref, tmp_path, layout, compress):
    model_dir, samples, found, _ = ref
    output = [0, 2, 5]  # SpecForge numbering: outputs of layers 0, 2 and 5 (the last: before the norm)
    for index, key in enumerate(sorted(samples)):
        record = C.specforge_record(found[key], output, layout, dtype=torch.float32)
        C.write_specforge(tmp_path / "cap", index, record, compress)
    got = imported(
        tmp_path / "cap", tmp_path / "out", model_dir, "specforge", captured_layer_ids="0,2,5", layer_ids=[0, 2, 5, 6]
    )
    # id 5 (L - 1) is the stored final state after the norm, id 6 (L) the last layer's raw output
    keys = sorted(samples)
    assert_equals_extract(got, samples, [0, 2, 5, 6], ids_of=lambda k: keys[int(k[5:])])


def test_fp8_capture_from_hs_connectors_is_kept_exactly(ref, tmp_path):
    from hs_connectors import FP8Transfer
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir, samples, found, _ = ref
    before = [1, 3, 6]
    for key, state in found.items():
        C.write_fp8(tmp_path / "cap" / f"{key}.safetensors", state, before)
    lens = C.write_prompt_lens(tmp_path / "lens.jsonl", {k: s.prompt_len for k, s in samples.items()})
    got = imported(tmp_path / "cap", tmp_path / "out", model_dir, "vllm", captured_layer_ids="1,3,6", prompt_lens=lens)
    assert read_manifest(str(tmp_path / "out"))["tensors"]["features"] == "float8_e4m3fn"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for key, sample in got.items():
        path = tmp_path / "cap" / f"{key}.safetensors"
        raw = load_file(str(path))  # hidden_states fp8 [N, 3, H], hidden_states_scales [N, 1, 1]
        scale = raw["hidden_states_scales"].reshape(-1, 1)
        dequantized = raw["hidden_states"].float() * scale[:, :, None]
        # stored: the file's fp8 values with its per-token scale, so what score reads is exact
        assert torch.equal(sample.features, dequantized[:, :2].reshape(len(scale), -1))
        bf16 = FP8Transfer(tmp_path / "cap").get_generated({"hidden_states_path": str(path)})["hidden_states"]
        assert torch.allclose(bf16.float(), dequantized, rtol=1e-2, atol=1e-3)  # hs-connectors' own reading
        with torch.inference_mode():  # top-k: the target's norm and lm_head on the dequantized final state
            logits = model.lm_head(model.model.norm(dequantized[:, 2][None]))[0, sample.prompt_len - 1 :]
        values, ids = torch.topk(torch.log_softmax(logits.float(), -1), TOP_K)
        assert torch.equal(sample.topk_ids, ids.to(torch.int32)), key
        assert torch.allclose(sample.topk_logprobs, values, atol=1e-5), key


def test_real_specforge_file(ref, tmp_path):
    """A file SpecForge's own writer wrote (tests/data/specforge/README.md): imported features are its
    captured layers, the top-k is the target's lm_head over its final state, the sample ends where
    its first supervised run does; and the test helper writes byte-identical files."""
    model_dir = ref[0]
    source = C.SPECFORGE_FIXTURES / "eagle3"
    real = C.read_specforge(source / "rows_0-2000" / "data_0.ckpt")
    got = imported(source, tmp_path / "out", model_dir, "specforge", captured_layer_ids="0,2,4")
    (sample,) = got.values()
    assert sample.sample_id == "data_0" and sample.prompt_len == 9 and len(sample.input_ids) == 22  # 9 + 13
    assert torch.equal(sample.features, real["aux_hidden_state"][0, :22].float())
    logits = torch.nn.functional.linear(real["hidden_state"][0, :22], C.lm_head(model_dir).to(torch.bfloat16))
    values, ids = torch.topk(torch.log_softmax(logits[8:].float(), -1), TOP_K)
    assert torch.equal(sample.topk_ids, ids.to(torch.int32)) and torch.equal(sample.topk_logprobs, values)
    # the helper's own writing of that record is the same file, byte for byte
    written = C.write_specforge(tmp_path / "helper", 0, dict(real))
    assert Path(written).read_bytes() == (source / "rows_0-2000" / "data_0.ckpt").read_bytes()
    gz = C.SPECFORGE_FIXTURES / "dflash" / "rows_0-2000" / "data_0.ckpt.gz"
    again = C.write_specforge(tmp_path / "helper", 0, dict(C.read_specforge(gz)), compress=True)
    assert C.gunzip(again) == C.gunzip(gz)


def test_score_reads_imported_shards_as_extracted_ones(ref, tmp_path):
    """`score` of one drafter over imported shards gives the walk it gives over extract's."""
    import polars as pl
    from click.testing import CliRunner

    from specreplay.cli import main
    from tests.helpers.drafters import reference_drafter
    from tests.helpers.models import TINY_TARGET

    model_dir, samples, found, extracted = ref
    for key, state in found.items():
        C.write_vllm(tmp_path / "cap" / f"{key}.safetensors", state, [1, 3, 6])
    lens = C.write_prompt_lens(tmp_path / "lens.jsonl", {k: s.prompt_len for k, s in samples.items()})
    imported(tmp_path / "cap", tmp_path / "shards", model_dir, "vllm", captured_layer_ids="1,3,6", prompt_lens=lens)
    drafter = tmp_path / "drafter"
    reference_drafter(drafter, target=TINY_TARGET, layer_ids=(0, 2), num_heads=4, intermediate_size=64)
    walks = []
    for shards in (tmp_path / "shards", extracted):
        out = tmp_path / f"results-{shards.name}"
        result = CliRunner().invoke(main, ["score", "--ckpt", str(drafter), "--shards", str(shards), "--out", str(out)])
        assert result.exit_code == 0, result.output
        walk = pl.read_parquet(str(out / "*" / "walk.parquet"))
        walks.append(
            walk.select("sample_id", "method", "step", "anchor", "produced").sort("sample_id", "method", "step")
        )
    assert walks[0].equals(walks[1]) and walks[0].height > 0
    said = CliRunner().invoke(main, ["inspect", str(tmp_path / "shards")])
    assert f"imported        vllm capture {(tmp_path / 'cap').resolve()}" in said.output, said.output
    assert "imported" not in CliRunner().invoke(main, ["inspect", str(extracted)]).output


@pytest.mark.parametrize("target", ["tiny_qwen35_hybrid_dir", "tiny_qwen35_vlm_dir"])
def test_qwen35_targets(request, tmp_path, target):
    """Qwen3.5 (Gated DeltaNet hybrid; the vision-language wrapper): id L - 1 is its zero-centred
    final norm of the captured state, read from the checkpoint alone, equal to extract's."""
    model_dir = request.getfixturevalue(target)
    stored = [0, 2, 3, 4]  # 4 layers: id 3 = L - 1 (after the norm), id 4 = L (before it)
    samples, found = C.reference(tmp_path / "ref", model_dir, C.teacher_forced_records(3), stored)
    for key, state in found.items():
        C.write_vllm(tmp_path / "cap" / f"{key}.safetensors", state, [1, 3, 4])
    lens = C.write_prompt_lens(tmp_path / "lens.jsonl", {k: s.prompt_len for k, s in samples.items()})
    got = imported(
        tmp_path / "cap",
        tmp_path / "out",
        model_dir,
        "vllm",
        captured_layer_ids="1,3,4",
        prompt_lens=lens,
        layer_ids=stored,
    )
    for key, sample in got.items():
        other = samples[key]
        assert torch.equal(sample.features, other.features), key
        for name in ("topk_ids", "topk_logprobs", "argmax_mismatch"):
            assert torch.equal(sample.tensors[name], other.tensors[name]), (key, name)
