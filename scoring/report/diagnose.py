"""The report's "Diagnose" section: every `specreplay diagnose` found under the report's inputs,
its verdict first, then the variant table the console prints (scoring/diagnose/view.py)."""

from __future__ import annotations

import html
import os
import re

from scoring.diagnose.view import METRIC_TITLES, diagnose_dirs_below, format_positions_row, load, table_rows


def load_diagnoses(paths: list[str]) -> list[tuple[str, list[dict], dict]]:
    """(directory, diagnose.parquet rows, diagnose.json) of every diagnosis at or below `paths`."""
    found = sorted({d for path in paths if os.path.isdir(path) for d in diagnose_dirs_below(path)})
    return [(d, *load(d)) for d in found]


def _one(directory: str, rows: list[dict], record: dict) -> str:
    name = record["checkpoint"]["checkpoint"]
    sampled = bool((record.get("sampling") or {}).get("temperature"))
    verdict = record["verdict"]
    header = ["variant", "expected tau" if sampled else METRIC_TITLES["tau"], *list(METRIC_TITLES.values())[1:], "note"]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in row) + "</tr>" for row in table_rows(rows))
    rest = "".join(f"<li>{html.escape(line)}</li>" for line in verdict[1:])
    return (
        f'<div class="diagnosis"><h3>{html.escape(name)}</h3>'
        f"<p><b>{html.escape(verdict[0])}</b></p>{f'<ul>{rest}</ul>' if rest else ''}"
        f'<p class="caption">{record["samples"]} samples, every anchor, chain; each cell is the value and, for a '
        f"variant, its change from as-configured with a paired-bootstrap 95% interval over samples; * marks a tau "
        f"interval that excludes zero.{_positions(rows, verdict)} From "
        f'<span class="path">{html.escape(directory)}</span>.</p>'
        f'<div class="scroll"><table class="diagnose"><tr>{head}</tr>{body}</table></div></div>'
    )


def _cell(text: str) -> str:
    """A cell that wraps only between its value, its change and its interval ('1.23 (+0.45 [0.30, 0.60])'),
    so a narrow window keeps the note column on the page."""
    return re.sub(r"\[([^\]]*), ", r"[\1,&nbsp;", html.escape(text))


def _positions(rows: list[dict], verdict: list[str]) -> str:
    """As-configured acceptance by block position, unless the verdict already shows it."""
    text = format_positions_row(rows)
    return "" if text in verdict[0] else f" As configured, acceptance by block position: {html.escape(text)}."


def diagnose_section(diagnoses: list[tuple[str, list[dict], dict]]) -> str:
    """The section's HTML; empty when no diagnosis was found."""
    if not diagnoses:
        return ""
    intro = (
        '<p class="caption"><code>specreplay diagnose</code> replayed each checkpoint under its own configuration and '
        "under variants that change one convention (block position ids, context length, feature layer, "
        "windows, block mask, scales, precision). A variant that scores clearly better names the convention "
        "the checkpoint was trained under.</p>"
    )
    return '<h2 id="diagnose">Diagnose</h2>' + intro + "".join(_one(*d) for d in diagnoses)
