"""Trained drafters against the baselines scored beside them on the same shards (an n-gram lookup, a
standalone draft model: proposers.registry.BASELINE_FAMILIES), one paired line each:

    step_4000: tau 2.91 vs ngram:vllm:k=4 1.38, +1.53 [1.41, 1.66]

The interval is compare's paired bootstrap over samples of the pooled chain tau (run_comparison with
the baseline as A, the drafter as B); score, watch and report print these lines.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from proposers.registry import BASELINE_FAMILIES
from scoring import results
from scoring.compare.bootstrap import digits
from scoring.compare.inputs import CompareError, CompareWarning
from scoring.compare.run import Comparison, headline_row, run_comparison


def is_baseline(record: dict | None) -> bool:
    """run.json of a proposer that needs no trained drafter."""
    return (record or {}).get("checkpoint", {}).get("family") in BASELINE_FAMILIES


def quiet_comparison(dir_a: str, dir_b: str) -> Comparison | str:
    """run_comparison(A, B), or why there is none; compare's warnings are for its own report and
    stay out of the one-liners and the report's tables built on this."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompareWarning)
            return run_comparison(dir_a, dir_b)
    except CompareError as error:
        return f"not compared ({error})"


def paired_row(dir_a: str, dir_b: str) -> dict | str:
    """The pooled headline row of compare(A, B) (tau_a, tau_b, delta, ci_low, ci_high, n), or why
    there is none."""
    compared = quiet_comparison(dir_a, dir_b)
    if isinstance(compared, str):
        return compared
    row = headline_row(compared.table.to_dicts())
    if row is None or not row["n"]:
        return "not compared (no paired samples)"
    return row


@dataclass(frozen=True)
class Versus:
    """One trained drafter against one baseline."""

    drafter: str
    baseline: str
    row: dict | str  # paired_row(baseline, drafter)

    @property
    def line(self) -> str:
        row = self.row
        if isinstance(row, str):
            return f"{self.drafter} vs {self.baseline}: {row}"
        delta, low, high = row["delta"], row["ci_low"], row["ci_high"]
        d = digits(delta, low, high)
        interval = f"[{low:+.{d}f}, {high:+.{d}f}]" if row["n"] >= 2 else "(one paired sample, no interval)"
        return (
            f"{self.drafter}: tau {row['tau_b']:.{d}f} vs {self.baseline} {row['tau_a']:.{d}f}, "
            f"{delta:+.{d}f} {interval}"
        )


def split(dirs: list[str]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(drafters, baselines): each (results directory, checkpoint name) by its run.json."""
    drafters, baselines = [], []
    for path in dirs:
        record = results.read_run_record(path)
        name = (record or {}).get("checkpoint", {}).get("name") or path
        (baselines if is_baseline(record) else drafters).append((path, name))
    return drafters, baselines


def against(drafters: list[tuple[str, str]], baselines: list[tuple[str, str]]) -> list[Versus]:
    """Every drafter against every baseline, each given as (results directory, name)."""
    return [Versus(name, base, paired_row(base_dir, path)) for path, name in drafters for base_dir, base in baselines]


def against_baselines(dirs: list[str]) -> list[Versus]:
    """Every trained drafter among `dirs` against every baseline among them."""
    return against(*split(dirs))


def lines(dirs: list[str]) -> list[str]:
    """against_baselines' lines; none when `dirs` hold no baseline or no trained drafter."""
    return [versus.line for versus in against_baselines(dirs)]
