"""Stage 1 exactness: what extract stores equals a fresh transformers forward / greedy generate.

fp32, one unpadded sequence per check, so every comparison is torch.equal, on tiny Qwen3,
Qwen3.5 hybrid (Gated DeltaNet) and Qwen3.5 ForConditionalGeneration targets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.common.errors import UserError
from pipeline.common.layer_ids import build_target_layer_ids
from pipeline.extract.generate import cut_at_stop, left_pad
from pipeline.extract.prompts import load_prompts, render_prompt, render_response
from pipeline.extract.run import ExtractConfig, run_extract
from pipeline.extract.target import load_target
from pipeline.shards import ShardSet
from tests.helpers.prompts import write_prompts

MAX_NEW = 12

# Different lengths so batches really pad; one given response (teacher-forced), one raw input_ids.
PROMPTS = [
    {"id": "p0", "prompt": "Janet's ducks lay 16 eggs per day."},
    {
        "id": "p1",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "def has_close_elements(numbers):"},
        ],
    },
    {"id": "p2", "prompt": "Hello"},
    {"id": "p3", "prompt": "The quick brown fox", "response": "jumps over the lazy dog."},
    {"id": "p4", "input_ids": [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]},
]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "tiny.jsonl", PROMPTS)


def extract(model_dir, prompts, out, **kwargs):
    config = ExtractConfig(
        model=model_dir, prompts=prompts, out=str(out), max_new_tokens=MAX_NEW, quiet=True, batch_size=3, **kwargs
    )
    return run_extract(config)


def fresh(model, ids: list[int]):
    """A plain full-model forward over one sequence, all hidden states requested."""
    with torch.inference_mode():
        return model(torch.tensor([ids]), output_hidden_states=True)


def single_greedy(model, prompt_ids: list[int], stop_ids: list[int], max_new: int = MAX_NEW) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new)
    return cut_at_stop(out[0, len(prompt_ids) :].tolist(), stop_ids, max_new).token_ids


def capture_logits(model, ids: list[int], prompt_len: int) -> torch.Tensor:
    """The full next-token logits [R+1, V] along extract's own path (decoder, then lm_head windows)."""
    from pipeline.extract.capture import MIN_HEAD_ROWS, head_rows, text_decoder, window_logits
    from pipeline.extract.target import text_config

    head = model.get_output_embeddings()
    with torch.inference_mode():
        final = text_decoder(model)(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0]
        rows = [MIN_HEAD_ROWS, head_rows(head.weight.shape[0], 1 << 30)]
        windows = [torch.cat(list(window_logits(final, head, text_config(model), prompt_len - 1, r))) for r in rows]
    assert torch.equal(windows[0], windows[1])
    return windows[0]


