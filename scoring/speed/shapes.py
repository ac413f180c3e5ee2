"""What one speculative decoding step forwards, per method and drafter family (docs/speed.md):
the tokens per sequence the target verifies, and the drafter's forward passes (tokens per
sequence of each). A cost profile (profile.py) prices them.

    chain of K drafts          target: K + 1 tokens (the last committed token and the drafts)
    ddtree-N                   target: N + 1 (the root is not counted in N: docs/ddtree.md)
    eagle-tree-KxD-N           target: N (sglang's draft tokens include the root: docs/eagle-tree.md)

    block drafter (DFlash, DFlash2, DSpark)   one pass over its block: K + 1 queries, any method
    autoregressive (EAGLE-3, MTP, a draft     chain: K passes of one token; EAGLE tree: one pass of
      model)                                  one token, then D - 1 passes of topk (its beam)
    token-only (n-gram, suffix)               no drafter forward
"""

from __future__ import annotations

from proposers.registry import family as family_record
from scoring.methods.chain import CHAIN_METHOD
from scoring.methods.ddtree import DDTREE
from scoring.methods.eagle_tree import EAGLE_TREES
from scoring.methods.registry import method_of

TOKEN_ONLY = ("ngram", "suffix")  # families that draft from the stored tokens alone, no forward


def verified_tokens(method: str, drafts: int) -> int:
    """Tokens per sequence the target verifies in one step of `method` with `drafts` chain drafts."""
    kind, setting = method_of(method)
    if kind is CHAIN_METHOD:
        return drafts + 1
    if kind is DDTREE:
        return int(setting) + 1
    assert kind is EAGLE_TREES
    return setting.draft_tokens


def drafting(family: str) -> str:
    """'none', 'block' or 'autoregressive': how the family's drafter forwards (module docstring)."""
    if family in TOKEN_ONLY:
        return "none"
    if family_record(family).chain_steps:  # EAGLE-3, MTP, a draft model
        return "autoregressive"
    return "block"


def draft_passes(family: str, method: str, drafts: int, block: int) -> tuple[int, ...]:
    """Tokens per sequence of each drafter forward in a step that drafts `drafts` of a chain of
    `block` (module docstring): none without a draft; a block drafter runs its whole block at any
    cut; an autoregressive one a pass per draft."""
    how = drafting(family)
    if how == "none" or drafts == 0:
        return ()
    if how == "block":
        return (block + 1,)
    kind, setting = method_of(method)
    if kind is EAGLE_TREES:
        return (1,) + (setting.topk,) * (setting.depth - 1)
    return (1,) * drafts
