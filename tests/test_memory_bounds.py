"""Memory bounds of scoring and extract (issue 4; bench/scale.py measures them at 27B shapes).

The changes these tests pin down keep values identical while holding less:
  - the scorer keeps the target embedding in its narrower stored dtype and casts only the
    gathered block rows (score.prepare_target_head, replay._score_chunk);
  - the drafter's context pass casts and projects the stored features a chunk of positions at a
    time, sized by the memory budget (DFlashDrafter.context_kv, replay.context_rows);
  - neither the score loop nor extract's capture loop keeps the previous sample's tensors alive
    while the next sample runs.
"""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

import scoring.replay as replay
import scoring.score as score
from pipeline import shards
from scoring.drafter import DFlashDrafter, parse_drafter_config
from scoring.fit import new_drafter_config, save_drafter
from scoring.replay import ReplayOptions, context_rows, pack_samples, replay_sample
from scoring.score import ScoreConfig, prepare_target_head, run_score

HIDDEN, VOCAB, TARGET_LAYERS, LAYER_IDS = 64, 512, 6, [1, 3]


def _drafter(block_size: int = 4, layers: int = 2, seed: int = 0, **extra) -> DFlashDrafter:
    raw = new_drafter_config({"hidden_size": HIDDEN, "num_layers": TARGET_LAYERS, "vocab_size": VOCAB},
                             num_layers=layers, block_size=block_size, layer_ids=LAYER_IDS, **extra)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(parse_drafter_config(raw, "test drafter"))
    with torch.no_grad():
        for param in drafter.parameters():
            param.normal_(0, 0.2)
    return drafter.eval()


def _sample(length: int = 40, prompt: int = 6, seed: int = 0, dtype=torch.bfloat16) -> shards.Sample:
    g = torch.Generator().manual_seed(seed)
    response = length - prompt
    return shards.Sample(
        sample_id=f"s{seed}", dataset="t", prompt_text="", input_ids=torch.randint(0, VOCAB, (length,), generator=g),
        prompt_len=prompt, finish_reason="given", greedy=False,
        tensors={"features": torch.randn(length, len(LAYER_IDS) * HIDDEN, generator=g).to(dtype),
                 "topk_ids": torch.randint(0, VOCAB, (response + 1, 8), generator=g, dtype=torch.int32),
                 "topk_logprobs": -torch.rand(response + 1, 8, generator=g).sort(dim=-1).values,
                 "argmax_mismatch": torch.zeros(response, dtype=torch.uint8)})


def _head(dtype=torch.bfloat16, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"embed_tokens": torch.randn(VOCAB, HIDDEN, generator=g).to(dtype),
            "lm_head": torch.randn(VOCAB, HIDDEN, generator=g).to(dtype)}


def _same(a: replay.AnchorTensors, b: replay.AnchorTensors) -> None:
    for name in replay.AnchorTensors.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x.nan_to_num(-7.0), y.nan_to_num(-7.0)) if x.is_floating_point() else torch.equal(x, y), name


