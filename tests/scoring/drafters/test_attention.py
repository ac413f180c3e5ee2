"""The other attention backends equal the dense explicit-mask path (the reference).

flex (used on CUDA) runs eagerly on CPU: its unfused reference implementation applies the same
mask_mod the compiled GPU kernel does, so a wrong mask (context past the anchor, another
anchor's block, a window off by one) shows here without a GPU.

The test drafters have 4 query heads on 2 kv heads (grouped-query attention).

blockwise (the CPU default) plans tiles of anchors and chunks of context keys from the same
visibility rule; small key chunks and tiles here make several chunks per tile, masked edges,
skipped chunks and tiles mixing samples or anchors without context.
"""

import functools
import warnings

import polars as pl
import pytest
import torch

import proposers.toolkit.attention as drafter_module
from proposers.toolkit.attention import block_masks, blockwise_plan
from proposers.toolkit.conventions import Conventions
from tests.helpers.drafters import random_drafter
from tests.helpers.models import TINY_HIDDEN

TARGET = {"hidden_size": 32, "num_layers": 4, "vocab_size": 50}
KINDS = [
    pytest.param(dict(), id="full"),
    pytest.param(dict(layer_types=["sliding_attention", "full_attention"], window=3), id="sliding3+full"),
    pytest.param(
        dict(layer_types=["sliding_attention", "sliding_attention"], window=6, is_causal=False), id="sliding6-bidir"
    ),
    pytest.param(dict(is_causal=True), id="causal"),
]
# (key chunk, anchors per tile): the defaults (one chunk for these contexts), and small ones
SIZES = [
    pytest.param((drafter_module.KEY_CHUNK, drafter_module.TILE_ANCHORS), id="default-sizes"),
    pytest.param((4, 2), id="chunk4-tile2"),
]


def _drafter(layer_types=None, is_causal=None, window=None, seed=0, num_heads=4):
    fields = {"is_causal": is_causal} if is_causal is not None else {}
    if layer_types:
        fields.update(layer_types=layer_types, sliding_window=window)
    return random_drafter(
        target=TARGET,
        layers=2,
        block_size=4,
        layer_ids=(1, 2),
        num_heads=num_heads,
        intermediate_size=64,
        seed=seed,
        std=0.3,
        **fields,
    )


def _inputs(T: int, anchors: list[int]):
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(T, 64, generator=generator)
    embeds = torch.randn(len(anchors), 4, 32, generator=generator)
    return features, torch.tensor(anchors), embeds


def _run(drafter, features, anchors, embeds, attention, **kwargs):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return drafter(embeds, anchors, drafter.context_kv(features), attention=attention, **kwargs)


@pytest.fixture
def blockwise_sizes(monkeypatch):
    """Sets blockwise_plan's key chunk and tile size for the drafter's calls."""

    def set_sizes(key_chunk: int, tile_anchors: int) -> None:
        plan = functools.partial(blockwise_plan, key_chunk=key_chunk, tile_anchors=tile_anchors)
        monkeypatch.setattr(drafter_module, "blockwise_plan", plan)

    return set_sizes


@pytest.mark.parametrize("kind", KINDS)
def test_flex_equals_dense(kind):
    drafter = _drafter(**kind)
    features, anchors, embeds = _inputs(40, [1, 5, 6, 17, 30, 39])
    dense = _run(drafter, features, anchors, embeds, "dense")
    flex = _run(drafter, features, anchors, embeds, "flex")
    assert (dense - flex).abs().max() < 1e-5


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_blockwise_equals_dense(kind, sizes, blockwise_sizes):
    """Anchor 0 sees no context (the block alone); 39 sees 39 keys: ten chunks of 4."""
    blockwise_sizes(*sizes)
    drafter = _drafter(**kind)
    features, anchors, embeds = _inputs(40, [0, 1, 5, 6, 17, 30, 39])
    dense = _run(drafter, features, anchors, embeds, "dense")
    blockwise = _run(drafter, features, anchors, embeds, "blockwise")
    assert torch.isfinite(blockwise).all()
    assert (dense - blockwise).abs().max() < 1e-5


@pytest.mark.parametrize("offset", [1, -1])
@pytest.mark.parametrize("kind", KINDS)
def test_blockwise_packed_samples_and_context_offset(kind, offset, blockwise_sizes):
    """Walk mode: three samples of 15, 20 and 13 positions packed end to end, anchors of all of
    them in one chunk (out of order, one sample twice), a tile mixing samples' neighbours, and
    anchors that see no context under offset -1 (0 and 1 there: 1 + offset = 0 keys)."""
    blockwise_sizes(3, 2)
    drafter = _drafter(**kind)
    starts, lengths = [0, 15, 35], [15, 20, 13]
    sample = [1, 0, 2, 1, 2, 0, 1]
    positions = [19, 0, 1, 3, 12, 14, 9]
    features, _, embeds = _inputs(sum(lengths), positions)
    anchors, ctx_starts = torch.tensor(positions), torch.tensor([starts[s] for s in sample])
    options = {"ctx_starts": ctx_starts, "conventions": Conventions(context_offset=offset)}
    dense = _run(drafter, features, anchors, embeds, "dense", **options)
    blockwise = _run(drafter, features, anchors, embeds, "blockwise", **options)
    assert torch.isfinite(blockwise).all()
    assert (dense - blockwise).abs().max() < 1e-5


