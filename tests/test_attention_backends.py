"""The block-sparse flex_attention path (used on CUDA) equals the dense explicit-mask path.

Runs flex_attention eagerly on CPU: its unfused reference implementation applies the same
mask_mod the compiled GPU kernel does, so a wrong mask (context past the anchor, another
anchor's block, a window off by one) shows here without a GPU.
"""

import warnings

import pytest
import torch

from conftest import random_drafter

TARGET = {"hidden_size": 32, "num_layers": 4, "vocab_size": 50}


def _drafter(layer_types=None, is_causal=None, window=None, seed=0):
    fields = {"is_causal": is_causal} if is_causal is not None else {}
    if layer_types:
        fields.update(layer_types=layer_types, sliding_window=window)
    return random_drafter(
        target=TARGET,
        layers=2,
        block_size=4,
        layer_ids=(1, 2),
        num_heads=4,
        intermediate_size=64,
        seed=seed,
        std=0.3,
        **fields,
    )


@pytest.mark.parametrize(
    "kind",
    [
        dict(),
        dict(layer_types=["sliding_attention", "full_attention"], window=3),
        dict(layer_types=["sliding_attention", "sliding_attention"], window=6, is_causal=False),
        dict(is_causal=True),
    ],
)
def test_flex_equals_dense(kind):
    drafter = _drafter(**kind)
    generator = torch.Generator().manual_seed(1)
    T = 40
    features = torch.randn(T, 64, generator=generator)
    anchors = torch.tensor([1, 5, 6, 17, 30, 39])
    embeds = torch.randn(len(anchors), 4, 32, generator=generator)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        context = drafter.context_kv(features)
        dense = drafter(embeds, anchors, context, attention="dense")
        flex = drafter(embeds, anchors, context, attention="flex")
    assert (dense - flex).abs().max() < 1e-5
