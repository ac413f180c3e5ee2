"""Memory bounds of scoring and extract (issue 4; `make bench` section memory,
bench/sections/memory.py, measures them at 27B shapes).

The changes these tests pin down keep values identical while holding less:
  - the scorer keeps the target embedding in its narrower stored dtype and casts only the
    gathered block rows (packing.prepare_target_head, chunk.score_chunk);
  - the drafter's context pass casts and projects the stored features a chunk of positions at a
    time, sized by the memory budget (BlockDrafter.context_kv, neural.context_rows), a step
    holding about a quarter of the budget, as measured here on the real pass;
  - neither the score loop nor extract's capture loop keeps the previous sample's tensors alive
    while the next sample runs.
"""

from __future__ import annotations

import gc
import json
import math
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import proposers.toolkit.neural as neural
import scoring.replay.anchors as replay
import scoring.replay.chunk as chunk
import scoring.score.steps as score
from pipeline import shards
from proposers.detect import parse_drafter_config
from proposers.dflash.model import DFlashDrafter
from proposers.interface import TargetHead
from proposers.toolkit.neural import context_rows, neural_proposer
from scoring.config import ScoreConfig
from scoring.fit import new_drafter_config, save_drafter
from scoring.replay.anchors import replay_sample
from scoring.replay.packing import ReplayOptions, pack_samples, prepare_target_head
from scoring.score.run import run_score
from tests.helpers.drafters import random_drafter
from tests.helpers.memory import LiveBytes
from tests.helpers.models import TINY_HIDDEN as HIDDEN, TINY_TARGET, TINY_VOCAB as VOCAB

TARGET_LAYERS, LAYER_IDS = TINY_TARGET["num_layers"], [1, 3]


def _drafter(block_size: int = 4, layers: int = 2, seed: int = 0, **config) -> DFlashDrafter:
    return random_drafter(layers=layers, block_size=block_size, layer_ids=LAYER_IDS, seed=seed, **config)


class _NewTensors(TorchDispatchMode):
    """Records (shape, dtype) of every tensor an aten op allocates while active: results, copies
    and casts, not views (an output sharing storage with an input is not recorded)."""

    def __init__(self):
        super().__init__()
        self.allocated: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in inputs:
                self.allocated.append((tuple(t.shape), t.dtype))
        return out


def _sample(length: int = 40, prompt: int = 6, seed: int = 0, dtype=torch.bfloat16) -> shards.Sample:
    g = torch.Generator().manual_seed(seed)
    response = length - prompt
    return shards.Sample(
        sample_id=f"s{seed}",
        dataset="t",
        prompt_text="",
        input_ids=torch.randint(0, VOCAB, (length,), generator=g),
        prompt_len=prompt,
        finish_reason="given",
        greedy=False,
        tensors={
            "features": torch.randn(length, len(LAYER_IDS) * HIDDEN, generator=g).to(dtype),
            "topk_ids": torch.randint(0, VOCAB, (response + 1, 8), generator=g, dtype=torch.int32),
            "topk_logprobs": -torch.rand(response + 1, 8, generator=g).sort(dim=-1).values,
            "argmax_mismatch": torch.zeros(response, dtype=torch.uint8),
        },
    )


def _head(dtype=torch.bfloat16, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed_tokens": torch.randn(VOCAB, HIDDEN, generator=g).to(dtype),
        "lm_head": torch.randn(VOCAB, HIDDEN, generator=g).to(dtype),
    }


def _tensors(result: replay.AnchorTensors) -> dict:
    """Every per-anchor tensor of a result, the methods' data included."""
    fields = {
        name: getattr(result, name) for name in replay.AnchorTensors.__dataclass_fields__ if name != "method_data"
    }
    return {**fields, **{f"method {kind}": data for kind, data in result.method_data.items()}}


def _same(a: replay.AnchorTensors, b: replay.AnchorTensors) -> None:
    mine, theirs = _tensors(a), _tensors(b)
    assert mine.keys() == theirs.keys()
    for name, x in mine.items():
        y = theirs[name]
        assert torch.equal(x.nan_to_num(-7.0), y.nan_to_num(-7.0)) if x.is_floating_point() else torch.equal(x, y), name