def check_against_fresh(model_dir, out, prompts_path, layer_ids):
    model, tokenizer, info = load_target(model_dir, dtype="float32")
    records = {r.id: r for r in load_prompts(prompts_path)}
    shard_set = ShardSet(str(out))
    assert shard_set.settings["layer_ids"] == layer_ids
    samples = list(shard_set.samples())
    assert sorted(s.sample_id for s in samples) == sorted(records)
    for sample in samples:
        record = records[sample.sample_id]
        prompt_ids, prompt_text = render_prompt(record, tokenizer, None)
        ids = sample.input_ids.tolist()
        assert ids[: sample.prompt_len] == prompt_ids and sample.prompt_text == prompt_text
        response = ids[sample.prompt_len :]
        given = render_response(record, tokenizer)
        if given is None:
            assert sample.greedy and sample.finish_reason in ("eos", "length")
            assert response == single_greedy(model, prompt_ids, info.stop_token_ids)
            assert sample.finish_reason == ("eos" if response[-1] in info.stop_token_ids else "length")
        else:
            assert not sample.greedy and sample.finish_reason == "given" and response == given

        output = fresh(model, ids)
        expected = torch.cat([output.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
        assert sample.features.dtype == torch.float32
        assert torch.equal(sample.features, expected), f"{sample.sample_id}: features differ"
        logits = output.logits[0, sample.prompt_len - 1 :].float()
        values, indices = torch.topk(torch.log_softmax(logits, dim=-1), 32, dim=-1)
        assert torch.equal(sample.topk_ids, indices.to(torch.int32))
        assert torch.equal(sample.topk_logprobs, values)
        mismatch = (logits[:-1].argmax(-1) != torch.tensor(response)).to(torch.uint8)
        assert torch.equal(sample.argmax_mismatch, mismatch)
        if sample.greedy:
            assert int(mismatch.sum()) == 0  # fp32: the full forward agrees with cached greedy decoding
        # Every logit, not just the top-k: extract's windowed lm_head equals the model's own forward.
        assert torch.equal(capture_logits(model, ids, sample.prompt_len), logits)
        assert set(sample.tensors) == {"features", "topk_ids", "topk_logprobs", "argmax_mismatch"}
    return shard_set


@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_qwen35_hybrid_dir", "tiny_qwen35_vlm_dir"])
def test_stored_values_equal_fresh_forward(fixture, request, prompts_file, tmp_path):
    model_dir = request.getfixturevalue(fixture)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    num_layers = (config.get("text_config") or config)["num_hidden_layers"]
    # Layer 0 and the last layer are where off-by-one and final-norm mistakes show; out of order on
    # purpose. The last layer's features are the final norm's output, what the lm_head reads.
    layer_ids = [num_layers - 1, 0, num_layers // 2]
    manifest = extract(model_dir, prompts_file, tmp_path / "out", layer_ids=layer_ids)
    assert manifest["complete"] and manifest["totals"]["samples"] == len(PROMPTS)
    assert manifest["totals"]["finish_reasons"].get("given") == 1
    shard_set = check_against_fresh(model_dir, tmp_path / "out", prompts_file, layer_ids)
    head = shard_set.target_head()
    model, _, _ = load_target(model_dir, dtype="float32")
    assert torch.equal(head["embed_tokens"], model.get_input_embeddings().weight)
    assert torch.equal(head["lm_head"], model.get_output_embeddings().weight)


def test_formula_default_layer_ids(prompts_file, tmp_path):
    """No --layer-ids: the DFlash formula with 5 drafter layers over an 8-layer target."""
    from tests.helpers.models import build_tiny_qwen3

    model_dir = build_tiny_qwen3(tmp_path / "qwen3-8", num_layers=8)
    manifest = extract(model_dir, prompts_file, tmp_path / "out", limit=2)
    assert manifest["settings"]["layer_ids"] == build_target_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    two = write_prompts(tmp_path / "two.jsonl", PROMPTS[:2])
    # limit=2 takes the same two records; check them against the fresh forward.
    extract(model_dir, two, tmp_path / "out2")
    check_against_fresh(model_dir, tmp_path / "out2", two, [1, 2, 3, 4, 5])


def test_draft_config_layer_ids(tiny_qwen3_dir, prompts_file, tmp_path):
    from pipeline.extract.plan import draft_layer_use

    explicit = tmp_path / "explicit"
    explicit.mkdir()
    (explicit / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "dflash_config": {"target_layer_ids": [0, 5]}})
    )
    formula = tmp_path / "formula.json"
    formula.write_text(json.dumps({"num_hidden_layers": 3, "num_target_layers": 6}))
    assert draft_layer_use(str(explicit), 6)["layer_ids"] == [0, 5]
    assert draft_layer_use(str(formula), 6)["layer_ids"] == build_target_layer_ids(6, 3)
    manifest = extract(tiny_qwen3_dir, prompts_file, tmp_path / "out", draft_config=str(explicit), limit=1)
    assert manifest["settings"]["layer_ids"] == [0, 5]


def test_several_draft_configs_share_layers_and_inspect_says_which_serves_which(tiny_qwen3_dir, prompts_file, tmp_path):
    """A z-lab DFlash config reading output-of ids [1, 4] and a speculators EAGLE-3 config reading
    before-layer ids [2, 4, 6] (= output-of [1, 3, 5]) on a 6-layer target: layer 1 is stored once,
    the union in the order first asked for, and inspect names the readers of every stored layer."""
    from pipeline.extract.inspect import format_report, inspect_extract

    dflash, eagle = tmp_path / "dflash.json", tmp_path / "eagle"
    dflash.write_text(json.dumps({"num_hidden_layers": 2, "dflash_config": {"target_layer_ids": [1, 4]}}))
    eagle.mkdir()
    decoder = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 128}
    (eagle / "config.json").write_text(
        json.dumps(
            {
                "speculators_model_type": "eagle3",
                "transformer_layer_config": decoder,
                "eagle_aux_hidden_state_layer_ids": [2, 4, 6],
            }
        )
    )
    manifest = extract(tiny_qwen3_dir, prompts_file, tmp_path / "out", draft_config=[str(dflash), str(eagle)], limit=1)
    assert manifest["settings"]["layer_ids"] == [1, 4, 3, 6]
    report = inspect_extract(str(tmp_path / "out"))
    text = format_report(report)
    lines = {line.split()[1]: line for line in text.splitlines() if line.startswith("    layer ")}
    assert set(lines) == {"1", "3", "4", "6"}
    assert "dflash (z-lab)" in lines["1"] and "eagle3 (speculators)" in lines["1"]
    assert "dflash (z-lab)" in lines["4"] and "eagle3" not in lines["4"]
    assert "eagle3 (speculators)" in lines["3"] and "dflash" not in lines["3"]
    assert "(final, pre-norm)" in lines["6"] and "eagle3 (speculators)" in lines["6"]


