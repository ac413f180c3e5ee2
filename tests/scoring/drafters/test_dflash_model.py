"""Parity of proposers.dflash.config with the public reference (`dflash.model.DFlashDraftModel`).

Each test builds a tiny reference drafter with random weights (tests/helpers/drafters.py, reference_drafter),
saves it in z-lab format (save_pretrained), loads it through proposers.checkpoints.load.load_drafter, and
compares outputs on the same inputs. fp32 throughout, so the tolerance is tight (1e-5): the
only differences allowed are matmul shapes and summation order.
"""

from __future__ import annotations

import pytest
import torch
from dflash.model import DFlashDraftModel, _crop_to, _make_cache
from torch import nn

from proposers.checkpoints.load import load_drafter
from tests.helpers.drafters import REFERENCE_HIDDEN as HIDDEN, REFERENCE_VOCAB as VOCAB, reference_drafter

TOL = 1e-5


def reference_and_ours(tmp_path, **kwargs):
    ref = reference_drafter(tmp_path / "drafter", **kwargs)
    ours, _ = load_drafter(str(tmp_path / "drafter"))
    return ref, ours


def random_inputs(ref: DFlashDraftModel, length: int, seed: int = 1):
    """Target features [T, n*H] and block embeddings [T, B, H] (one block per anchor)."""
    generator = torch.Generator().manual_seed(seed)
    n = len(ref.target_layer_ids)
    features = torch.randn(length, n * HIDDEN, generator=generator)
    embeds = torch.randn(length, ref.block_size, HIDDEN, generator=generator)
    return features, embeds


@torch.no_grad()
def reference_block(ref, features, embeds, anchor):
    """The reference, uncached: context = features of positions 0..anchor-1, block after it."""
    b = embeds.shape[0]
    return ref(
        position_ids=torch.arange(anchor + b)[None],
        noise_embedding=embeds[None],
        target_hidden=features[None, :anchor],
    )[0]


@torch.no_grad()
def assert_parity(ref, ours, length=12, anchors=(1, 2, 5, 8, 11), block_len=None):
    features, embeds = random_inputs(ref, length)
    context = ours.context_kv(features)
    for t in anchors:
        block = embeds[t, :block_len]
        expected = reference_block(ref, features, block, t)
        got = ours(block[None], torch.tensor([t]), context)[0]
        diff = (got - expected).abs().max().item()
        assert diff <= TOL, f"anchor {t}: max abs diff {diff:.3g} > {TOL}"


# ---------------------------------------------------------------------------------------------
# one anchor at a time vs the reference


def test_full_attention_matches_reference(tmp_path):
    ref, ours = reference_and_ours(tmp_path)
    assert_parity(ref, ours)


