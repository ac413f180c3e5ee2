"""speculators' dense training masks built by broadcasting: its eager path (speculators/models/
attention.py create_float_mask) evaluates a flex-attention mask_mod through torch's create_mask,
a vmap over every (query, key) pair whose per-call overhead was 40-60 % of a tiny drafter's fit
step. Calling the same mask_mod once on broadcast index grids gives the same booleans: the mask
mods the fits use (DFlash's anchor blocks, EAGLE-3's documents) index 1-D tensors and combine
elementwise (tests/parity/test_training_masks.py checks both builds equal)."""

from __future__ import annotations

import contextlib

import torch


def broadcast_mask(mask_mod, B=None, H=None, Q_LEN=0, KV_LEN=0, device=None) -> torch.Tensor:  # noqa: N803
    """torch's create_mask(mask_mod, B, H, Q_LEN, KV_LEN, device) for a mask_mod: [B, H, Q, KV] bool."""
    shape = (B or 1, H or 1, Q_LEN, KV_LEN)
    grids = [torch.arange(n, device=device).view([-1 if i == d else 1 for i in range(4)]) for d, n in enumerate(shape)]
    return torch.broadcast_to(mask_mod(*grids), shape).contiguous()


@contextlib.contextmanager
def broadcast_masks():
    """speculators' create_float_mask builds its boolean mask with broadcast_mask while inside."""
    import speculators.models.attention as attention

    saved = attention._create_mask
    attention._create_mask = broadcast_mask
    try:
        yield
    finally:
        attention._create_mask = saved