@pytest.mark.parametrize("window", [None, 3, 8])
@pytest.mark.parametrize("offset", [0, 1, -1])
def test_blockwise_plan_covers_exactly_the_visible_keys(window, offset):
    """Against `block_masks`: every visible key lies in a chunk of its anchor's tile; a chunk
    without a mask is visible to every query of its tile, a mask is block_masks'; no chunk that
    no query sees, so unseen keys (before a window, between far-apart anchors of one sample:
    40 and 50 share a tile, past the anchors) are skipped."""
    b, T = 4, 60
    anchors = torch.tensor([0, 2, 3, 40, 9, 10, 50, 1, 25])
    ctx_starts = torch.tensor([0, 0, 0, 0, 30, 30, 0, 30, 30])  # two samples of 30 positions
    plan = blockwise_plan(anchors, b, T, False, window, ctx_starts, offset, key_chunk=5, tile_anchors=3)
    visible = block_masks(anchors, b, T, False, window, ctx_starts, offset).ctx_visible  # [A, b, T]
    covered = torch.zeros_like(visible)
    for tile in plan.tiles:
        assert len(set(ctx_starts[tile.rows].tolist())) == 1  # one sample per tile
        for c0, c1, hidden in tile.chunks:
            keys = slice(tile.start + c0, tile.start + c1)
            seen = visible[tile.rows, :, keys]
            assert seen.any(), (tile, c0, c1)
            if hidden is None:
                assert seen.all(), (tile, c0, c1)
            else:  # the mask is block_masks' there
                assert torch.equal(~hidden[:, 0].expand_as(seen), seen), (tile, c0, c1)
            covered[tile.rows, :, keys] = True
        edges = [c for c0, c1, _ in tile.chunks for c in (c0, c1)]
        assert edges == sorted(edges)  # disjoint, in order
        assert all(c1 - c0 <= 5 for c0, c1, _ in tile.chunks)
    assert not (visible & ~covered).any()


# ---------------------------------------------------------------------------------------------
# through `score`: identical walks and drafts


def _score_tables(shards: str, ckpt: str, out: str, attention: str, anchors: str) -> dict[str, pl.DataFrame]:
    from scoring.config import ScoreConfig
    from scoring.score.run import run_score

    config = ScoreConfig(
        ckpts=[ckpt],
        shards=shards,
        out=out,
        tree_nodes=[4],
        attention=attention,
        anchors=anchors,
        walk_group_tokens=1000,  # walk mode: all samples in one group, so chunks mix samples
        anchor_drafts=True,
    )
    [outcome] = run_score(config)
    assert outcome.status == "scored", outcome.error
    tables = {"walk": pl.read_parquet(f"{outcome.out_dir}/walk.parquet", glob=False)}
    if anchors == "all":
        tables["anchors"] = pl.read_parquet(f"{outcome.out_dir}/anchors.parquet", glob=False)
    return tables


@pytest.mark.parametrize("anchors", ["all", "walk"])
def test_score_blockwise_gives_the_dense_walks_and_drafts(tmp_path, anchors, blockwise_sizes):
    """`score` with --attention blockwise vs dense: identical walks, identical draft blocks at
    every anchor (anchors.parquet), q(target) and KL within fp32 rounding. A vocabulary of 8
    (responses of 5 tokens) lets the random drafter's drafts be accepted now and then."""
    from bench.standins import write_synthetic_shards
    from scoring.fit import save_drafter

    blockwise_sizes(8, 3)
    shards = tmp_path / "shards"
    target = {"hidden_size": TINY_HIDDEN, "num_layers": 6, "vocab_size": 8}
    write_synthetic_shards(shards, [40, 33, 21, 27], TINY_HIDDEN, 8, 6, [1, 3], top_k=4, prompt_tokens=5)
    drafter = random_drafter(
        target=target, layers=2, block_size=4, layer_ids=(1, 3), std=0.3, seed=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=6,
    )  # fmt: skip
    ckpt = save_drafter(drafter, str(tmp_path / "drafter"))
    dense, blockwise = (
        _score_tables(str(shards), ckpt, str(tmp_path / name), name, anchors) for name in ("dense", "blockwise")
    )
    assert dense["walk"].equals(blockwise["walk"])
    if anchors == "all":
        floats = ["target_prob", "kl_topk", "expected_accepted_len"]
        exact = [c for c in dense["anchors"].columns if c not in floats]
        assert dense["anchors"].select(exact).equals(blockwise["anchors"].select(exact))
        for column in floats:
            a, b = (t[column].explode().cast(pl.Float64).to_numpy() for t in (dense["anchors"], blockwise["anchors"]))
            assert abs(a - b).max() < 1e-4, column


def test_auto_is_blockwise_on_cpu_and_flex_on_cuda():
    from scoring.replay.packing import ReplayOptions

    assert ReplayOptions(device="cpu").attention_backend == "blockwise"
    assert ReplayOptions(device="cuda:0").attention_backend == "flex"
    assert ReplayOptions(device="cpu", attention="dense").attention_backend == "dense"


def test_llama_cpp_block_attention_in_every_backend():
    """llama.cpp's graph (Conventions.llama_block): sliding layers bidirectional when is_causal is
    absent, their window hiding only earlier block keys; every backend computes it alike, and it
    is not the reference's (causal sliding layers)."""
    drafter = _drafter(layer_types=["sliding_attention", "sliding_attention"], window=2)
    features, anchors, embeds = _inputs(40, [0, 1, 5, 6, 17, 30, 39])
    llama = Conventions(llama_block=True)
    dense = _run(drafter, features, anchors, embeds, "dense", conventions=llama)
    for backend in ("flex", "blockwise"):
        assert (dense - _run(drafter, features, anchors, embeds, backend, conventions=llama)).abs().max() < 1e-5
    assert (dense - _run(drafter, features, anchors, embeds, "dense")).abs().max() > 1e-3
    assert block_masks(anchors, 4, 40, False, 2, both_ways=False).block_visible.tolist() == [
        [True, True, True, True],
        [True, True, True, True],
        [False, True, True, True],
        [False, False, True, True],
    ]
