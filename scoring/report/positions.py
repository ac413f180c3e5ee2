"""The table under the acceptance-per-position plot: per checkpoint and block position k the rate,
its 95% Wilson interval (summary.parquet's accept_rate_low/high_by_position, what score and the
loggers give) and the anchors that reached k (the n behind the point). A rate resting on fewer
than MIN_ANCHORS anchors is greyed, as the plot greys its point."""

from __future__ import annotations

import math

from scoring.report.data import Results, fmt
from scoring.report.plots import MIN_ANCHORS, position_intervals, position_rates
from scoring.report.tables import breakable

ROWS = (
    ("rate", "rate %", "P(draft token k accepted | position k reached), in %"),
    ("interval", "95% CI", "the rate's 95% Wilson interval on the anchors behind it, in %"),
    ("n", "anchors", "anchors that reached position k (expected counts on sampled shards)"),
)


def _percent(value) -> str:
    return "–" if value is None or math.isnan(value) else f"{100.0 * value:.0f}"


def _values(results: Results, label: str, rates: list, interval) -> dict[str, list[str]]:
    """The three rows' cell texts of one checkpoint, one entry per block position."""
    counts = results.reach.get(label, (None, None))[0]
    lows, highs = interval or ([None] * len(rates), [None] * len(rates))
    return {
        "rate": [_percent(r) for r in rates],
        "interval": [
            # <wbr>: a narrow window may put the high end under the low one rather than scroll
            "–" if "–" in (lo, hi) else f"{lo}–<wbr>{hi}"
            for lo, hi in zip(map(_percent, lows), map(_percent, highs))
        ],
        "n": [fmt(n) for n in counts] if counts is not None else ["–"] * len(rates),
    }


def position_table(results: Results) -> str:
    """Rate, interval and n per block position, three rows per checkpoint; positions under
    MIN_ANCHORS anchors carry class `few` (grey). Nothing without per-position rates."""
    rates, intervals = position_rates(results), position_intervals(results)
    if not rates:
        return ""
    longest = max(len(r) for r in rates.values())
    head = "".join(f"<th>k={k}</th>" for k in range(1, longest + 1))
    out = [f'<div class="scroll"><table class="reach"><thead><tr><th>Checkpoint</th><th></th>{head}</tr></thead>']
    out.append("<tbody>")
    for label, rate in rates.items():
        counts = results.reach.get(label, (None, None))[0]
        few = [counts is not None and k < len(counts) and counts[k] < MIN_ANCHORS for k in range(len(rate))]
        values = _values(results, label, rate, intervals.get(label))
        for index, (row, name, title) in enumerate(ROWS):
            first = f'<td rowspan="{len(ROWS)}">{breakable(label, "/")}</td>' if index == 0 else ""
            cells = "".join(
                f'<td class="few" title="fewer than {MIN_ANCHORS} anchors">{v}</td>' if f else f"<td>{v}</td>"
                for v, f in zip(values[row], few)
            )
            out.append(f'<tr class="{row}">{first}<td class="what" title="{title}">{name}</td>{cells}</tr>')
    out.append("</tbody></table></div>")
    return "".join(out)
