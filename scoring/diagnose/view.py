"""A diagnosis as people read it, from its files (diagnose.parquet + diagnose.json): the console
table `specreplay diagnose` prints and the rows `report` shows. Reads files only, so a saved
diagnosis prints the same as a fresh one."""

from __future__ import annotations

import json
import math
import os

from scoring import results
from scoring.results import CONFIGURED_VARIANT as CONFIGURED
from scoring.score.console import aligned, format_positions

METRIC_TITLES = {"tau": "tau (chain walk)", "streak": "streak (all anchors)", "accept_pos1": "accept@1"}


def load(directory: str) -> tuple[list[dict], dict]:
    """(diagnose.parquet rows, diagnose.json) of a diagnose directory."""
    import pyarrow.parquet as pq

    rows = pq.read_table(os.path.join(directory, results.FILES["diagnose"])).to_pylist()
    with open(os.path.join(directory, results.FILES["diagnose_run"])) as f:
        return rows, json.load(f)


def diagnose_dirs_below(path: str) -> list[str]:
    """Every directory at or below `path` holding a finished diagnosis."""
    return results.results_dirs_below(path, need=("diagnose", "diagnose_run"))


def _cell(row: dict | None) -> str:
    """'1.23' for as-configured, '1.23 (+0.45 [0.30, 0.60])' for a variant, '-' when not measured."""
    if row is None or row["value"] is None:
        return "-"
    if row["delta"] is None:
        return f"{row['value']:.2f}"
    return f"{row['value']:.2f} ({row['delta']:+.2f} [{row['ci_low']:.2f}, {row['ci_high']:.2f}])"


def table_rows(rows: list[dict]) -> list[list[str]]:
    """[variant, tau cell, streak cell, accept@1 cell, note] per variant, in diagnose order,
    a significant change marked '*'."""
    by_key = {(r["variant"], r["metric"]): r for r in rows if r["metric"] in METRIC_TITLES}
    order = list(dict.fromkeys(variant for variant, _ in by_key))  # as diagnose wrote them
    out = []
    for variant in order:
        cells = [_cell(by_key.get((variant, metric))) for metric in METRIC_TITLES]
        tau = by_key.get((variant, "tau"))
        mark = "*" if tau and tau["ci_low"] is not None and (tau["ci_low"] > 0 or tau["ci_high"] < 0) else ""
        note = ((tau or {}).get("note") or "").split(";")[0]  # the reason; the fix is printed below the table
        out.append([variant + mark, *cells, note])
    return out


def console_lines(rows: list[dict], record: dict, directory: str) -> list[str]:
    """The table, the verdict (actionable line first) and where the files are."""
    sampled = bool((record.get("sampling") or {}).get("temperature"))
    name = record["checkpoint"]["checkpoint"]
    header = ["variant", "expected tau" if sampled else METRIC_TITLES["tau"], *list(METRIC_TITLES.values())[1:], "note"]
    lines = [
        f"diagnose {name}: {record['samples']} samples, every anchor, chain; value (delta [95% CI]) vs {CONFIGURED}"
    ]
    lines += aligned(header, table_rows(rows))
    lines.append("* = the tau interval excludes zero. streak: mean accepted draft tokens per anchor (bonus-exclusive).")
    lines += [f"not measured: {note}" for note in record.get("notes", []) if ";" in note]
    lines += [f"warning: {note}" for note in record.get("notes", []) if "NaN/Inf" in note]
    lines.append("")
    lines += [f"verdict: {line}" if i == 0 else f"         {line}" for i, line in enumerate(record["verdict"])]
    lines.append(f"saved: {os.path.join(directory, results.FILES['diagnose'])}")
    return lines


def _position_rows(rows: list[dict]) -> list[dict]:
    return sorted((r for r in rows if r["metric"] == "accept_by_position"), key=lambda r: r["position"])


def acceptance_by_position(rows: list[dict]) -> list[float]:
    """As-configured acceptance by block position (NaN where never reached)."""
    return [math.nan if r["value"] is None else r["value"] for r in _position_rows(rows)]


def anchors_by_position(rows: list[dict]) -> list[float | None]:
    """The anchors that reached each block position (None: a diagnosis written before they were kept)."""
    return [r.get("anchors") for r in _position_rows(rows)]


def format_positions_row(rows: list[dict]) -> str:
    return format_positions(acceptance_by_position(rows), anchors_by_position(rows))
