"""tests/helpers/masks.py's broadcast build of speculators' training masks equals torch's own
create_mask (the vmap over every pair) for the mask mods the fits use: DFlash's anchor blocks
(full and sliding-window, causal or not) and EAGLE-3's documents, padding included."""

from __future__ import annotations

import pytest
import torch
from speculators.models.dflash.attention import create_anchor_block_mask_mod
from speculators.models.eagle3.attention import create_combined_mask_mod
from torch.nn.attention.flex_attention import create_mask

from tests.helpers.masks import broadcast_mask

# three packed documents and two padding positions
DOCUMENTS = torch.tensor([0] * 7 + [1] * 5 + [2] * 9 + [-1] * 2)


@pytest.mark.parametrize("window, non_causal", [(None, False), (3, False), (3, True)])
def test_dflash_anchor_block_masks_equal_torchs(window, non_causal):
    anchors = torch.tensor([2, 5, 8, 13, 16])
    mask_mod, q_len, kv_len = create_anchor_block_mask_mod(
        DOCUMENTS, DOCUMENTS.numel(), anchors, 4, sliding_window=window, sliding_window_non_causal=non_causal
    )
    expected = create_mask(mask_mod, None, None, q_len, kv_len, device="cpu")
    found = broadcast_mask(mask_mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device="cpu")
    assert found.shape == expected.shape == (1, 1, q_len, kv_len)
    assert torch.equal(found, expected)
    assert 0 < int(found.sum()) < found.numel()


@pytest.mark.parametrize("window", [None, 4])
def test_eagle3_document_masks_equal_torchs(window):
    length = DOCUMENTS.numel()
    mask_mod = create_combined_mask_mod(DOCUMENTS, length, sliding_window=window)
    expected = create_mask(mask_mod, None, None, length, length, device="cpu")
    found = broadcast_mask(mask_mod, B=None, H=None, Q_LEN=length, KV_LEN=length, device="cpu")
    assert torch.equal(found, expected)
    assert 0 < int(found.sum()) < found.numel()
