"""Parity of scoring.drafter with the public reference (`dflash.model.DFlashDraftModel`).

Each test builds a tiny reference drafter from a Qwen3Config, gives it random weights, saves it
in z-lab format (save_pretrained), loads it through scoring.checkpoint.load_drafter, and
compares outputs on the same inputs. fp32 throughout, so the tolerance is tight (1e-5): the
only differences allowed are matmul shapes and summation order.

`build_reference` is also used by test_checkpoint.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scoring.checkpoint import load_drafter

pytest.importorskip("dflash")
from dflash.model import DFlashDraftModel, _crop_to, _make_cache  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

TOL = 1e-5
HIDDEN, VOCAB, MASK = 32, 64, 60
TARGET_LAYERS = 6


def build_reference(save_dir=None, *, layers: int = 2, block_size: int = 4, layer_ids=(1, 3),
                    seed: int = 0, dflash_extra: dict | None = None, **fields) -> DFlashDraftModel:
    """A tiny reference drafter with random weights (normal, std 0.2: norms and all, so a
    weight loaded into the wrong slot shows); saved to `save_dir` in z-lab format when given.

    `layer_ids=None` leaves dflash_config.target_layer_ids out, so the ids come from
    num_target_layers. Extra keyword fields are set on the config (layer_types, sliding_window,
    is_causal, ...); `dflash_extra` goes into dflash_config (output_multiplier, ...).
    """
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as the real drafters
        head_dim=8,
        rms_norm_eps=1e-6,
    )
    config.architectures = ["DFlashDraftModel"]
    config.block_size = block_size
    config.num_target_layers = TARGET_LAYERS
    config.dflash_config = {"mask_token_id": MASK, **(dflash_extra or {})}
    if layer_ids is not None:
        config.dflash_config["target_layer_ids"] = list(layer_ids)
    for name, value in fields.items():
        setattr(config, name, value)
    if "sliding_window" in fields:
        # Qwen3Config drops sliding_window on load unless use_sliding_window is true; set it so
        # the saved config.json describes the same drafter as this in-memory reference.
        config.use_sliding_window = True
    torch.manual_seed(seed)
    model = DFlashDraftModel(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    if save_dir is not None:
        model.save_pretrained(str(save_dir))
    return model


def reference_and_ours(tmp_path, **kwargs):
    ref = build_reference(tmp_path / "drafter", **kwargs)
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
    ref, ours = reference_and_ours(
        tmp_path, layer_types=["sliding_attention", "full_attention"], sliding_window=3
    )
    assert ours.config.layer_is_causal(0) and not ours.config.layer_is_causal(1)
    assert_parity(ref, ours)


def test_sliding_window_wider_than_block_matches_reference(tmp_path):
    ref, ours = reference_and_ours(
        tmp_path, layers=3, layer_ids=(1, 2, 4), sliding_window=6,
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
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        lm_head.weight.normal_(0.0, 1.0)
        hidden = torch.randn(3, 4, HIDDEN)
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
