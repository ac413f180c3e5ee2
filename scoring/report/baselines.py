"""The report's "Against the baselines" section: every trained drafter of the report against every
baseline in it (an n-gram lookup, a standalone draft model scored on the same shards), pooled chain
tau with compare's paired-bootstrap interval (scoring/compare/baselines.py)."""

from __future__ import annotations

import html

from scoring.compare.baselines import Versus, against, is_baseline
from scoring.compare.bootstrap import digits
from scoring.report.data import TAU_UNIT, Results
from scoring.report.paired import difference
from scoring.report.tables import label_html

HEADERS = ("Drafter", "Baseline", "τ drafter", "τ baseline", "Difference", "95% interval", "Paired", "Verdict")


def versus_all(results: Results) -> list[Versus]:
    """Each drafter label against each baseline label, in the report's order."""
    drafters, baselines = [], []
    for label in results.order:
        path = results.dir_of[label]
        (baselines if is_baseline(results.runs.get(path)) else drafters).append((path, label))
    return against(drafters, baselines)


def _cells(versus: Versus) -> list[str]:
    row = versus.row
    names = [label_html(versus.drafter), label_html(versus.baseline)]
    if isinstance(row, str):
        return names + [html.escape(row)] + [""] * 5
    delta, low, high, n = row["delta"], row["ci_low"], row["ci_high"], row["n"]
    d = digits(delta, low, high)
    shown, interval, verdict = difference(delta, low, high, n)
    return names + [f"{row['tau_b']:.{d}f}", f"{row['tau_a']:.{d}f}", shown, interval, str(n), verdict]


def baselines_section(results: Results) -> str:
    """The section, or nothing when the report holds no baseline or no trained drafter."""
    rows = versus_all(results)
    if not rows:
        return ""
    head = "".join(f"<th>{h}</th>" for h in HEADERS)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in _cells(v)) + "</tr>" for v in rows)
    return (
        '<h2 id="baselines">Against the baselines</h2>'
        f'<p class="caption">Each trained drafter against each baseline scored on the same shards (proposers '
        f"that need no trained drafter): pooled chain τ in {TAU_UNIT}, the difference drafter − baseline and its "
        "95% paired-bootstrap interval over the samples both scored (as `specreplay compare` computes it).</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )
