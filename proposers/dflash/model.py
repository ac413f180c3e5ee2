"""The DFlash drafter model (z-lab `DFlashDraftModel`): the block drafter with Qwen3 decoder layers
and nothing after its last hidden state but the output head (proposers/toolkit/block_drafter.py,
proposers/toolkit/head.py)."""

from __future__ import annotations

from proposers.toolkit.block_drafter import BlockDrafter


class DFlashDrafter(BlockDrafter):
    """z-lab DFlash v1: drafts independent given the block (greedy draft = argmax of each slot)."""
