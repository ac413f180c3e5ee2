"""Walk rules: how each online loop runs a step near the end of a response and what it counts.

The loops agree on the path through a greedy response (`produced(t)`, walk.py) once they draft the
same tokens; they differ in which block the drafter runs near the end of the budget and in the
accepted-draft counts they report. docs/walk-rules.md gives every rule with its engine's source line.

    dflash      dflash_generate (the reference, the default): the block is shortened to the budget
                before the drafter runs; it reports acceptance lengths (`produced`)
    llama.cpp   llama-server: the full block is drafted, then cut to the budget minus one; a step with
                no draft left is a plain decode (0 drafted); a stop token matched as the last draft
                counts as accepted; an MTP head's draft KV holds one slot more (Conventions.lead_slot), a
                NextN head feeds back its normed output (Conventions.nextn_feed_normed), MiMo's
                heads are chained, step k on head k (Conventions.chain_heads);
                a block drafter attends as llama.cpp's DFlash graph (Conventions.llama_block)
    vllm        vLLM: the full block is drafted and verified; accepted drafts past the stop token or
                the budget are counted too (the stored response cannot say how many: a lower bound)
    sglang      SGLang: as vLLM
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proposers.toolkit.conventions import REFERENCE, Conventions
from scoring.config import WALK_RULES

BIG = 1 << 30  # `remaining` that never shortens a block
BLOCK_FAMILIES = ("dflash", "dflash2", "dspark")  # served by llama.cpp's one DFlash graph (src/models/dflash.cpp)


@dataclass(frozen=True)
class Counts:
    """Per anchor, what the rule's loop reports for the step taken there."""

    drafted: torch.Tensor  # [A] drafts verified (0: a plain decode)
    accepted: torch.Tensor  # [A] accepted drafts as the loop counts them
    exact: torch.Tensor  # [A] bool: False where the count is a lower bound (drafts past the stored response)


@dataclass(frozen=True)
class WalkRule:
    name: str
    cuts_to_budget: bool  # llama.cpp: drafts cut to the budget minus one before verification
    counts_past_end: bool  # vLLM, SGLang: accepted drafts past the stop token or the budget are counted
    mtp_lead_slot: bool = False  # llama.cpp: an MTP head's draft KV holds the prompt's first token too
    llama_block: bool = False  # llama.cpp: a block drafter's causality and window as its DFlash graph's

    def conventions(self, family: str) -> Conventions:
        """How the replay computes a drafter of `family` under this loop: the reference's, except under
        llama.cpp an MTP head (its extra first slot: Conventions.lead_slot) and a block drafter (its
        graph's causality and window: Conventions.llama_block)."""
        if self.mtp_lead_slot and family == "mtp":  # and a NextN head's step output fed back normed
            return Conventions(lead_slot=True, nextn_feed_normed=True, chain_heads=True)
        if self.llama_block and family in BLOCK_FAMILIES:
            return Conventions(llama_block=True)
        return REFERENCE

    @property
    def truncates_block(self) -> bool:
        """Only the reference shortens the block to the budget; the engines run it full and cut or
        verify afterwards."""
        return not (self.cuts_to_budget or self.counts_past_end)

    def room(self, remaining: torch.Tensor) -> torch.Tensor | None:
        """[A] drafts the loop can verify at anchors with `remaining` positions left: llama-server's
        n_draft_max (get_n_draft_max: n_remaining - 1, n_remaining = remaining - 1; at most 0: it
        asks for no draft); None for the loops that verify whatever is drafted."""
        return (remaining - 2).clamp(min=0) if self.cuts_to_budget else None

    def block_remaining(self, remaining: torch.Tensor) -> torch.Tensor:
        """The `remaining` a proposer's block_len sees: the budget, or no limit when the loop drafts
        a full block whatever is left."""
        return remaining if self.truncates_block else torch.full_like(remaining, BIG)

    def counts(self, steps: dict[str, torch.Tensor]) -> Counts:
        """`steps` holds, per anchor [A]: accepted (leading drafts equal to the stored tokens, before
        any cap), produced (the step's tokens, walk.py's caps), depth (drafts the block proposed),
        known (drafts the stored response can verify), remaining (positions left in the budget
        from the anchor on, P + budget - t) and stop (the first stop token's offset, next_stop - t)."""
        accepted, depth = steps["accepted"], steps["depth"]
        if self.truncates_block:  # dflash_generate's acceptance lengths
            return Counts(depth, steps["produced"] - 1, torch.ones_like(accepted, dtype=torch.bool))
        if self.cuts_to_budget:
            return self._cut_counts(accepted, depth, steps["remaining"], steps["stop"])
        known = steps["known"]  # a full match of fewer drafts than proposed leaves the rest unverified
        return Counts(depth, accepted, (accepted < known) | (known >= depth))

    def _cut_counts(self, accepted, depth, remaining, stop) -> Counts:
        """llama.cpp: drafts cut to n_remaining - 1 (n_remaining = remaining - 1 after the anchor's
        own token is emitted); verification stops at a matched stop token, which counts as the bonus
        unless it is the last draft (then it counts as accepted)."""
        drafted = torch.minimum(depth, (remaining - 2).clamp(min=0))
        counted = torch.minimum(accepted, drafted)
        through_stop = (stop <= drafted) & (accepted >= stop)  # the stop token drafted and matched
        counted = torch.where(through_stop, torch.where(stop == drafted, stop, stop - 1), counted)
        return Counts(drafted, counted, torch.ones_like(accepted, dtype=torch.bool))


RULES = {
    rule.name: rule
    for rule in (
        WalkRule("dflash", cuts_to_budget=False, counts_past_end=False),
        WalkRule("llama.cpp", cuts_to_budget=True, counts_past_end=False, mtp_lead_slot=True, llama_block=True),
        WalkRule("vllm", cuts_to_budget=False, counts_past_end=True),
        WalkRule("sglang", cuts_to_budget=False, counts_past_end=True),
    )
}
DEFAULT_RULE = WALK_RULES[0]  # scoring/config.py WALK_RULES names these (tests/scoring/replay/test_walk_rules.py)


def walk_rule(name: str) -> WalkRule:
    return RULES[name]
