"""Bad captures: each is one `error:` line naming the file, and nothing is written (the listing
checks every file's header, shapes and first and last positions before OUT is touched). Zeros
between those positions are found while streaming: the import stops naming the file and lands no
shard of it."""

from __future__ import annotations

import shutil

import pytest
import torch
from click.testing import CliRunner

from specreplay.cli import main
from tests.helpers import captures as C

BEFORE = [1, 3, 5, 6]


@pytest.fixture(scope="module")
def found(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    records = C.teacher_forced_records(2)
    return [C.states(model, r["input_ids"] + r["response"], len(r["input_ids"])) for r in records]


def vllm_capture(tmp_path, found, before=BEFORE, tensors=None):
    """Two capture files s0, s1 (s1's tensors replaced by `tensors` when given) and their prompt lengths."""
    for index, state in enumerate(found):
        path = tmp_path / "cap" / f"s{index}.safetensors"
        C.write_vllm(path, state, before)
        if index == 1 and tensors is not None:
            from safetensors.torch import save_file

            save_file(tensors(C.vllm_tensors(state, before)), str(path))
    C.write_prompt_lens(tmp_path / "lens.jsonl", {f"s{i}": s.prompt_len for i, s in enumerate(found)})
    return tmp_path / "cap"


def run(tmp_path, model_dir, source, fmt="vllm", *extra):
    args = ["import", str(source), "--format", fmt, "--model", model_dir, "--out", str(tmp_path / "out"), "--quiet"]
    if fmt == "vllm":
        args += ["--prompt-lens", str(tmp_path / "lens.jsonl")]
    return CliRunner().invoke(main, [*args, *extra])


def assert_refused(result, tmp_path, path, *needles):
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    assert str(path) in lines[0], result.output
    for needle in needles:
        assert needle in lines[0], result.output
    assert not (tmp_path / "out").exists(), "nothing may be written"


def test_missing_final_hidden_state(tmp_path, tiny_qwen3_dir, found):
    source = vllm_capture(tmp_path, found, before=[1, 3, 5])  # no id 6 = L: no final state
    result = run(tmp_path, tiny_qwen3_dir, source, "vllm", "--captured-layer-ids", "1,3,5")
    assert_refused(result, tmp_path, source / "s0.safetensors", "no final hidden state", "capture the final layer too")


def test_real_specforge_dflash_file_has_no_final_hidden_state(tmp_path, tiny_qwen3_dir):
    source = C.SPECFORGE_FIXTURES / "dflash"
    result = run(tmp_path, tiny_qwen3_dir, source, "specforge", "--captured-layer-ids", "0,2,4")
    assert_refused(result, tmp_path, source / "rows_0-2000" / "data_0.ckpt.gz", "no final hidden state")


def test_layers_not_in_the_capture(tmp_path, tiny_qwen3_dir, found):
    source = vllm_capture(tmp_path, found)
    result = run(tmp_path, tiny_qwen3_dir, source, "vllm", "--captured-layer-ids", "1,3,5,6", "--layer-ids", "0,1")
    assert_refused(result, tmp_path, source / "s0.safetensors", "do not match what was asked", "[1]", "layers 0, 2, 4")


def test_layers_other_than_the_config_says(tmp_path, tiny_qwen3_dir, found):
    source = vllm_capture(tmp_path, found)
    config = C.vllm_speculative_config(tmp_path / "speculative.json", [1, 3, 6])  # the files hold 4 layers
    result = run(tmp_path, tiny_qwen3_dir, source, "vllm", "--capture-config", str(config))
    assert_refused(result, tmp_path, source / "s0.safetensors", "the layers do not match what was captured")


def test_all_zero_hidden_states(tmp_path, tiny_qwen3_dir, found):
    zeroed = lambda t: {**t, "hidden_states": torch.zeros_like(t["hidden_states"])}  # noqa: E731
    source = vllm_capture(tmp_path, found, tensors=zeroed)
    result = run(tmp_path, tiny_qwen3_dir, source, "vllm", "--captured-layer-ids", ",".join(map(str, BEFORE)))
    assert_refused(result, tmp_path, source / "s1.safetensors", "all zero at every position", "#613")


@pytest.mark.parametrize("fmt", ["vllm", "specforge"])
def test_damaged_file(tmp_path, tiny_qwen3_dir, found, fmt):
    if fmt == "vllm":
        source = vllm_capture(tmp_path, found)
        path, extra = source / "s1.safetensors", ["--captured-layer-ids", ",".join(map(str, BEFORE))]
    else:
        source = tmp_path / "cap"
        shutil.copytree(C.SPECFORGE_FIXTURES / "eagle3", source)
        path, extra = source / "rows_0-2000" / "data_0.ckpt", ["--captured-layer-ids", "0,2,4"]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])  # truncated, as an interrupted copy leaves it
    result = run(tmp_path, tiny_qwen3_dir, source, fmt, *extra)
    assert_refused(result, tmp_path, path, "damaged")


def test_zeros_inside_a_sample_stop_the_import(tmp_path, tiny_qwen3_dir, found):
    def zero_middle(t):  # a cache block never written, between the probed first and last positions
        hidden = t["hidden_states"].clone()
        hidden[4:8] = 0
        return {**t, "hidden_states": hidden}

    source = vllm_capture(tmp_path, found, tensors=zero_middle)
    result = run(tmp_path, tiny_qwen3_dir, source, "vllm", "--captured-layer-ids", ",".join(map(str, BEFORE)))
    assert result.exit_code == 2 and result.output.startswith("error: "), result.output
    assert str(source / "s1.safetensors") in result.output and "4 positions, first 4" in result.output
    assert not list((tmp_path / "out" / "shards").glob("*.arrow")), "no shard lands"
