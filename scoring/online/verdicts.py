"""One sample: the offline walk's steps against what the engine reported, and what a difference
points at (docs/walk-rules.md#compare-online).

A comparison is meaningful only where the engine's response is the stored one: the walk follows the
stored tokens. Then, step for step, (accepted, drafted) of the walk's chain rows (walk.parquet's
counted_accepted and drafted, the steps that drafted anything) equal the engine's, and their sums
equal its totals, when the results were scored with the engine's walk rule and the engine runs the
drafter the replay runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from scoring.online.requests import Online


@dataclass(frozen=True)
class OfflineSteps:
    """The walk's chain steps of one sample, those that drafted (a plain decode verifies nothing)."""

    steps: list[tuple[int, int]]  # (counted_accepted, drafted)
    anchors: list[int]
    exact: bool  # no count is a lower bound
    rule: str  # the walk rule the results were scored with


@dataclass(frozen=True)
class Verdict:
    sample_id: str
    dataset: str
    response: str  # "same", or where the engine's response leaves the stored one
    offline: tuple[int, int]  # (accepted, drafted) summed over the walk
    online: tuple[int, int] | None  # the engine's totals
    first_difference: int | None  # the first step whose counts differ (None: none, or not compared)
    per_step: bool  # the engine's per-step counts were compared (not only its totals)
    verdict: str  # "equal", "differs", "not comparable"
    points_at: str


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (a shorter list differs where it ends)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def judge(
    sample_id: str, dataset: str, stored: list[int], offline: OfflineSteps, online: Online, engine: str
) -> Verdict:
    totals = (sum(a for a, _ in offline.steps), sum(d for _, d in offline.steps))
    reported = None if online.acceptance is None else (online.acceptance.accepted, online.acceptance.drafted)
    row = dict(sample_id=sample_id, dataset=dataset, offline=totals, online=reported, per_step=online.steps is not None)
    diverged = first_divergence(online.token_ids, stored)
    if diverged is not None:
        why = (
            f"the engine's response leaves the stored one at response token {diverged}: it is not the stored "
            "(target's greedy) response, so the walks follow other tokens; its weights, precision or kernels differ "
            "from the extract's target (inspect's argmax mismatches say how close they are)"
        )
        return Verdict(
            **row, response=f"differs at {diverged}", first_difference=None, verdict="not comparable", points_at=why
        )
    step = None if online.steps is None else first_divergence(offline.steps, online.steps)
    if step is None and reported == totals:
        return Verdict(**row, response="same", first_difference=None, verdict="equal", points_at="")
    why = explain(offline, online, step, engine)
    return Verdict(**row, response="same", first_difference=step, verdict="differs", points_at=why)


def explain(offline: OfflineSteps, online: Online, step: int | None, engine: str) -> str:
    """What a difference on the same response points at, most likely first."""
    if offline.rule != engine:
        return (
            f"the walk rule: these results follow --walk-rule {offline.rule}, the engine is {engine} "
            f"(its tail block and what it counts differ): re-score with --walk-rule {engine}"
        )
    if not offline.exact:
        return "the offline counts are lower bounds here (the engine counts drafts accepted past the stored response)"
    if step is None:
        return "the totals differ while no per-step counts were compared: pass the server's log (--engine-log) to see where"
    if step < len(online.steps) and step < len(offline.steps) and online.steps[step][1] != offline.steps[step][1]:
        drafted = online.steps[step][1]
        return (
            f"the draft length: at step {step} the engine verified {drafted} drafts, the walk {offline.steps[step][1]}; "
            f"score with --steps {drafted} (the server's --spec-draft-n-max)"
        )
    where = "from the first step" if step == 0 else f"from step {step} (anchor {offline.anchors[step]})"
    return (
        f"the drafts differ {where}: the engine's drafter does not see what the replay's sees (the feature "
        "layers' numbering, docs/layer-numbering.md; another drafter file; its precision), or the step counts differ"
    )