def test_sliding_layer_matches_reference(tmp_path):
    # Window 3 < block 4 < most anchors: both the context cut and the in-block cut are exercised.
    ref, ours = reference_and_ours(tmp_path, layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    assert ours.config.layer_is_causal(0) and not ours.config.layer_is_causal(1)
    assert_parity(ref, ours)


def test_sliding_window_wider_than_block_matches_reference(tmp_path):
    ref, ours = reference_and_ours(
        tmp_path,
        layers=3,
        layer_ids=(1, 2, 4),
        sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )
    assert_parity(ref, ours, length=14, anchors=(1, 4, 6, 7, 13))


def test_is_causal_true_matches_reference(tmp_path):
    ref, ours = reference_and_ours(tmp_path, is_causal=True)
    assert ours.config.is_causal is True
    assert_parity(ref, ours)


def test_sliding_but_not_causal_matches_reference(tmp_path):
    # is_causal=False overrides the sliding layer: a bidirectional window inside the block.
    ref, ours = reference_and_ours(
        tmp_path, is_causal=False, layer_types=["sliding_attention", "full_attention"], sliding_window=2
    )
    assert not ours.config.layer_is_causal(0)
    assert_parity(ref, ours)


def test_truncated_tail_block_matches_reference(tmp_path):
    # Near max_length the online loop drafts a shorter block; parity must hold there too.
    ref, ours = reference_and_ours(tmp_path, layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    for block_len in (2, 3):
        assert_parity(ref, ours, anchors=(3, 9), block_len=block_len)


def test_default_layer_ids_match_reference(tmp_path):
    # No explicit target_layer_ids: both sides derive them from num_target_layers.
    ref, ours = reference_and_ours(tmp_path, layers=3, layer_ids=None)
    assert ours.config.target_layer_ids == list(ref.target_layer_ids)
    assert_parity(ref, ours)


def test_logit_scaling_and_softcapping_match_reference(tmp_path):
    extra = {"input_embedding_scale": 2.5, "output_multiplier": 0.7, "final_logit_softcapping": 3.0}
    ref, ours = reference_and_ours(tmp_path, dflash_extra=extra)
    config = ours.config
    assert (config.input_embedding_scale, config.output_multiplier, config.final_logit_softcapping) == (2.5, 0.7, 3.0)
    generator = torch.Generator().manual_seed(2)
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        lm_head.weight.normal_(0.0, 1.0, generator=generator)
        hidden = torch.randn(3, 4, HIDDEN, generator=generator)
        expected = ref.compute_logits(hidden, lm_head)
        got = ours.logits(hidden, lm_head.weight)
    assert (expected.abs() > 1.0).any(), "soft-capping must actually bite in this test"
    assert (got - expected).abs().max().item() <= TOL


def test_scaled_embeddings_forward_matches_reference(tmp_path):
    # The reference scales the target's embeddings before the drafter; so does the replay.
    ref, ours = reference_and_ours(tmp_path, dflash_extra={"input_embedding_scale": 2.5})
    features, embeds = random_inputs(ref, 10)
    embeds = embeds * ours.config.input_embedding_scale
    with torch.no_grad():
        context = ours.context_kv(features)
        for t in (2, 7):
            expected = reference_block(ref, features, embeds[t], t)
            got = ours(embeds[t][None], torch.tensor([t]), context)[0]
            assert (got - expected).abs().max().item() <= TOL


# ---------------------------------------------------------------------------------------------
# batched anchors and the cached online loop


@torch.no_grad()
def test_batched_anchors_equal_one_at_a_time(tmp_path):
    ref, ours = reference_and_ours(tmp_path, layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    length = 16
    features, embeds = random_inputs(ref, length)
    context = ours.context_kv(features)
    anchors = torch.arange(1, length)
    batched = ours(embeds[1:], anchors, context)
    for row, t in enumerate(anchors.tolist()):
        single = ours(embeds[t][None], torch.tensor([t]), context)[0]
        assert (batched[row] - single).abs().max().item() <= TOL, f"anchor {t}"
        expected = reference_block(ref, features, embeds[t], t)
        assert (batched[row] - expected).abs().max().item() <= TOL, f"anchor {t} vs reference"


@torch.no_grad()
@pytest.mark.parametrize("fields", [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}])
def test_cached_online_loop_matches(tmp_path, fields):
    """The reference as dflash_generate drives it: a DynamicCache grown step by step with only
    the newly accepted positions' features, cropped back to `start` after each draft."""
    ref, ours = reference_and_ours(tmp_path, **fields)
    length, prompt_len = 24, 5
    features, embeds = random_inputs(ref, length)
    context = ours.context_kv(features)
    cache = _make_cache(ref.config)
    produced_per_step = [1, 3, 4, 2, 1, 4, 2]  # the accepted-token counts a verify step would give
    start, new_from = prompt_len, 0
    for produced in produced_per_step:
        b = min(ref.block_size, length - start)
        target_hidden = features[None, new_from:start]
        expected = ref(
            target_hidden=target_hidden,
            noise_embedding=embeds[start, :b][None],
            position_ids=torch.arange(start - target_hidden.shape[1], start + b)[None],
            past_key_values=cache,
            use_cache=True,
        )[0]
        _crop_to(cache, start)
        got = ours(embeds[start, :b][None], torch.tensor([start]), context)[0]
        assert (got - expected).abs().max().item() <= TOL, f"step at start {start}"
        new_from, start = start, start + produced
    assert start <= length
