"""The report's "Paired differences" section: along each training run, every checkpoint against
the one before it (and the first against the last), per dataset and method, with the interval
`specreplay compare` computes (scoring/compare/run.py: paired bootstrap over the samples both
scored, for τ and for the all-anchor streak). The summary's bold τ is a point estimate; this is
whether the difference is real. Runs of each kind of decoding are paired only among themselves.

    sections = paired_section(results)   # '' when no run holds two checkpoints
"""

from __future__ import annotations

import html

from scoring.compare.baselines import is_baseline, quiet_comparison
from scoring.compare.bootstrap import FEW_SAMPLES, chance_note, digits, judge
from scoring.methods.chain import CHAIN
from scoring.report.data import Results, pick_evenly, run_of
from scoring.report.tables import label_html
from scoring.results import ALL_DATASETS as ALL

MAX_STEPS = 6  # checkpoints paired per run: an even spread, first and last kept (each pair reads both runs' files)
HEAD = ("A → B", "Dataset", "Paired", "τ A → B", "Δτ (95% interval)", "Verdict", "Δ streak (95% interval)")


def difference(delta: float, low: float, high: float, n: int) -> tuple[str, str, str]:
    """(difference, interval, verdict) of one B - A interval, as compare words them."""
    d = digits(delta, low, high)
    if n < 2:
        return f"{delta:+.{d}f}", "–", "too few samples"
    return f"{delta:+.{d}f}", f"{low:+.{d}f} to {high:+.{d}f}", judge(low, high).value


def pairs(results: Results) -> list[tuple[str, str]]:
    """(A, B) label pairs: consecutive checkpoints of each run and kind (baselines left out, they
    have their own section), then its first against its last when they are not consecutive."""
    runs: dict[str, list[str]] = {}
    for label in results.order:
        if not is_baseline(results.runs.get(results.dir_of[label])):
            runs.setdefault(run_of(results, label), []).append(label)
    found = []
    for labels in runs.values():
        chosen = pick_evenly(labels, MAX_STEPS)
        found += list(zip(chosen, chosen[1:]))
        if len(chosen) > 2:
            found.append((chosen[0], chosen[-1]))
    return found


def _interval_cell(delta, low, high, n) -> str:
    shown, interval, _ = difference(delta, low, high, n)
    return f'{shown}<br><span class="muted">{interval}</span>'


def _cells(row: dict, group: str) -> list[str]:
    """One (dataset, method) row's cells after A → B: `group` names it (the dataset, or dataset · method)."""
    n = row["n"]
    if not n:
        return [html.escape(group), f'<span class="muted">{html.escape(row["verdict"])}</span>', "", "", "", ""]
    thin = f' class="few" title="fewer than {FEW_SAMPLES} paired samples: the interval is unreliable"'
    d = digits(row["tau_a"], row["tau_b"])
    cells = [html.escape(group), f"<span{thin if n < FEW_SAMPLES else ''}>{n}</span>"]
    cells += [
        f"{row['tau_a']:.{d}f} → {row['tau_b']:.{d}f}",
        _interval_cell(row["delta"], row["ci_low"], row["ci_high"], n),
    ]
    cells.append(difference(row["delta"], row["ci_low"], row["ci_high"], n)[2])
    streak = row.get("streak_delta")
    cells.append(
        "–" if streak is None else _interval_cell(streak, row["streak_ci_low"], row["streak_ci_high"], row["streak_n"])
    )
    return cells


def _rows(a: str, b: str, rows: list[dict], with_method: bool) -> list[str]:
    """One comparison's rows, A → B spanning them; each row's class is its verdict (colour)."""
    out = []
    for index, row in enumerate(rows):
        group = f"{row['dataset']} · {row['method']}" if with_method else row["dataset"]
        cells = _cells(row, group)
        first = f'<td rowspan="{len(rows)}">{label_html(a)} →<br>{label_html(b)}</td>' if index == 0 else ""
        css = ("group-start " if index == 0 else "") + cells[4].replace(" ", "-")
        out.append(f'<tr class="{css.strip()}">{first}' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return out


def _table(rows: list[str]) -> str:
    head = "".join(f"<th>{h}</th>" for h in HEAD)
    return f'<div class="scroll"><table class="paired"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>'


def paired_section(results: Results) -> str:
    """The section: the chain per dataset, every other method folded below; '' without a pair."""
    found = pairs(results)
    if not found:
        return ""
    chain, others, notes, intervals, level = [], [], [], 0, 0.95
    for a, b in found:
        compared = quiet_comparison(results.dir_of[a], results.dir_of[b])
        if isinstance(compared, str):
            notes.append(f"{html.escape(a)} → {html.escape(b)}: {html.escape(compared)}")
            continue
        rows = sorted(compared.table.to_dicts(), key=lambda r: r["dataset"] != ALL)  # pooled first, as in the summary
        intervals, level = intervals + compared.intervals, compared.confidence
        chain += _rows(a, b, [r for r in rows if r["method"] == CHAIN], with_method=False)
        rest = [r for r in rows if r["method"] != CHAIN]
        others += _rows(a, b, rest, with_method=True) if rest else []
    return _section_html(chain, others, notes, chance_note(intervals, level) if intervals else "")


def _section_html(chain: list[str], others: list[str], notes: list[str], chance: str) -> str:
    parts = [
        '<h2 id="paired">Paired differences</h2>',
        '<p class="caption">Each checkpoint of a run against the one before it (and the first against the last): '
        "B − A over the samples both scored, with the 95% paired-bootstrap interval <code>specreplay compare</code> gives "
        "(τ per sample; the streak anchor-weighted). <b>better</b> or <b>worse</b> only when the whole interval "
        f"lies on one side of zero. Greyed counts: fewer than {FEW_SAMPLES} pairs, the interval is too narrow "
        f"to trust. Sampled and greedy runs are paired only among themselves.{' ' + html.escape(chance) + '.' if chance else ''}</p>",
    ]
    if chain:
        parts.append(_table(chain))
    if others:
        parts.append(f"<details><summary>Every other method ({len(others)} rows)</summary>{_table(others)}</details>")
    if notes:
        parts.append('<div class="note"><ul>' + "".join(f"<li>{n}</li>" for n in notes) + "</ul></div>")
    return "".join(parts)
