"""The report's "Where acceptance falls" section: the chain's tau and streak by context length
and, for a reasoning model's responses, inside its thinking and in the answer, per checkpoint,
each group with the steps and anchors behind it (scoring/breakdowns.py computes them, as score
prints them; docs/breakdowns.md defines them). A group resting on fewer than MIN_ANCHORS steps
or anchors is greyed: thin, not a cliff."""

from __future__ import annotations

import html

from scoring.report.data import Results, fmt, kinds, pick_evenly
from scoring.report.plots import MAX_SERIES
from scoring.report.tables import label_html
from scoring.results import MIN_ANCHORS

HEAD = ("Checkpoint", "{what}", "Walk steps", "τ chain", "Anchors", "All-anchor streak")


def _labels(results: Results) -> list[str]:
    """The checkpoints shown, greedy runs first then each sampled kind, at most MAX_SERIES of each
    (every one reads its anchors.parquet)."""
    of_kind = {
        kind: [lab for lab in results.order if results.kind.get(lab, "greedy") == kind] for kind in kinds(results)
    }
    return [lab for labels in of_kind.values() for lab in pick_evenly(labels, MAX_SERIES)]


def _groups(results: Results, labels: list[str]) -> tuple[dict, dict, list[str]]:
    """(label -> context groups, label -> segment groups or None, labels whose files could not be read)."""
    from scoring.breakdowns import by_context, by_segment, read_rows  # torch: only when the page has results

    context, segments, unreadable = {}, {}, []
    for label in labels:
        directory = results.dir_of[label]
        try:
            rows = read_rows(directory)
            context[label], segments[label] = by_context(directory, rows=rows), by_segment(directory, rows=rows)
        except Exception:  # noqa: BLE001 - a truncated file: this part is optional, the page says which
            unreadable.append(label)
    return context, segments, unreadable


def _table(groups: dict, what: str) -> str:
    head = "".join(f"<th>{h.format(what=what)}</th>" for h in HEAD)
    out = [f'<div class="scroll"><table class="groups"><thead><tr>{head}</tr></thead><tbody>']
    for label, found in groups.items():
        for index, g in enumerate(found):
            first = f'<td rowspan="{len(found)}">{label_html(label)}</td>' if index == 0 else ""
            css = ' class="group-start"' if index == 0 else ""
            thin = min(g.steps or MIN_ANCHORS, g.anchors or MIN_ANCHORS) < MIN_ANCHORS  # 0: none, not thin
            num = f' class="num{" few" if thin else ""}"'
            cells = "".join(f"<td{num}>{c}</td>" for c in (fmt(g.steps), fmt(g.tau), fmt(g.anchors), fmt(g.streak)))
            out.append(f"<tr{css}>{first}<td>{html.escape(g.label)}</td>{cells}</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def groups_section(results: Results) -> str:
    """The section: a context-length table, a thinking/answer table when any response thinks."""
    context, segments, unreadable = _groups(results, _labels(results))
    context = {lab: g for lab, g in context.items() if g}
    segments = {lab: g for lab, g in segments.items() if g}
    parts = [
        '<h2 id="breakdowns">Where acceptance falls</h2>',
        '<p class="caption">The chain\'s τ (walk steps) and all-anchor streak (every anchor) grouped by the '
        "anchor's context length, the tokens before it (acceptance falls as the context grows, and a pooled τ "
        "hides where), and inside a reasoning model's thinking (&lt;think&gt; .. &lt;/think&gt;) against its "
        "answer: docs/breakdowns.md. A group's τ is per step, not per sample. Sampled results have no walk, so no "
        f"τ here; their streak is the expected one. Groups resting on fewer than {MIN_ANCHORS} steps or anchors "
        "are grey.</p>",
    ]
    if context:
        parts += ["<h3>By context length (tokens before the anchor)</h3>", _table(context, "Context")]
    else:
        parts.append('<p class="note">No walk.parquet or anchors.parquet in these results, so no breakdown.</p>')
    if segments:
        parts += ["<h3>Inside the thinking and in the answer</h3>", _table(segments, "Segment")]
    if unreadable:
        parts.append(f'<p class="note">Could not read the walk or anchors of {html.escape(", ".join(unreadable))}.</p>')
    return "".join(parts)