def _close(a: replay.AnchorTensors, b: replay.AnchorTensors) -> None:
    for name in ("anchors", "block_len", "target_tokens", "computed", "draft_tokens", "tree_pop_index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("target_logprob", "kl_topk"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-5, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# the target head


def test_prepare_target_head_keeps_the_narrower_embedding():
    head = _head(torch.bfloat16)
    prepared = prepare_target_head(head, "cpu", torch.float32)
    assert prepared["embed_tokens"].dtype == torch.bfloat16  # gathered rows are cast, not the table
    assert prepared["embed_tokens"].data_ptr() == head["embed_tokens"].data_ptr()  # not even copied
    assert prepared["lm_head"].dtype == torch.float32
    assert torch.equal(prepared["lm_head"], head["lm_head"].float())

    wide = prepare_target_head(_head(torch.float32), "cpu", torch.bfloat16)  # fp32 shards scored in bf16
    assert wide["embed_tokens"].dtype == wide["lm_head"].dtype == torch.bfloat16
    same = prepare_target_head(_head(torch.float32), "cpu", torch.float32)
    assert same["embed_tokens"].dtype == torch.float32


def test_tied_head_gets_one_cast_lm_head_and_a_stored_embedding():
    table = torch.randn(VOCAB, HIDDEN).to(torch.bfloat16)
    prepared = prepare_target_head({"embed_tokens": table, "lm_head": table}, "cpu", torch.float32)
    assert prepared["embed_tokens"].dtype == torch.bfloat16 and prepared["lm_head"].dtype == torch.float32


def test_replay_with_stored_dtype_embedding_equals_cast_table():
    drafter, sample, head = _drafter(), _sample(), _head(torch.bfloat16)
    options = ReplayOptions(max_budget=8)
    columns = lambda f: f  # noqa: E731
    lm_head = head["lm_head"].float()
    kept = replay_sample(drafter, head["embed_tokens"], lm_head, sample, columns, 64, options)
    cast = replay_sample(drafter, head["embed_tokens"].float(), lm_head, sample, columns, 64, options)
    _same(kept, cast)


# ---------------------------------------------------------------------------------------------
# the context pass


@pytest.mark.parametrize("chunk_rows", [1, 5, 16, 39])
def test_context_kv_in_chunks_equals_one_pass(chunk_rows):
    drafter = _drafter(layers=2)
    features = torch.randn(40, len(LAYER_IDS) * HIDDEN)
    whole = drafter.context_kv(features)
    chunked = drafter.context_kv(features, chunk_rows=chunk_rows)
    for (k1, v1), (k2, v2) in zip(whole, chunked):
        assert k2.shape == k1.shape and v2.shape == v1.shape
        torch.testing.assert_close(k2, k1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-6)


def test_context_kv_casts_stored_features_like_a_cast_copy():
    drafter = _drafter()
    stored = torch.randn(40, len(LAYER_IDS) * HIDDEN).to(torch.bfloat16)
    # the shard reader hands out column-major views; chunks of such a view must work too
    view = stored.t().contiguous().t()
    reference = drafter.context_kv(stored.float())
    for got in (drafter.context_kv(view, dtype=torch.float32), drafter.context_kv(view, dtype=torch.float32,
                                                                                  chunk_rows=7)):
        for (k1, v1), (k2, v2) in zip(reference, got):
            assert k2.dtype == torch.float32
            torch.testing.assert_close(k2, k1, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-6)


def test_context_rows_follow_the_memory_budget():
    drafter = _drafter()
    width = len(LAYER_IDS) * HIDDEN
    small = context_rows(drafter, width, torch.float32, 1 << 20)
    large = context_rows(drafter, width, torch.float32, 1 << 30)
    assert small == replay.MIN_CONTEXT_ROWS < large
    assert context_rows(drafter, width, torch.bfloat16, 1 << 30) > large  # narrower values, more rows
    # 27B shapes, fp32, the default 2 GiB budget: ~2.7k positions a step, so an 8k-token sample never
    # holds an fp32 copy of all its features (8192 x 25600 x 4 bytes = 840 MB)
    big = parse_drafter_config(new_drafter_config({"hidden_size": 5120, "num_layers": 64, "vocab_size": 248320},
                                                  layer_ids=[1, 16, 31, 46, 61], num_heads=32), "27b")
    with torch.device("meta"):
        rows = context_rows(DFlashDrafter(big), 5 * 5120, torch.float32, 2 << 30)
    assert 2000 < rows < 4000


def test_replay_with_chunked_context_equals_one_pass(monkeypatch):
    drafter, sample, head = _drafter(block_size=4, layers=2), _sample(length=60), _head(torch.float32)
    columns = lambda f: f  # noqa: E731
    options = ReplayOptions(max_budget=4)
    whole = replay_sample(drafter, head["embed_tokens"], head["lm_head"], sample, columns, 64, options)
    monkeypatch.setattr(replay, "MIN_CONTEXT_ROWS", 8)
    small = ReplayOptions(max_budget=4, memory_bytes=1)  # 8 positions per context step, 1 anchor per chunk
    packed = pack_samples(drafter, [sample], columns, small)
    assert all(k.is_contiguous() and v.is_contiguous() for k, v in packed.context)
    chunked = replay_sample(drafter, head["embed_tokens"], head["lm_head"], sample, columns, 64, small)
    _close(whole, chunked)


# ---------------------------------------------------------------------------------------------
# one sample's tensors at a time


def test_score_does_not_keep_the_previous_sample_alive(tmp_path, monkeypatch):
    from bench.scale import write_synthetic_shards

    shard_dir = tmp_path / "shards"
    write_synthetic_shards(shard_dir, [24, 20, 16], HIDDEN, VOCAB, TARGET_LAYERS, LAYER_IDS, top_k=8, prompt_tokens=4)
    shardset = shards.ShardSet(str(shard_dir))
    raw = new_drafter_config(shardset.settings["target"], num_layers=1, block_size=4, layer_ids=LAYER_IDS)
    ckpt = save_drafter(DFlashDrafter(parse_drafter_config(raw, "t")), str(tmp_path / "drafter"))

    real, seen, alive_at_next = score.replay_sample, [], []

    def spy(drafter, embed, lm_head, sample, *args, **kwargs):
        gc.collect()
        alive_at_next.append([ref() is not None for ref in seen])
        seen.append(weakref.ref(sample))
        return real(drafter, embed, lm_head, sample, *args, **kwargs)

    monkeypatch.setattr(score, "replay_sample", spy)
    records = run_score(ScoreConfig(ckpts=[ckpt], shards=str(shard_dir), out=str(tmp_path / "out"),
                                    tree_nodes=[4], quiet=True))
    assert records and records[0]["anchors"] == (24 - 1) + (20 - 1) + (16 - 1)
    assert alive_at_next == [[], [False], [False, False]]
    summary = json.loads((tmp_path / "out" / "run.json").read_text())
    assert summary["dtype"] == "float32"


def test_extract_does_not_keep_the_previous_sample_alive(tmp_path, monkeypatch):
    import pipeline.capture as capture
    from pipeline.extract import Item, run_items

    dtypes = {"features": "float32", "topk_ids": "int32", "topk_logprobs": "float32", "argmax_mismatch": "uint8"}
    writer = shards.ShardWriter(str(tmp_path / "out"), 0, dtypes, chunk_tokens=1)  # every sample lands at once
    refs, alive_at_next = [], []

    def fake_capture(model, input_ids, prompt_len, config):
        gc.collect()
        alive_at_next.append([ref() is not None for ref in refs])
        response = len(input_ids) - prompt_len
        features = torch.randn(len(input_ids), 8)
        refs.append(weakref.ref(features))
        return {"features": features, "topk_ids": torch.zeros(response + 1, 2, dtype=torch.int32),
                "topk_logprobs": torch.zeros(response + 1, 2), "argmax_mismatch": torch.zeros(response, dtype=torch.uint8)}

    class Info:
        stop_token_ids, pad_token_id = [0], 0

    class Progress:
        def update(self, n):
            pass

        def set_postfix_str(self, *a, **k):
            pass

    monkeypatch.setattr(capture, "capture_sample", fake_capture)
    items = [Item(f"i{n}", "d", [1, 2, 3], "p", given=[4, 5, 6, 7]) for n in range(3)]
    run_items(None, Info(), items, writer, None, 8, 8, Progress())
    writer.close()
    assert alive_at_next == [[], [False], [False, False]]
