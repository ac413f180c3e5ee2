"""Every convention switch of the replay (proposers/toolkit/conventions.py) against the same change made by
hand in the public reference drafter's forward (`dflash.model.DFlashDraftModel`).

The replay path is the one `score` and `diagnose` use (pack_samples -> the proposer's drafts); the
reference gets its inputs built here: shifted position ids, a longer or shorter context, an
explicit block mask, its attention modules' windows edited, the scales left out, features
picked from hidden_states[i] instead of [i + 1]. fp32, max abs diff of logits <= 1e-5, and
each switch must really change the logits (a no-op switch would pass the parity trivially).
"""

from __future__ import annotations

import pytest
import torch
from dflash.model import extract_context_feature

from pipeline.shards import Sample
from proposers.checkpoints.load import load_drafter
from proposers.interface import Chunk, TargetHead
from proposers.toolkit.conventions import REFERENCE, Conventions
from proposers.toolkit.neural import neural_proposer
from scoring.replay.packing import ReplayOptions, pack_samples
from tests.helpers.drafters import REFERENCE_HIDDEN as HIDDEN, REFERENCE_VOCAB as VOCAB, reference_drafter

TOL = 1e-5
N, PROMPT, BLOCK = 16, 3, 4
ANCHORS = (3, 5, 9, 12)
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}
SCALES = {"dflash_extra": {"input_embedding_scale": 2.0, "output_multiplier": 0.5, "final_logit_softcapping": 3.0}}


def _inputs(features_width: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 8, (N,), generator=g)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=g) * 0.3
    features = torch.randn(N, features_width, generator=g)
    return ids, embed, lm_head, features


def _sample(ids, features) -> Sample:
    rows = N - PROMPT + 1
    tensors = {
        "features": features,
        "topk_ids": torch.zeros(rows, 2, dtype=torch.long),
        "topk_logprobs": torch.zeros(rows, 2),
    }
    return Sample("s", "d", "", ids, PROMPT, "given", False, tensors)


def chunk_logits(proposer, target, packed, options) -> torch.Tensor:
    """[anchors, BLOCK - 1, V] of the blocks at ANCHORS of the packed sample."""
    anchors = torch.tensor(ANCHORS)
    with torch.inference_mode():
        return proposer.chunk_drafts(packed, Chunk(torch.zeros_like(anchors), anchors, BLOCK), target, options).logits


def replay_logits(ours, ids, embed, lm_head, features, conventions: Conventions) -> torch.Tensor:
    """[anchors, BLOCK - 1, V] from the replay under `conventions`."""
    options = ReplayOptions(methods={}, conventions=conventions)
    proposer, target = neural_proposer(ours), TargetHead(embed, lm_head)
    packed = pack_samples(proposer, [_sample(ids, features)], lambda f: f, options, target)
    return chunk_logits(proposer, target, packed, options)


@torch.no_grad()
def reference_logits(ref, ids, embed, lm_head, features, *, positions=0, context=0, causal=False, scales=True):
    """The reference forward per anchor with the change made by hand, stacked like replay_logits."""
    out = []
    extra = ref.config.dflash_config
    for t in ANCHORS:
        block = torch.full((BLOCK,), ref.mask_token_id)
        block[0] = ids[t]
        emb = torch.nn.functional.embedding(block, embed) * (extra.get("input_embedding_scale", 1.0) if scales else 1.0)
        c = t + context  # context positions 0 .. c - 1
        position_ids = torch.cat([torch.arange(c), t + positions + torch.arange(BLOCK)])[None]
        mask = None
        if causal:  # context all visible, the block lower-triangular
            mask = torch.cat([torch.ones(BLOCK, c, dtype=torch.bool), torch.ones(BLOCK, BLOCK).tril().bool()], 1)
            mask = mask[None, None]
        hidden = ref(
            position_ids=position_ids, noise_embedding=emb[None], target_hidden=features[None, :c], attention_mask=mask
        )
        head = lambda h: torch.nn.functional.linear(h, lm_head)  # noqa: E731
        out.append((ref.compute_logits(hidden[:, 1:], head) if scales else head(hidden[:, 1:]))[0])
    return torch.stack(out)


def drafters(tmp_path, **config):
    ref = reference_drafter(tmp_path / "drafter", layer_ids=(1, 3), **config)
    ours, _ = load_drafter(str(tmp_path / "drafter"))
    return ref, ours


def assert_switch(ref, ours, conventions: Conventions, **by_hand):
    ids, embed, lm_head, features = _inputs(2 * HIDDEN)
    got = replay_logits(ours, ids, embed, lm_head, features, conventions)
    expected = reference_logits(ref, ids, embed, lm_head, features, **by_hand)
    diff = (got - expected).abs().max().item()
    assert diff <= TOL, f"{conventions}: max abs diff {diff:.3g} vs the reference changed by hand"
    baseline = replay_logits(ours, ids, embed, lm_head, features, REFERENCE)
    assert (got - baseline).abs().max().item() > 1e-3, f"{conventions} changes nothing"


