"""The capture forward over windows of positions (pipeline.extract.chunked_forward) stores the same bits
as one pass over all positions, really runs in windows, and leaves the model as it found it.

Tiny Qwen3, Qwen3.5 hybrid (Gated DeltaNet layers run whole, their MLP in windows) and Qwen3.5
ForConditionalGeneration targets, random weights, one unpadded sequence, torch.equal throughout.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.extract import chunked_forward
from pipeline.extract.capture import CaptureConfig, capture_sample
from pipeline.extract.chunked_forward import MAX_FORWARD_ROWS, MIN_WINDOW_ROWS, forward_rows, windowed_forward
from pipeline.extract.target import decoder_layers, load_target, text_config, text_decoder
from tests.helpers.memory import LiveBytes
from tests.helpers.models import TINY_TOKENIZER_VOCAB

TARGETS = ["tiny_qwen3_dir", "tiny_qwen35_hybrid_dir", "tiny_qwen35_vlm_dir"]
TOKENS = 150  # > 2 windows of MIN_WINDOW_ROWS, the last one overlapping its neighbour
PROMPT = 20


def sequence(length: int = TOKENS, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY_TOKENIZER_VOCAB, (length,), generator=generator).tolist()


def config(model, windowed: bool, feature_dtype=None) -> CaptureConfig:
    layers = len(decoder_layers(model))
    return CaptureConfig(
        layer_ids=[layers - 1, 0, layers // 2],  # the last layer (final norm) first, as extract allows
        feature_dtype=feature_dtype or next(model.parameters()).dtype,
        head_budget_bytes=1,  # the smallest windows: MIN_WINDOW_ROWS rows
        windowed=windowed,
    )


class RowsSeen:
    """Largest number of positions each layer's MLP down projection (and attention query
    projection, where the layer has one) received: the windows really ran if it is the window size."""

    def __init__(self, model):
        self.most: dict[str, int] = {}
        self.handles = []
        for index, layer in enumerate(decoder_layers(model)):
            for name in ("mlp.down_proj", "self_attn.q_proj"):
                module = layer.get_submodule(name) if hasattr(layer, name.split(".")[0]) else None
                if module is not None:
                    self.handles.append(module.register_forward_hook(self.hook(f"{index}.{name}")))

    def hook(self, key):
        def record(module, args, output):
            self.most[key] = max(self.most.get(key, 0), args[0].shape[-2])

        return record

    def close(self):
        for handle in self.handles:
            handle.remove()


def capture(model, windowed: bool, ids=None, **kwargs):
    seen = RowsSeen(model)
    try:
        tensors = capture_sample(model, ids or sequence(), PROMPT, config(model, windowed, **kwargs))
    finally:
        seen.close()
    return tensors, seen.most


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), f"{name} differs"


@pytest.fixture(scope="module")
def fp32_models(request):
    return {name: load_target(request.getfixturevalue(name), dtype="float32")[0] for name in TARGETS}


@pytest.mark.parametrize("target", TARGETS)
def test_windowed_capture_equals_one_pass_fp32(target, fp32_models):
    model = fp32_models[target]
    whole, rows_whole = capture(model, windowed=False)
    windowed, rows_windowed = capture(model, windowed=True)
    assert_same(windowed, whole)
    assert set(rows_windowed) == set(rows_whole) and rows_windowed
    assert all(rows == TOKENS for rows in rows_whole.values())
    assert all(rows == MIN_WINDOW_ROWS for rows in rows_windowed.values()), rows_windowed


@pytest.mark.parametrize("target", TARGETS)
def test_windowed_capture_equals_one_pass_bf16(target, request):
    model = load_target(request.getfixturevalue(target), dtype="bfloat16")[0]
    whole, _ = capture(model, windowed=False)
    windowed, rows_windowed = capture(model, windowed=True)
    assert_same(windowed, whole)
    assert all(rows == MIN_WINDOW_ROWS for rows in rows_windowed.values())


def test_windowed_capture_fp8_features(fp32_models):
    model = fp32_models["tiny_qwen3_dir"]
    whole, _ = capture(model, windowed=False, feature_dtype=torch.float8_e4m3fn)
    windowed, _ = capture(model, windowed=True, feature_dtype=torch.float8_e4m3fn)
    assert set(windowed) >= {"features", "features_scale"}
    assert_same(windowed, whole)


def layer_outputs_and_final(model, ids: list[int], rows: int) -> list[torch.Tensor]:
    """Every layer's output (copied: windows overwrite them in place) and the final-norm output."""
    decoder, layers = text_decoder(model), decoder_layers(model)
    outputs: list[torch.Tensor] = []
    handles = [layer.register_forward_hook(lambda m, a, out: outputs.append(out.clone())) for layer in layers]
    try:
        with torch.inference_mode(), windowed_forward(decoder, layers, rows, torch.device("cpu")):
            outputs.append(decoder(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state.clone())
    finally:
        for handle in handles:
            handle.remove()
    return outputs


@pytest.mark.parametrize("target", TARGETS)
def test_many_small_windows(target, fp32_models):
    # 8-row windows (below the product's floor, still above the GEMM sizes CPU BLAS rounds
    # differently): 8 windows over 61 positions, the last overlapping by 3.
    model = fp32_models[target]
    ids = sequence(61, seed=1)
    plain, windowed = layer_outputs_and_final(model, ids, 0), layer_outputs_and_final(model, ids, 8)
    assert len(plain) == len(windowed) == len(decoder_layers(model)) + 1
    for index, (a, b) in enumerate(zip(plain, windowed)):
        assert torch.equal(a, b), f"output {index} differs"


def replaced_forwards(model) -> list:
    decoder = text_decoder(model)
    return [m for m in decoder.modules() if "forward" in m.__dict__]


def test_forwards_restored_after_an_error(fp32_models):
    model = fp32_models["tiny_qwen35_hybrid_dir"]
    decoder = text_decoder(model)
    before = (decoder.config._attn_implementation, replaced_forwards(model))
    calls = []

    def fail_in_second_window(module, args, output):
        calls.append(args[0].shape[-2])
        if len(calls) == 2:
            raise RuntimeError("boom")

    full_attention = next(layer for layer in decoder_layers(model) if hasattr(layer, "self_attn"))
    handle = full_attention.mlp.down_proj.register_forward_hook(fail_in_second_window)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            capture(model, windowed=True)
    finally:
        handle.remove()
    assert calls == [MIN_WINDOW_ROWS, MIN_WINDOW_ROWS]  # it failed inside the windows
    assert (decoder.config._attn_implementation, replaced_forwards(model)) == before == ("sdpa", [])
    assert not chunked_forward._active
    whole, rows = capture(model, windowed=False)
    assert all(r == TOKENS for r in rows.values())  # the plain forward again
    assert_same(capture(model, windowed=True)[0], whole)


def test_plain_forward_where_windows_are_not_exact(fp32_models):
    model = fp32_models["tiny_qwen3_dir"]
    decoder = text_decoder(model)
    decoder.config._attn_implementation = "eager"  # not the kernels the exactness was checked on
    try:
        _, rows = capture(model, windowed=True)
    finally:
        decoder.config._attn_implementation = "sdpa"
    assert all(r == TOKENS for r in rows.values())


def _window_peak(model, rows: int, total: int) -> int:
    """Peak bytes alive while the target's windowed forward runs over `total` positions in windows
    of `rows`, measured at every aten op (the features hooks and the lm_head are not part of it)."""
    decoder, layers = text_decoder(model), decoder_layers(model)
    ids = torch.tensor([sequence(total)])
    with torch.inference_mode(), windowed_forward(decoder, layers, rows, ids.device), LiveBytes() as spy:
        decoder(input_ids=ids, use_cache=False)
    return spy.peak


def test_forward_rows_follow_the_memory_budget(fp32_models):
    """A window of forward_rows(budget) rows holds at most the budget, measured on the real forward
    (what one more window row costs: the growth of the peak from 64- to 128-row windows over the
    same 256 positions), and not far below it (a window much smaller than the budget allows would
    shrink the GEMMs for nothing), wherever the bounds do not decide."""
    model = fp32_models["tiny_qwen3_dir"]
    total = 256
    per_row = (_window_peak(model, 128, total) - _window_peak(model, 64, total)) / 64
    text = text_config(model)
    for rows_wanted in (100, 200, 400):
        budget = int(rows_wanted * per_row)
        rows = forward_rows(text, budget, 4, total)
        assert MIN_WINDOW_ROWS <= rows <= MAX_FORWARD_ROWS
        if MIN_WINDOW_ROWS < rows < MAX_FORWARD_ROWS:
            assert budget / 4 < rows * per_row <= budget, (rows, per_row, budget)
    assert forward_rows(text, 1, 4, total) == MIN_WINDOW_ROWS
    assert forward_rows(text, 1 << 40, 4, total) == MAX_FORWARD_ROWS