def test_batched_generation_matches_one_at_a_time(tiny_qwen35_hybrid_dir):
    """The left-padded batch path itself, independent of the shard plumbing."""
    from pipeline.extract.generate import generate_batch

    model, _, info = load_target(tiny_qwen35_hybrid_dir, dtype="float32")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15]]
    batched = generate_batch(model, prompts, MAX_NEW, info.stop_token_ids, info.pad_token_id)
    for prompt, response in zip(prompts, batched):
        assert response.token_ids == single_greedy(model, prompt, info.stop_token_ids)
    ids, mask = left_pad(prompts, info.pad_token_id, "cpu")
    assert ids.shape == (3, 7) and mask[2].tolist() == [0] * 6 + [1]


def test_head_windows_cover_each_row_once():
    from pipeline.extract.capture import head_windows

    for lo, total, rows in [(0, 10, 64), (5, 200, 64), (63, 64, 64), (100, 129, 64), (3, 300, 100)]:
        covered = []
        for begin, end, keep in head_windows(lo, total, total, rows):
            assert end - begin == min(rows, total) and begin <= keep < end
            covered.extend(range(keep, end))
        assert covered == list(range(lo, total))


def test_feature_dtype_bfloat16(tiny_qwen3_dir, prompts_file, tmp_path):
    """Storage dtype narrower than the model's: features are the fp32 values cast once."""
    manifest = extract(tiny_qwen3_dir, prompts_file, tmp_path / "out", layer_ids=[1, 4], feature_dtype="bf16", limit=1)
    assert manifest["tensors"]["features"] == "bfloat16"
    sample = next(ShardSet(str(tmp_path / "out")).samples())
    model, _, _ = load_target(tiny_qwen3_dir, dtype="float32")
    output = fresh(model, sample.input_ids.tolist())
    expected = torch.cat([output.hidden_states[2][0], output.hidden_states[5][0]], -1).to(torch.bfloat16)
    assert torch.equal(sample.features, expected)


