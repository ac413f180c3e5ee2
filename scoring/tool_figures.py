"""The chain's acceptance as each tool defines and prints it (docs/tool-figures.md), so a number
a serving engine or a trainer printed can be held against the same drafter's here: the tools
share words (acceptance length, acceptance rate) for different quantities, with or without the
bonus token, over every step or only the steps that drafted, per position conditional or not.

The engines' figures come from the decoding walk (walk.parquet's chain rows, the loop
`--walk-rule` follows): per step `drafted` (drafts verified, 0 for a plain decode) and
`counted_accepted` (accepted drafts as that loop counts them). The trainers' from the
all-anchor summary. Results of sampled shards have no walk: their engine figures are absent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import polars as pl

from scoring import results
from scoring.methods.chain import CHAIN


@dataclass(frozen=True)
class Figure:
    tool: str
    name: str  # as the tool prints it
    value: float | list[float]
    definition: str  # in walk counts; docs/tool-figures.md cites each tool's source


@dataclass(frozen=True)
class WalkCounts:
    """The chain walk's steps of one dataset (or all): every step, those that drafted, their drafts
    and accepted drafts, and how many drafting steps accepted at least k drafts (k = 1 .. K)."""

    steps: int
    drafting_steps: int
    drafted: int
    accepted: int
    at_least: list[int]
    reached: list[int]  # drafting steps that verified at least k drafts and accepted k - 1


def walk_counts(directory: str, dataset: str | None = None, sample_id: str | None = None) -> WalkCounts | None:
    """The counts of the chain's walk steps in `directory`, of one dataset or sample when given
    (None: no walk, e.g. sampled shards)."""
    path = os.path.join(directory, results.FILES["walk"])
    if not os.path.isfile(path):
        return None
    steps = pl.read_parquet(path, columns=["dataset", "sample_id", "method", "drafted", "counted_accepted"])
    steps = steps.filter(pl.col("method") == CHAIN)
    if dataset is not None and dataset != results.ALL_DATASETS:
        steps = steps.filter(pl.col("dataset") == dataset)
    if sample_id is not None:
        steps = steps.filter(pl.col("sample_id") == sample_id)
    if steps.height == 0:
        return None
    drafting = steps.filter(pl.col("drafted") > 0)
    most = int(drafting["drafted"].max() or 0)
    accepted, drafted = drafting["counted_accepted"], drafting["drafted"]
    return WalkCounts(
        steps=steps.height,
        drafting_steps=drafting.height,
        drafted=int(drafted.sum()),
        accepted=int(accepted.sum()),
        at_least=[int((accepted >= k).sum()) for k in range(1, most + 1)],
        reached=[int(((accepted >= k - 1) & (drafted >= k)).sum()) for k in range(1, most + 1)],
    )


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def engine_figures(c: WalkCounts) -> list[Figure]:
    """vLLM's, llama.cpp's, SGLang's and the EAGLE papers' figures from the walk's counts."""
    per_position = [ratio(n, c.drafting_steps) for n in c.at_least]
    conditional = [ratio(n, r) for n, r in zip(c.at_least, c.reached)]
    mean_length = 1 + ratio(c.accepted, c.drafting_steps)
    return [
        Figure("vLLM", "Mean acceptance length", mean_length, "1 + accepted / steps that drafted"),
        Figure("vLLM", "Avg Draft acceptance rate", 100 * ratio(c.accepted, c.drafted), "100 x accepted / drafted (%)"),
        Figure("vLLM", "Per-position acceptance rate", per_position, "steps accepting >= k / steps that drafted"),
        Figure("llama.cpp", "draft acceptance", ratio(c.accepted, c.drafted), "accepted / drafted"),
        Figure("llama.cpp", "mean len", mean_length, "1 + accepted / steps that drafted"),
        Figure("llama.cpp", "acc per pos", per_position, "steps accepting >= k / steps that drafted"),
        Figure("SGLang", "accept len", ratio(c.accepted + c.steps, c.steps), "(accepted + steps) / steps, every step"),
        Figure("EAGLE papers", "tau", ratio(c.accepted + c.steps, c.steps), "tokens per step, bonus included"),
        Figure("EAGLE papers", "n-alpha", conditional, "position n+1 accepted / reached (n drafts accepted before)"),
    ]


def trainer_figures(directory: str, dataset: str) -> list[Figure]:
    """SpecForge's training accuracies from the summary's all-anchor match rates."""
    summary = pl.read_parquet(os.path.join(directory, results.FILES["summary"]))
    rows = summary.filter((pl.col("dataset") == dataset) & (pl.col("method") == CHAIN)).to_dicts()
    if not rows or not rows[0].get("match_rate_by_position"):
        return []
    matches = list(rows[0]["match_rate_by_position"])
    return [Figure("SpecForge", "acc_i", matches, "draft argmax == target argmax at position i, every anchor")]


def tool_figures(directory: str, dataset: str = results.ALL_DATASETS) -> list[Figure]:
    """Every tool's figures of the result in `directory`, for `dataset` (default: all pooled)."""
    counts = walk_counts(directory, dataset)
    return (engine_figures(counts) if counts else []) + trainer_figures(directory, dataset)


def shown(value: float | list[float]) -> str:
    if isinstance(value, list):
        return "(" + ", ".join(f"{v:.3f}" for v in value) + ")"
    return f"{value:.3f}"