def _close(a: replay.AnchorTensors, b: replay.AnchorTensors) -> None:
    for name in ("anchors", "block_len", "target_tokens", "computed", "draft_tokens", "method ddtree"):
        assert torch.equal(_tensors(a)[name], _tensors(b)[name]), name
    for name in ("target_logprob", "kl_topk"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-5, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# the target head


def test_prepare_target_head_keeps_the_narrower_embedding():
    head = _head(torch.bfloat16)
    prepared = prepare_target_head(head, "cpu", torch.float32)
    assert prepared.embed.dtype == torch.bfloat16  # gathered rows are cast, not the table
    assert prepared.embed.data_ptr() == head["embed_tokens"].data_ptr()  # not even copied
    assert prepared.lm_head.dtype == torch.float32
    assert torch.equal(prepared.lm_head, head["lm_head"].float())

    wide = prepare_target_head(_head(torch.float32), "cpu", torch.bfloat16)  # fp32 shards scored in bf16
    assert wide.embed.dtype == wide.lm_head.dtype == torch.bfloat16
    same = prepare_target_head(_head(torch.float32), "cpu", torch.float32)
    assert same.embed.dtype == torch.float32


def test_tied_head_gets_one_cast_lm_head_and_a_stored_embedding():
    table = _head(torch.bfloat16)["embed_tokens"]
    prepared = prepare_target_head({"embed_tokens": table, "lm_head": table}, "cpu", torch.float32)
    assert prepared.embed.dtype == torch.bfloat16 and prepared.lm_head.dtype == torch.float32


def test_replay_never_widens_the_stored_dtype_embedding():
    # input_embedding_scale 2.5 (binary 10.1): a bf16 row times 2.5 needs 10 significant bits, so
    # scaling (or any arithmetic) done on the rows before they are cast rounds, and the bit-exact
    # comparison with the fp32 table below fails; with the default scale 1.0 it could not.
    drafter = _drafter(dflash_extra={"input_embedding_scale": 2.5})
    sample, head = _sample(), _head(torch.bfloat16)
    options = ReplayOptions(methods={"ddtree": (8,)})
    columns = lambda f: f  # noqa: E731
    lm_head, proposer = head["lm_head"].float(), neural_proposer(drafter)
    with _NewTensors() as spy:
        kept = replay_sample(proposer, TargetHead(head["embed_tokens"], lm_head), sample, columns, 64, options)
    cast = replay_sample(proposer, TargetHead(head["embed_tokens"].float(), lm_head), sample, columns, 64, options)
    _same(kept, cast)
    # The memory claim itself: no copy of the [VOCAB, HIDDEN] table in any dtype is ever made.
    copies = [allocated for allocated in spy.allocated if allocated[0] == (VOCAB, HIDDEN)]
    assert not copies, copies
    with _NewTensors() as control:  # the spy does see a cast of the table
        head["embed_tokens"].float()
    assert control.allocated == [((VOCAB, HIDDEN), torch.float32)]


# ---------------------------------------------------------------------------------------------
# the context pass


@pytest.mark.parametrize("chunk_rows", [1, 5, 16, 39])
def test_context_kv_in_chunks_equals_one_pass(chunk_rows):
    drafter = _drafter(layers=2)
    features = torch.randn(40, len(LAYER_IDS) * HIDDEN, generator=torch.Generator().manual_seed(1))
    whole = drafter.context_kv(features)
    chunked = drafter.context_kv(features, chunk_rows=chunk_rows)
    for (k1, v1), (k2, v2) in zip(whole, chunked):
        assert k2.shape == k1.shape and v2.shape == v1.shape
        torch.testing.assert_close(k2, k1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-6)


def test_context_kv_casts_chunks_and_never_holds_a_cast_copy():
    drafter = _drafter()
    width = len(LAYER_IDS) * HIDDEN
    stored = torch.randn(40, width, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    # the shard reader hands out column-major views; chunks of such a view must work too
    view = stored.t().contiguous().t()
    reference = drafter.context_kv(stored.float())
    with _NewTensors() as whole:
        got_whole = drafter.context_kv(view, dtype=torch.float32)
    with _NewTensors() as chunked:
        got_chunked = drafter.context_kv(view, dtype=torch.float32, chunk_rows=7)
    for got in (got_whole, got_chunked):
        for (k1, v1), (k2, v2) in zip(reference, got):
            assert k2.dtype == torch.float32
            torch.testing.assert_close(k2, k1, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-6)
    # one pass casts all 40 rows at once (so the spy sees such a copy); 7-row chunks never
    # cast more than 7 rows: no fp32 tensor of the features' width has more rows than a chunk
    assert ((40, width), torch.float32) in whole.allocated
    cast_rows = [shape[0] for shape, dtype in chunked.allocated if dtype == torch.float32 and shape[-1] == width]
    assert cast_rows and max(cast_rows) <= 7, chunked.allocated


def _context_step_bytes(drafter: DFlashDrafter, rows: int, dtype: torch.dtype) -> int:
    """What one step of `rows` positions of the context pass holds, measured: the peak bytes alive
    while context_kv runs over 3 x rows stored bf16 positions in steps of `rows`, less its outputs
    (every position's keys and values, allocated before the first step and kept)."""
    g = torch.Generator().manual_seed(4)
    stored = torch.randn(3 * rows, len(LAYER_IDS) * HIDDEN, generator=g).to(torch.bfloat16)
    with torch.inference_mode(), LiveBytes() as spy:
        kv = drafter.context_kv(stored, dtype=dtype, chunk_rows=rows)
    return spy.peak - sum(t.untyped_storage().nbytes() for pair in kv for t in pair)


def test_context_rows_follow_the_memory_budget():
    """A step of the context pass holds about a quarter of the memory budget, the rest being the
    anchors' chunks: measured on the real pass (not from the sizes context_rows assumes), a step of
    context_rows positions holds at most a quarter (10% slack for the temporaries of the day) and
    more than half of that (a step far smaller than the budget allows would shrink the GEMMs for
    nothing), wherever the bounds do not decide."""
    drafter = _drafter()
    width = len(LAYER_IDS) * HIDDEN
    low, high = neural.MIN_CONTEXT_ROWS, neural.MAX_CONTEXT_ROWS
    # a budget whose quarter holds a step of about (low + high) / 2 positions, by measurement
    budget = 4 * _context_step_bytes(drafter, 64, torch.float32) * (low + high) // 2 // 64
    rows = context_rows(drafter, width, torch.float32, budget)
    assert low < rows < high, (rows, budget)
    step = _context_step_bytes(drafter, rows, torch.float32)
    assert budget / 8 < step <= 1.1 * budget / 4, (rows, step, budget)
    assert context_rows(drafter, width, torch.bfloat16, budget) > rows  # narrower values, more rows
    assert context_rows(drafter, width, torch.float32, 1 << 10) == low
    assert context_rows(drafter, width, torch.float32, 1 << 30) == high
    # 27B shapes, fp32, the default 2 GiB budget: the budget would allow ~2.7k positions a step;
    # capped, a 2048- and an 8192-token sample run steps of the same size (flat in T), and an
    # 8k-token sample never holds an fp32 copy of all its features (8192 x 25600 x 4 = 840 MB)
    big = parse_drafter_config(
        new_drafter_config(
            {"hidden_size": 5120, "num_layers": 64, "vocab_size": 248320}, layer_ids=[1, 16, 31, 46, 61], num_heads=32
        ),
        "27b",
    )
    with torch.device("meta"):
        assert context_rows(DFlashDrafter(big), 5 * 5120, torch.float32, 2 << 30) == neural.MAX_CONTEXT_ROWS
        assert context_rows(DFlashDrafter(big), 5 * 5120, torch.float32, 1 << 29) < neural.MAX_CONTEXT_ROWS


def test_replay_with_chunked_context_equals_one_pass(monkeypatch):
    drafter, sample, head = _drafter(block_size=4, layers=2), _sample(length=60), _head(torch.float32)
    columns = lambda f: f  # noqa: E731
    options = ReplayOptions(methods={"ddtree": (4,)})
    proposer, target = neural_proposer(drafter), TargetHead(head["embed_tokens"], head["lm_head"])
    whole = replay_sample(proposer, target, sample, columns, 64, options)
    monkeypatch.setattr(neural, "MIN_CONTEXT_ROWS", 8)
    small = ReplayOptions(methods={"ddtree": (4,)}, memory_bytes=1)  # 8 positions per context step, 1 anchor per chunk
    packed = pack_samples(proposer, [sample], columns, small, target)
    assert all(k.is_contiguous() and v.is_contiguous() for k, v in packed.state)
    chunked = replay_sample(proposer, target, sample, columns, 64, small)
    _close(whole, chunked)


# ---------------------------------------------------------------------------------------------
# one sample's tensors at a time


def test_score_does_not_keep_the_previous_sample_alive(tmp_path, monkeypatch):
    from bench.standins import write_synthetic_shards

    shard_dir = tmp_path / "shards"
    write_synthetic_shards(shard_dir, [24, 20, 16], HIDDEN, VOCAB, TARGET_LAYERS, LAYER_IDS, top_k=8, prompt_tokens=4)
    ckpt = save_drafter(_drafter(layers=1), str(tmp_path / "drafter"))

    real, seen, alive_at_next = score.replay_sample, [], []

    def spy(drafter, embed, lm_head, sample, *args, **kwargs):
        gc.collect()
        alive_at_next.append([ref() is not None for ref in seen])
        seen.append(weakref.ref(sample))
        return real(drafter, embed, lm_head, sample, *args, **kwargs)

    monkeypatch.setattr(score, "replay_sample", spy)
    [outcome] = run_score(ScoreConfig(ckpts=[ckpt], shards=str(shard_dir), out=str(tmp_path / "out"), tree_nodes=[4]))
    assert outcome.status == "scored" and outcome.record["anchors"] == (24 - 1) + (20 - 1) + (16 - 1)
    assert alive_at_next == [[], [False], [False, False]]
    summary = json.loads((Path(outcome.out_dir) / "run.json").read_text())
    assert summary["dtype"] == "float32"


def test_extract_does_not_keep_the_previous_sample_alive(tmp_path, monkeypatch):
    import pipeline.extract.capture as capture
    from pipeline.extract.plan import Item
    from pipeline.extract.run import run_items

    dtypes = {"features": "float32", "topk_ids": "int32", "topk_logprobs": "float32", "argmax_mismatch": "uint8"}
    writer = shards.ShardWriter(str(tmp_path / "out"), 0, dtypes, chunk_tokens=1)  # every sample lands at once
    refs, alive_at_next = [], []

    def fake_capture(model, input_ids, prompt_len, config):
        gc.collect()
        alive_at_next.append([ref() is not None for ref in refs])
        response = len(input_ids) - prompt_len
        features = torch.randn(len(input_ids), 8)
        refs.append(weakref.ref(features))
        return {
            "features": features,
            "topk_ids": torch.zeros(response + 1, 2, dtype=torch.int32),
            "topk_logprobs": torch.zeros(response + 1, 2),
            "argmax_mismatch": torch.zeros(response, dtype=torch.uint8),
        }

    class Info:
        stop_token_ids, pad_token_id = [0], 0

    class Progress:
        def update(self, n, **postfix):
            pass

    monkeypatch.setattr(capture, "capture_sample", fake_capture)
    items = [Item(f"i{n}", "d", [1, 2, 3], "p", given=[4, 5, 6, 7]) for n in range(3)]
    run_items(None, Info(), items, writer, None, 8, 8, Progress())
    writer.close()
    assert alive_at_next == [[], [False], [False, False]]


# ---------------------------------------------------------------------------------------------
# the vocabulary's logsumexp


def test_logsumexp_rows_equals_one_call_and_never_holds_the_whole_temporary():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(7, 5, 300, generator=g) * 30  # 35 rows: two full groups of 16 and a remainder
    scores[0, 0] = float("-inf")  # a row with nothing allowed: -inf, as torch.logsumexp
    scores[1, 2, :7] = 1e30  # large values: the max is subtracted first
    scores[2, 1, :] = 4.0  # all equal
    with _Calls() as spy:
        got = chunk.logsumexp_rows(scores)
    want = torch.logsumexp(scores, dim=-1)
    assert got.shape == want.shape == (7, 5)
    assert torch.equal(got.nan_to_num(-7.0), want.nan_to_num(-7.0))  # bit for bit, -inf included
    # each logsumexp sees at most LSE_ROWS rows of the vocabulary, so its internal temporary
    # (max-shifted exponentials) is that small; one call would see all 35
    rows = [math.prod(shape[:-1]) for name, shape in spy.calls if "logsumexp" in name and shape[-1] == 300]
    assert len(rows) == 3 and max(rows) == chunk.LSE_ROWS, spy.calls


class _Calls(TorchDispatchMode):
    """Records (op name, first input's shape) of every aten op run while active."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor)), None)
        self.calls.append((str(func), tuple(first.shape) if first is not None else ()))
        return func(*args, **(kwargs or {}))