def test_feature_dtype_fp8(tiny_qwen3_dir, prompts_file, tmp_path):
    """Lossy opt-in: e4m3 values with one scale per token and layer; the reader dequantizes."""
    out = tmp_path / "out"
    manifest = extract(tiny_qwen3_dir, prompts_file, out, layer_ids=[1, 4], feature_dtype="fp8", limit=2)
    assert manifest["tensors"]["features"] == "float8_e4m3fn" and manifest["tensors"]["features_scale"] == "float32"
    model, _, _ = load_target(tiny_qwen3_dir, dtype="float32")
    for sample in ShardSet(str(out)).samples():
        assert "features_scale" not in sample.tensors and sample.features.dtype == torch.float32
        output = fresh(model, sample.input_ids.tolist())
        for j, layer in enumerate([1, 4]):
            exact = output.hidden_states[layer + 1][0]
            got = sample.features[:, j * exact.shape[1] : (j + 1) * exact.shape[1]]
            error = (got - exact).abs().amax(-1)
            assert bool((error <= exact.abs().amax(-1) / 16).all())  # 3 mantissa bits, per-token scale
            assert not torch.equal(got, exact)
        raw = next(ShardSet(str(out)).samples(tensors=["features_scale"]))
        assert raw.features_scale.shape[1] == 2
        break
    with pytest.raises(ValueError, match="--feature-dtype 'int4'"):
        extract(tiny_qwen3_dir, prompts_file, tmp_path / "bad", layer_ids=[1], feature_dtype="int4", limit=1)


