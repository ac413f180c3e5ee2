"""A reduced draft vocabulary: speculators' `draft_vocab_size` smaller than the target's.

The drafter then has its own `lm_head.weight` [Vd, H] and a `d2t` buffer of offsets: draft id d
is target id d + d2t[d] (speculators train/vocab_mapping.py builds it from the selected target ids
sorted ascending; `t2d` is the boolean mask [V] of those ids). Logits over the target
vocabulary are -inf outside the draft vocabulary, as vLLM's `compute_logits` writes them, so a
draft outside it is never proposed and q is 0 there.
"""

from __future__ import annotations

import torch

from proposers.checkpoints.files import CheckpointError


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[Vd] the target id of each draft id."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t.long()


def to_target_vocab(draft_logits: torch.Tensor, d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., Vd] scores over the draft vocabulary -> [..., vocab], -inf outside it."""
    out = draft_logits.new_full((*draft_logits.shape[:-1], vocab), float("-inf"))
    return out.index_copy_(-1, target_ids(d2t), draft_logits)


def check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab: int, source: str) -> None:
    """The loaded d2t (and t2d, when saved) describe one set of distinct target ids inside the
    target vocabulary; a damaged mapping would score drafts as other tokens."""
    ids = target_ids(d2t)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise CheckpointError(
            f"{source}: d2t maps draft ids to target ids {int(ids.min())}..{int(ids.max())}, outside the target "
            f"vocabulary of {vocab}; the checkpoint's vocabulary mapping is damaged"
        )
    if torch.unique(ids).numel() != ids.numel():
        raise CheckpointError(f"{source}: d2t maps two draft ids to one target id; the vocabulary mapping is damaged")
    if t2d is None:
        return
    selected = torch.zeros(vocab, dtype=torch.bool, device=t2d.device)
    selected[ids.to(t2d.device)] = True
    if t2d.shape != (vocab,) or not torch.equal(t2d.bool(), selected):
        raise CheckpointError(
            f"{source}: t2d and d2t name different target ids (t2d selects {int(t2d.bool().sum())} of "
            f"{t2d.numel()}, d2t {ids.numel()} of {vocab}); the vocabulary mapping is damaged"
        )