@pytest.mark.parametrize(
    "conventions, by_hand",
    [
        (Conventions(block_position_offset=1), {"positions": 1}),
        (Conventions(block_position_offset=-1), {"positions": -1}),
        (Conventions(context_offset=1), {"context": 1}),
        (Conventions(context_offset=-1), {"context": -1}),
        (Conventions(causal_block=True), {"causal": True}),
    ],
    ids=["positions+1", "positions-1", "context+1", "context-1", "causal-block"],
)
def test_switch_equals_reference_changed_by_hand(tmp_path, conventions, by_hand):
    ref, ours = drafters(tmp_path)
    assert_switch(ref, ours, conventions, **by_hand)


def test_reference_conventions_equal_reference(tmp_path):
    ref, ours = drafters(tmp_path, **SCALES)
    ids, embed, lm_head, features = _inputs(2 * HIDDEN)
    got = replay_logits(ours, ids, embed, lm_head, features, REFERENCE)
    assert (got - reference_logits(ref, ids, embed, lm_head, features)).abs().max().item() <= TOL


def test_neutral_scales_equal_reference_without_scales(tmp_path):
    ref, ours = drafters(tmp_path, **SCALES)
    assert ours.config.has_scales
    assert_switch(ref, ours, Conventions(neutral_scales=True), scales=False)


def _edit_windows(ref, window_of):
    """Set each reference attention module's window by hand: window_of(layer index, its window)."""
    for index, layer in enumerate(ref.layers):
        layer.self_attn.sliding_window = window_of(index, layer.self_attn.sliding_window)


def test_no_window_equals_reference_with_window_dropped(tmp_path):
    ref, ours = drafters(tmp_path, **SLIDING)
    _edit_windows(ref, lambda index, window: None)  # the sliding layer stays causal
    assert_switch(ref, ours, Conventions(window="none"))


def test_window_everywhere_equals_reference_with_window_on_every_layer(tmp_path):
    ref, ours = drafters(tmp_path, **SLIDING)
    _edit_windows(ref, lambda index, window: SLIDING["sliding_window"])  # the full layer stays bidirectional
    assert_switch(ref, ours, Conventions(window="everywhere"))


def test_context_switch_keeps_windows_in_key_sequence_positions(tmp_path):
    # With a window, context+1 moves the block's queries one key further along: as the
    # reference's _attention_mask over [context ; block] does.
    ref, ours = drafters(tmp_path, **SLIDING)
    assert_switch(ref, ours, Conventions(context_offset=1), context=1)


def test_layer_offset_reads_hidden_states_i(tmp_path):
    """layers-1 selects, from shards storing neighbours, exactly extract_context_feature's
    columns for ids - 1 (hidden_states[i] instead of [i + 1])."""
    from scoring.diagnose.run import feature_selector

    ref, ours = drafters(tmp_path)
    g = torch.Generator().manual_seed(5)
    hidden_states = [torch.randn(1, N, HIDDEN, generator=g) for _ in range(7)]  # embedding + 6 layers
    stored = [1, 3, 0, 2, 4]  # extract --neighbour-layers order: requested, then neighbours ascending
    features = torch.cat([hidden_states[i + 1][0] for i in stored], dim=-1)
    select = feature_selector(stored, ours.config.target_layer_ids, -1)
    expected = extract_context_feature(hidden_states, [i - 1 for i in ref.target_layer_ids])[0]
    assert torch.equal(select(features), expected)
    assert not torch.equal(select(features), extract_context_feature(hidden_states, ref.target_layer_ids)[0])


@pytest.mark.parametrize(
    "conventions",
    [
        Conventions(context_offset=1),
        Conventions(context_offset=-1),
        Conventions(causal_block=True),
        Conventions(window="everywhere"),
    ],
    ids=["context+1", "context-1", "causal-block", "window-everywhere"],
)
def test_flex_mask_follows_the_switches(tmp_path, conventions):
    """The block-sparse flex_attention mask (CUDA's path; eager here) applies the switches as
    the dense masks do."""
    _, ours = drafters(tmp_path, **SLIDING)
    ids, embed, lm_head, features = _inputs(2 * HIDDEN)
    options = {name: ReplayOptions(methods={}, conventions=conventions, attention=name) for name in ("dense", "flex")}
    proposer, target = neural_proposer(ours), TargetHead(embed, lm_head)
    packed = pack_samples(proposer, [_sample(ids, features)], lambda f: f, options["dense"], target)
    dense, flex = (chunk_logits(proposer, target, packed, options[name]) for name in ("dense", "flex"))
    assert (dense - flex).abs().max().item() < 1e-5
