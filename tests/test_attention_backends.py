"""The block-sparse flex_attention path (used on CUDA) equals the dense explicit-mask path.

Runs flex_attention eagerly on CPU: its unfused reference implementation applies the same
mask_mod the compiled GPU kernel does, so a wrong mask (context past the anchor, another
anchor's block, a window off by one) shows here without a GPU.
"""

import warnings

import pytest
import torch

from scoring.drafter import DFlashDrafter, parse_drafter_config


def _drafter(layer_types=None, is_causal=None, window=None, seed=0):
    raw = {
        "architectures": ["DFlashDraftModel"], "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": 50, "block_size": 4,
        "num_target_layers": 4, "dflash_config": {"mask_token_id": 49, "target_layer_ids": [1, 2]},
    }
    if layer_types:
        raw.update(layer_types=layer_types, use_sliding_window=True, sliding_window=window)
    if is_causal is not None:
        raw["is_causal"] = is_causal
    torch.manual_seed(seed)
    drafter = DFlashDrafter(parse_drafter_config(raw)).eval()
    for p in drafter.parameters():
        p.data.normal_(0, 0.3)
    return drafter


@pytest.mark.parametrize("kind", [
    dict(),
    dict(layer_types=["sliding_attention", "full_attention"], window=3),
    dict(layer_types=["sliding_attention", "sliding_attention"], window=6, is_causal=False),
    dict(is_causal=True),
])
def test_flex_equals_dense(kind):
    drafter = _drafter(**kind)
    T = 40
    features = torch.randn(T, 64)
    anchors = torch.tensor([1, 5, 6, 17, 30, 39])
    embeds = torch.randn(len(anchors), 4, 32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        context = drafter.context_kv(features)
        dense = drafter(embeds, anchors, context, attention="dense")
        flex = drafter(embeds, anchors, context, attention="flex")
    assert (dense - flex).abs().max() < 1e-5
