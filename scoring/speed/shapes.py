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

from dataclasses import dataclass

from proposers.registry import family as family_record
from scoring.methods.chain import CHAIN_METHOD
from scoring.methods.ddtree import DDTREE
from scoring.methods.eagle_tree import EAGLE_TREES
from scoring.methods.registry import method_of

TOKEN_ONLY = ("ngram", "suffix")  # families that draft from the stored tokens alone, no forward


@dataclass(frozen=True)
class StepShape:
    verified: int  # tokens per sequence in the target's verification forward
    draft_passes: tuple[int, ...]  # tokens per sequence of each drafter forward, in order


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


def draft_passes(family: str, method: str, drafts: int) -> tuple[int, ...]:
    """Tokens per sequence of each drafter forward in one step (module docstring)."""
    how = drafting(family)
    if how == "none":
        return ()
    if how == "block":
        return (drafts + 1,)
    kind, setting = method_of(method)
    if kind is EAGLE_TREES:
        return (1,) + (setting.topk,) * (setting.depth - 1)
    return (1,) * drafts


def step_shape(family: str, method: str, drafts: int) -> StepShape:
    """The step of `method` for a drafter of `family` drafting a chain of `drafts`."""
    return StepShape(verified_tokens(method, drafts), draft_passes(family, method, drafts))
