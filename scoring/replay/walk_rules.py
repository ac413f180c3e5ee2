"""Walk rules: how each online loop runs a step near the end of a response and what it counts.

The loops agree on the path through a greedy response (`produced(t)`, walk.py) once they draft the
same tokens; they differ in which block the drafter runs near the end of the budget and in the
accepted-draft counts they report. docs/walk-rules.md gives every rule with its engine's source line.

    dflash      dflash_generate (the reference, the default): the block is shortened to the budget
                before the drafter runs; it reports acceptance lengths (`produced`)
    llama.cpp   llama-server: the full block is drafted, then cut to the budget minus one; a step with
                no draft left is a plain decode (0 drafted); a stop token matched as the last draft
                counts as accepted
    vllm        vLLM: the full block is drafted and verified; accepted drafts past the stop token or
                the budget are counted too (the stored response cannot say how many: a lower bound)
    sglang      SGLang: as vLLM
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scoring.config import WALK_RULES

BIG = 1 << 30  # `remaining` that never shortens a block


@dataclass(frozen=True)
class Counts:
    """Per anchor, what the rule's loop reports for the step taken there."""

    drafted: torch.Tensor  # [A] drafts verified (0: a plain decode)
    accepted: torch.Tensor  # [A] accepted drafts as the loop counts them
    exact: torch.Tensor  # [A] bool: False where the count is a lower bound (drafts past the stored response)


@dataclass(frozen=True)
class WalkRule:
    name: str
    truncates_block: bool  # the drafter runs a block shortened to the budget (else the full block)
    cuts_to_budget: bool  # drafts are cut to the budget minus one before verification
    stop_as_last_draft_counts: bool  # a stop token matched as the last draft is counted as accepted
    counts_past_end: bool  # accepted drafts past the stop token or the budget are counted
    source: str  # where the rule is read (docs/walk-rules.md has the lines)

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
        if not self.cuts_to_budget and not self.counts_past_end:  # dflash_generate's acceptance lengths
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
        at_stop = torch.where(stop == drafted, stop, stop - 1) if self.stop_as_last_draft_counts else stop - 1
        counted = torch.where(through_stop, at_stop, counted)
        return Counts(drafted, counted, torch.ones_like(accepted, dtype=torch.bool))


RULES = {
    rule.name: rule
    for rule in (
        WalkRule("dflash", True, False, False, False, "dflash.model.dflash_generate"),
        WalkRule("llama.cpp", False, True, True, False, "llama.cpp tools/server/server-context.cpp"),
        WalkRule("vllm", False, False, False, True, "vllm/v1/core/sched/scheduler.py"),
        WalkRule("sglang", False, False, False, True, "sglang/srt/managers/scheduler_components"),
    )
}
DEFAULT_RULE = WALK_RULES[0]
assert tuple(RULES) == WALK_RULES, "scoring/config.py WALK_RULES names the rules registered here"


def walk_rule(name: str) -> WalkRule:
    return RULES[name]