def test_memory_budget_sets_chunk_and_window(tiny_qwen3_dir, prompts_file, tmp_path):
    """A smaller --memory-budget gives chunks of fewer tokens (more record batches), same samples."""
    from pipeline.outdir.storage import split_memory_budget

    window, tokens = split_memory_budget(2 << 30, 5 * 5120 * 2)
    assert window == 1 << 30 and tokens == min(4096, (1 << 30) // (3 * 5 * 5120 * 2))
    big = extract(tiny_qwen3_dir, prompts_file, tmp_path / "big", layer_ids=[1])
    small = extract(tiny_qwen3_dir, prompts_file, tmp_path / "small", layer_ids=[1], memory_bytes=64 << 10)
    assert len(big["shards"][0]["batches"]) == 1 < len(small["shards"][0]["batches"])
    assert small["run"]["memory_bytes"] == 64 << 10
    one = [s.features for s in ShardSet(str(tmp_path / "big")).samples()]
    other = [s.features for s in ShardSet(str(tmp_path / "small")).samples()]
    assert all(torch.equal(a, b) for a, b in zip(one, other)) and len(one) == len(PROMPTS)


def test_out_as_pyarrow_uri(tiny_qwen3_dir, prompts_file, tmp_path):
    """--out may be any URI pyarrow.fs opens; file:// stands in for s3:// and gs:// here."""
    uri = (tmp_path / "out").as_uri()
    manifest = extract(tiny_qwen3_dir, prompts_file, uri, layer_ids=[3], limit=2, shard_bytes=1)
    assert manifest["complete"] and len(manifest["shards"]) == 2
    assert [s.sample_id for s in ShardSet(uri).samples()] == ["p0", "p1"]
    assert (tmp_path / "out" / "manifest.json").is_file()
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").is_file()  # through the same pyarrow.fs


@pytest.mark.slow
def test_smollm2_end_to_end(tmp_path):
    """The embedded default target, 3 bundled prompts, 16 new tokens; exact against a fresh forward."""
    from click.testing import CliRunner

    from specreplay.cli import main

    out = tmp_path / "smol"
    result = CliRunner().invoke(
        main,
        [
            "extract",
            "--model",
            "smollm2",
            "--prompts",
            "default",
            "--limit",
            "3",
            "--max-new-tokens",
            "16",
            "--out",
            str(out),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "specreplay inspect" in result.output and "make score" in result.output
    shard_set = ShardSet(str(out))
    assert shard_set.settings["layer_ids"] == build_target_layer_ids(30, 5)
    assert shard_set.manifest["target"]["hidden_size"] == 576
    model, tokenizer, info = load_target("smollm2", dtype="float32")
    records = {r.id: r for r in load_prompts("default", limit=3)}
    for sample in shard_set.samples():
        assert sample.features.shape == (sample.input_ids.numel(), 5 * 576)
        ids = sample.input_ids.tolist()
        prompt_ids, _ = render_prompt(records[sample.sample_id], tokenizer, None)
        assert ids[len(prompt_ids) :] == single_greedy(model, prompt_ids, info.stop_token_ids, 16)
        output = fresh(model, ids)
        expected = torch.cat([output.hidden_states[i + 1][0] for i in shard_set.settings["layer_ids"]], -1)
        assert torch.equal(sample.features, expected)
        values, indices = torch.topk(torch.log_softmax(output.logits[0, sample.prompt_len - 1 :], -1), 32, -1)
        assert torch.equal(sample.topk_ids, indices.to(torch.int32))
        assert torch.equal(sample.topk_logprobs, values)

    result = CliRunner().invoke(main, ["inspect", str(out)])
    assert result.exit_code == 0, result.output
    assert "3 in 1 shards" in result.output and "checksums       1/1 shards ok" in result.output


# ---------------------------------------------------------------------------------------------
# progress in tokens, and the tokenizer stored with the shards


class RecordingBar:
    """The progress protocol (specreplay/progress.py) recording every call instead of drawing."""

    made: list[RecordingBar] = []

    def __init__(self, total: int, desc: str, unit: str = "sample"):
        self.total, self.desc, self.unit = total, desc, unit
        self.updates: list[tuple[int, dict]] = []
        self.closed = False
        RecordingBar.made.append(self)

    def update(self, n: int = 1, **postfix) -> None:
        self.updates.append((n, postfix))

    def close(self) -> None:
        self.closed = True


def test_progress_counts_tokens_every_decode_step(tiny_qwen3_dir, prompts_file, tmp_path):
    """The bar counts tokens (given responses included), moves before the first batch is written,
    and its updates add up to its total."""
    RecordingBar.made = []
    config = ExtractConfig(
        model=tiny_qwen3_dir,
        prompts=prompts_file,
        out=str(tmp_path / "out"),
        max_new_tokens=MAX_NEW,
        batch_size=3,
        layer_ids=[1],
    )
    run_extract(config, progress=RecordingBar)
    (bar,) = RecordingBar.made
    given = {s.sample_id: s.response_len for s in ShardSet(str(tmp_path / "out")).samples() if not s.greedy}
    assert bar.unit == "tok" and bar.closed
    assert bar.total == (len(PROMPTS) - len(given)) * MAX_NEW + sum(given.values())
    assert sum(n for n, _ in bar.updates) == bar.total
    before_first_sample = [n for n, postfix in bar.updates if postfix["samples"] == f"0/{len(PROMPTS)}" and n > 0]
    assert len(before_first_sample) >= MAX_NEW  # one per decode step of the first batch, at least
    assert bar.updates[-1][1]["samples"] == f"{len(PROMPTS)}/{len(PROMPTS)}"


def test_token_counter_tops_up_early_stops(tiny_qwen3_dir):
    """A sequence that stops early counts its tokens up to its stop token; the batch then adds the
    budget it did not use, so a batch always adds rows x max_new_tokens."""
    from pipeline.extract.generate import TokenCounter, generate_batch

    seen = []
    counter = TokenCounter(3, [2], seen.append)
    counter.put(torch.tensor([[7, 8], [9, 10], [11, 12]]))  # the prompt: not counted
    for step in ([5, 2, 7], [2, 2, 8], [2, 2, 9]):
        counter.put(torch.tensor(step))
    assert seen == [3, 2, 1] and counter.counted == 6

    model, _, info = load_target(tiny_qwen3_dir, dtype="float32")
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    free = generate_batch(model, prompts, MAX_NEW, info.stop_token_ids, info.pad_token_id)
    stop = free[0].token_ids[3]  # make the 4th token of the first response a stop token
    counts = []
    stopped = generate_batch(model, prompts, MAX_NEW, [*info.stop_token_ids, stop], info.pad_token_id, counts.append)
    assert len(stopped[0].token_ids) == 4 and stopped[0].finish_reason == "eos"
    assert sum(counts) == len(prompts) * MAX_NEW
    assert counts[-1] == sum(MAX_NEW - len(r.token_ids) for r in stopped)  # the top-up
    assert counts[0] == len(prompts)


def test_tokenizer_is_stored_and_kept_on_resume(tiny_qwen3_dir, prompts_file, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    manifest = extract(tiny_qwen3_dir, prompts_file, out, layer_ids=[1], limit=3)
    stored = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    original = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    for sample in ShardSet(str(out)).samples():
        ids = sample.input_ids.tolist()
        assert stored.decode(ids) == original.decode(ids)
        assert [stored.decode([t]) for t in ids] == [original.decode([t]) for t in ids]
    files = manifest["tokenizer"]["files"]
    assert manifest["tokenizer"]["dir"] == "tokenizer" and "tokenizer.json" in files

    # An interrupted run: the manifest not complete, one sample to redo. A complete tokenizer is kept...
    when = {name: (out / "tokenizer" / name).stat().st_mtime_ns for name in files}
    interrupt(out)
    extract(tiny_qwen3_dir, prompts_file, out, layer_ids=[1], limit=3)
    assert {name: (out / "tokenizer" / name).stat().st_mtime_ns for name in files} == when
    # ...a half-written one is written again.
    interrupt(out)
    (out / "tokenizer" / "tokenizer.json").unlink()
    manifest = extract(tiny_qwen3_dir, prompts_file, out, layer_ids=[1], limit=3)
    assert manifest["complete"] and manifest["tokenizer"]["files"] == files
    assert AutoTokenizer.from_pretrained(str(out / "tokenizer")).decode([5, 6, 7]) == original.decode([5, 6, 7])


def interrupt(out: Path) -> None:
    """Make OUT look like an extract killed before its last shard: manifest not complete."""
    manifest = json.loads((out / "manifest.json").read_text())
    last = sorted((out / "shards").glob("*.arrow"))[-1]
    last.unlink()
    last.with_suffix(".json").unlink()
    (out / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))


def test_layer_id_L_is_the_final_hidden_state_before_the_norm(tiny_qwen3_dir, prompts_file, tmp_path):
    """Id L - 1 is transformers' hidden_states[L] (after the final norm); id L is the last layer's
    own output, before the norm, which speculators' before-layer id L and MTP heads read."""
    model, _, info = load_target(tiny_qwen3_dir, dtype="float32")
    last = info.num_layers
    extract(tiny_qwen3_dir, prompts_file, tmp_path / "out", layer_ids=[last - 1, last], limit=2)
    captured = []

    def keep(module, args, out):  # a decoder layer returns its hidden states, or a tuple led by them
        captured.append((out[0] if isinstance(out, (tuple, list)) else out)[0].clone())

    hook = model.model.layers[last - 1].register_forward_hook(keep)
    try:
        for sample in ShardSet(str(tmp_path / "out")).samples():
            captured.clear()
            output = fresh(model, sample.input_ids.tolist())
            post, pre = sample.features.chunk(2, dim=-1)
            assert torch.equal(post, output.hidden_states[last][0])
            assert torch.equal(pre, captured[0]) and not torch.allclose(pre, post)
            assert torch.allclose(model.model.norm(pre), post, atol=1e-5)  # the norm of the one is the other
    finally:
        hook.remove()
    with pytest.raises(UserError, match=rf"layer ids \[{last + 1}\] out of range.*id {last} the final hidden state"):
        extract(tiny_qwen3_dir, prompts_file, tmp_path / "bad", layer_ids=[last + 1], limit=1)
