"""A cost profile of the serving side (docs/speed.md): how long the target's verification forward
and each drafter's forward take, by batch size and tokens per sequence, measured where the user
serves. Declared here, validated before anything reads it, and asked for costs by `Profile`.

Times are seconds per forward pass of the whole batch at the profile's context length; a cost
between two measured token counts is interpolated linearly, one outside them is refused (the
profile does not say it), never extrapolated.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from pipeline.common.errors import UserError
from pipeline.common.schema import Positive, Schema, validate

FORMAT = "specreplay-speed-profile/1"
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class ProfileTarget(Schema):
    """The target the profile measured: checked against the shards' target (settings.target)."""

    name: str | None = None
    num_layers: Positive
    hidden_size: Positive
    vocab_size: Positive


class Measured(Schema):
    """Where and how the times were measured: recorded with every prediction made from them."""

    engine: str
    device: str
    context_len: Positive
    unit: Literal["seconds per forward pass"] = "seconds per forward pass"
    notes: str | None = None


class VerifyCost(Schema):
    """The target's forward over `tokens` tokens of each of `batch` sequences (1: a plain decode step)."""

    batch: Positive
    tokens: Positive
    seconds: Seconds


class DraftCost(Schema):
    """One forward of a drafter over `tokens` query tokens of each of `batch` sequences. `family`
    (proposers/registry.py) names whose; `checkpoint`, when given, the one result it is for (a
    result's checkpoint name, e.g. `run7_step_4000`), ahead of its family's entry."""

    family: str
    checkpoint: str | None = None
    batch: Positive
    tokens: Positive
    seconds: Seconds


class DraftStepCost(Schema):
    """All of one speculative step that drafts `drafts` tokens but the target's verification
    forward, measured inside the engine's loop at that K: the drafter's forwards (or a lookup) and
    the loop's own work around them (`profile --engine torch --in-generate`). Given for a family
    (or a checkpoint, ahead of it), it prices that family's chain steps instead of `drafters`."""

    family: str
    checkpoint: str | None = None
    batch: Positive
    drafts: Positive
    seconds: Seconds

    @property
    def tokens(self) -> int:  # a curve's x (curves()): the drafts
        return self.drafts


class PlainCost(Schema):
    """One step of plain decoding (no speculation) of `batch` sequences, as the engine runs it when
    no drafter is configured (llama-server's plain path is not its speculative path at 0 drafts)."""

    batch: Positive
    seconds: Seconds


class ProfileFile(Schema):
    format: Literal[FORMAT]
    target: ProfileTarget
    measured: Measured
    verify: Annotated[list[VerifyCost], Field(min_length=1)]
    drafters: list[DraftCost] = []
    draft_steps: list[DraftStepCost] = []
    plain: list[PlainCost] = []  # absent: plain decoding is the target's one-token forward


@dataclass(frozen=True)
class Curve:
    """Seconds against tokens per sequence at one batch size, measured points in token order."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def at(self, tokens: float) -> float | None:
        """Seconds at `tokens` (linear between measured points); None outside them."""
        if tokens < self.tokens[0] or tokens > self.tokens[-1]:
            return None
        i = bisect_left(self.tokens, tokens)
        if self.tokens[i] == tokens:
            return self.seconds[i]
        (t0, t1), (s0, s1) = self.tokens[i - 1 : i + 1], self.seconds[i - 1 : i + 1]
        return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)


def curves(points, source: str, what: str) -> dict[int, Curve]:
    """batch -> Curve of `points` (VerifyCost or DraftCost); a (batch, tokens) measured twice is refused."""
    by_batch: dict[int, dict[int, float]] = {}
    for point in points:
        seen = by_batch.setdefault(point.batch, {})
        if point.tokens in seen:
            raise UserError(
                f"{source}: {what} at batch {point.batch}, {point.tokens} tokens is given twice; keep one measurement"
            )
        seen[point.tokens] = point.seconds
    return {b: Curve(tuple(sorted(s)), tuple(s[t] for t in sorted(s))) for b, s in by_batch.items()}


@dataclass(frozen=True)
class Profile:
    """A validated profile: `verify` and each drafter's curves by batch size."""

    source: str
    file: ProfileFile
    verify: dict[int, Curve]
    drafters: dict[tuple[str, str | None], dict[int, Curve]]  # (family, checkpoint or None) -> curves
    plain: dict[int, float]  # batch -> a plain decoding step's seconds (PlainCost)
    draft_steps: dict[tuple[str, str | None], dict[int, Curve]]  # the same keys -> curves over drafts

    @property
    def batches(self) -> list[int]:
        return sorted(self.verify)

    def draft_curves(self, family: str, checkpoint: str) -> dict[int, Curve] | None:
        """The drafter's curves: its checkpoint's own entry, else its family's, else None."""
        return self.drafters.get((family, checkpoint)) or self.drafters.get((family, None))

    def step_curves(self, family: str, checkpoint: str) -> dict[int, Curve] | None:
        """The drafter's step curves (DraftStepCost, over drafts), found as draft_curves finds its own."""
        return self.draft_steps.get((family, checkpoint)) or self.draft_steps.get((family, None))

    def check_target(self, target: dict, where: str) -> None:
        """Refuse a profile measured on another target than `target` (the shards' settings.target)."""
        for field in ("num_layers", "hidden_size", "vocab_size"):
            mine, theirs = getattr(self.file.target, field), target.get(field)
            if theirs is not None and mine != theirs:
                raise UserError(
                    f"{self.source}: target.{field} is {mine} but {where} were extracted from a target with "
                    f"{field} {theirs}; measure a profile on that target"
                )


def load_profile(path: str) -> Profile:
    """The profile at `path`, validated (one error line naming the file and field otherwise)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as error:
        raise UserError(
            f"{path}: not JSON ({error.msg} at line {error.lineno}); a speed profile is a JSON file"
        ) from None
    file = validate(ProfileFile, data, path, fix="docs/speed.md declares the profile")
    plain = {}
    for point in file.plain:
        if point.batch in plain:
            raise UserError(f"{path}: plain at batch {point.batch} is given twice; keep one measurement")
        plain[point.batch] = point.seconds
    return Profile(
        path,
        file,
        curves(file.verify, path, "verify"),
        by_drafter(file.drafters, path, "drafters"),
        plain,
        by_drafter(file.draft_steps, path, "draft_steps"),
    )


def by_drafter(points: list, path: str, what: str) -> dict[tuple[str, str | None], dict[int, Curve]]:
    """(family, checkpoint or None) -> its curves by batch size."""
    grouped: dict[tuple[str, str | None], list] = {}
    for point in points:
        grouped.setdefault((point.family, point.checkpoint), []).append(point)
    return {key: curves(group, path, f"{what}[{key[0]}]") for key, group in grouped.items()}
