"""`specreplay report`: one self-contained HTML file from `specreplay score` results.

    dirs = find_results_dirs(["data/results"])   # every directory holding a summary.parquet
    results = load_results(dirs)                 # duplicates of one checkpoint left out
    html_text = render_report(results, title="Drafter run 7", worst=10)
    write_report(["data/results"], "report.html")  # the three steps, written atomically

Everything the page needs is inside it: plots are base64 PNGs (matplotlib, Agg, no pyplot
global state), CSS is inline, nothing is fetched, so the file can be mailed or opened offline.
A missing piece (no steps, no DDTree budgets, no walk.parquet, moved shards, no tokenizer)
becomes a short note in place of its part rather than an error: results from older or partial
runs still make a report.

The page's parts live beside this module: report_data (finding, de-duplicating, loading),
report_plots, report_tables, report_sample (the token-by-token view of single samples).
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import os
from dataclasses import dataclass, field

from pipeline.common.versions import specreplay_version
from scoring.report.baselines import baselines_section
from scoring.report.by_group import groups_section
from scoring.report.data import (
    TAU_UNIT,
    Duplicate,
    ReportError,
    Results,
    datasets,
    find_results_dirs,
    kinds,
    load_results,
)
from scoring.report.diagnose import diagnose_section, load_diagnoses
from scoring.report.paired import paired_section
from scoring.report.plots import (
    MIN_ANCHORS,
    plot_acceptance_by_position,
    plot_acceptance_histogram,
    plot_tau_vs_budget,
    plot_tau_vs_step,
)
from scoring.report.positions import position_table
from scoring.report.sample import SampleViews, anchor_id, choose_samples, sample_section
from scoring.report.speed import speed_parts
from scoring.report.tables import inputs_table, summary_table, worst_prompts_table
from scoring.results import ALL_DATASETS as ALL

__all__ = [
    "Duplicate",
    "ReportError",
    "Results",
    "SampleViews",
    "Written",
    "find_results_dirs",
    "load_results",
    "render_report",
    "write_report",
]

CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:#1d2330;background:#fff;
     margin:0;line-height:1.45}
main{max-width:1440px;margin:0 auto;padding:24px 28px 60px}
@media (max-width:900px){main{padding:16px 12px 40px}}
h1{font-size:1.7em;margin:0 0 4px}
h2{font-size:1.25em;margin:34px 0 8px;padding-bottom:4px;border-bottom:1px solid #dde2ea}
h3{font-size:1.05em;margin:22px 0 4px}
.meta{color:#5b6475;font-size:.9em;margin:0 0 14px}
.howto{background:#f4f7fb;border-left:4px solid #4a78c2;padding:10px 16px;font-size:.93em}
.howto p{margin:6px 0}
.scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;font-size:.88em;margin:8px 0;width:100%}
th,td{border-bottom:1px solid #e3e7ee;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f0f3f8;font-weight:600}
table.summary th,table.summary td{padding:4px 6px}
table.summary th{vertical-align:bottom}
table.summary thead th{text-align:right}
table.summary thead tr:first-child th:nth-child(-n+2),table.summary th.group{text-align:left}
table.summary th.group{border-bottom:1px solid #d0d7e2}
table.summary td:nth-child(n+3){white-space:nowrap;text-align:right;font-variant-numeric:tabular-nums}
sup.fitted{color:#a06a00;font-weight:600;cursor:help;line-height:0}
table.summary tr.group-start td{border-top:2px solid #b8c2d3}
table.reach{width:auto;font-size:.82em}
table.reach th,table.reach td{padding:2px 5px}
table.reach td{text-align:right;font-variant-numeric:tabular-nums}
table.reach td[rowspan],table.reach td.what{text-align:left;white-space:normal}
table.reach td.what{color:#5b6475}
table.reach tr.interval td,table.reach tr.n td{font-size:.9em}
table.reach tr.rate td{border-top:1px solid #d0d7e2}
table.reach td.few,table.groups td.few{color:#a8b0bd;background:#f6f7f9}
table.groups{width:auto}
table.paired td:nth-child(n+3){font-variant-numeric:tabular-nums}
table.paired tr.group-start td{border-top:2px solid #b8c2d3}
table.paired tr.better td:nth-last-child(2){color:#1f7a34;font-weight:600}
table.paired tr.worse td:nth-last-child(2){color:#b3261e;font-weight:600}
span.few{color:#a8b0bd}
table.groups td.num{text-align:right;font-variant-numeric:tabular-nums}
table.groups tr.group-start td{border-top:2px solid #b8c2d3}
table.worst td:nth-child(-n+4){white-space:nowrap}
table.inputs td{word-break:keep-all}
table.diagnose td:first-child{white-space:nowrap}
table.diagnose td:nth-child(-n+4){font-variant-numeric:tabular-nums}
td.path,span.path{overflow-wrap:anywhere}
td.hash{font-family:ui-monospace,"DejaVu Sans Mono",monospace;white-space:nowrap}
img{max-width:100%;height:auto;display:block;margin:6px 0}
.note{color:#7a5b00;background:#fff8e1;border-left:4px solid #e0b000;padding:6px 12px;font-size:.9em}
.note ul{margin:4px 0;padding-left:20px}
.muted{color:#8a93a3}
.prompt{white-space:pre-wrap;overflow-wrap:anywhere;font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:.92em}
details summary{cursor:pointer}
details .full{margin-top:6px;padding:6px;background:#f7f7f9}
caption,.caption{color:#5b6475;font-size:.9em}
section.sample{margin:0 0 18px}
.tag{font-weight:400;font-size:.8em;color:#5b6475;background:#eef1f6;border-radius:8px;padding:1px 7px}
.question{white-space:pre-wrap;font-size:.9em;color:#333c4d;background:#f7f7f9;padding:6px 10px;margin:4px 0 8px}
.tokens{white-space:pre-wrap;font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:.9em;line-height:1.9;
        max-height:30em;overflow-y:auto;border:1px solid #e3e7ee;padding:8px 10px}
.tok{border-radius:2px;box-shadow:inset 0 0 0 1px rgba(255,255,255,.9)}
.tok.acc{background:#b7e4b0}
.tok.bon{background:#f8b27a}
.tok.pre{background:#d9dde3}
s.rej{color:#c0392b;font-size:.72em;vertical-align:super;margin:0 1px}
.legend .tok{padding:1px 5px;margin-right:6px}
.legend{font-size:.88em}
.sample-index{font-size:.88em}
@media (max-width:900px){
  table.reach th,table.reach td{padding:2px 3px}
  table.worst{display:grid;grid-template-columns:repeat(var(--cols),auto)}
  table.worst thead,table.worst tbody{display:contents}
  table.worst tr{display:grid;grid-template-columns:subgrid;grid-column:1/-1;border-bottom:1px solid #e3e7ee}
  table.worst th,table.worst td{border-bottom:0;overflow-wrap:break-word}
  table.worst td:nth-child(-n+4){white-space:normal}
  table.worst th.prompt-cell{display:none}
  table.worst td.prompt-cell{grid-column:1/-1;padding-top:0}
}
"""

HOW_TO_READ = f"""
<div class="howto">
<p><b>How to read this.</b> τ (tau) is the number of tokens one decoding step appends, including the
target's own bonus token ({TAU_UNIT}); it is the speed-up ceiling before drafting cost. It comes from
the simulated decoding walk, the exact path an online greedy run would take, averaged per sample and
then over samples. Chain verification accepts the longest matching prefix of the drafted block;
DDTree-N verifies a tree of the N most probable prefixes from the same drafter pass.</p>
<p>The <b>all-anchor streak</b> is the mean number of draft tokens accepted when every response position
is used as an anchor (chain, bonus-exclusive): denser and steadier than the walk, good for comparing
checkpoints. <b>Acceptance per block position</b> shows where in the block acceptance dies.
Bold τ marks the best checkpoint per dataset; differences of a few hundredths on small prompt sets
are noise: <a href="#paired">Paired differences</a> gives each step's paired confidence interval.</p>
</div>
"""


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _section(title: str, caption: str, plot: tuple[bytes | None, str | None], after: str = "") -> str:
    png, note = plot
    parts = [f"<h2>{html.escape(title)}</h2>", f'<p class="caption">{caption}</p>']
    if png is not None:
        parts.append(_img(png, title))
    if note:
        parts.append(f'<p class="note">{html.escape(note)}</p>')
    return "".join(parts) + after


def _header(results: Results, title: str, inputs: list[str] | None, generated: dt.datetime) -> list[str]:
    n_data = len([d for d in datasets(results.summary) if d != ALL])
    parts = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="meta">{_checkpoints_count(results)}, {n_data} dataset(s) · generated '
        f"{generated.strftime('%Y-%m-%d %H:%M UTC')} by specreplay {html.escape(specreplay_version())} · inputs: "
        f"{html.escape(', '.join(inputs or results.dirs))}</p>",
    ]
    if results.duplicates:
        n = len(results.duplicates)
        which = "1 results directory held a checkpoint" if n == 1 else f"{n} results directories held checkpoints"
        parts.append(
            f'<p class="note">{which} already listed (same content hash, same shards), left out; see '
            f'<a href="#inputs">Inputs</a>.</p>'
        )
    return parts + [HOW_TO_READ]


def _checkpoints_count(results: Results) -> str:
    """'2 checkpoint(s) (2 greedy runs, 2 sampled T=0.6 runs)': distinct checkpoints (by content
    hash, else name), not results directories; one scored greedy and sampled is one checkpoint."""
    rows = results.summary.unique("label", keep="first")
    names = rows["checkpoint"] if "checkpoint" in rows.columns else rows["label"]
    hashes = rows["checkpoint_hash"] if "checkpoint_hash" in rows.columns else [None] * rows.height
    distinct = len({h or n for h, n in zip(hashes, names)})
    runs = [sum(1 for k in results.kind.values() if k == kind) for kind in kinds(results)]
    each = ", ".join(f"{n} {kind} run{'s' if n != 1 else ''}" for n, kind in zip(runs, kinds(results)))
    return f"{distinct} checkpoint(s) ({html.escape(each)})"


def _plot_sections(results: Results) -> list[str]:
    position_caption = (
        "Probability that draft token k is accepted given that tokens 1..k-1 were, over every anchor. "
        "A steep early drop means the drafter loses the thread quickly. "
        f"Points reached by fewer than {MIN_ANCHORS} anchors are grey: too few to read as a cliff. "
        "The table gives each rate, its 95% Wilson interval (the bars; it reads the anchor counts, and anchors of one "
        "response are not independent, so the spread over prompts is wider) and n, the anchors that reached the position."
    )
    return [
        _section(
            "Acceptance length per step",
            "How many tokens each step of the simulated chain walk produced: 1 means the first draft token "
            "was rejected (only the bonus token), the block size means every draft token was accepted. The "
            "legend gives τ (as in the summary table: each sample's mean, then the mean over samples) and the "
            "per-step mean of this histogram, which weighs long samples more and so differs from τ.",
            plot_acceptance_histogram(results),
        ),
        _section(
            "Acceptance per block position",
            position_caption,
            plot_acceptance_by_position(results),
            position_table(results),
        ),
        _section(
            "τ against DDTree budget",
            "Tree verification with N nodes per step; more nodes accept more but cost more target compute. "
            "At small N the tree can accept less than the chain.",
            plot_tau_vs_budget(results),
        ),
        _section(
            "τ against training step",
            "Chain τ per dataset for checkpoints that carry a training step; the black line pools all datasets.",
            plot_tau_vs_step(results),
        ),
    ]


def _speed_section(results: Results, profile) -> str:
    """ "Predicted speed" (report --profile), or nothing without a profile."""
    if profile is None:
        return ""
    caption, png, table = speed_parts(results, profile)
    return _section("Predicted speed", caption, (png, None), table)


def _sampled_caption(results) -> str:
    """The words the console uses for results scored on sampled shards (empty when none is)."""
    if "temperature" not in results.summary.columns or not (results.summary["temperature"].fill_null(0) > 0).any():
        return ""
    return (
        " Rows labelled “sampled at T=…” (shown as “(T=…, top-p …, top-k …)”) are expected τ, exact in "
        "distribution, ± its standard error over the responses; DDTree walks follow the sampled responses."
    )


def _diagnoses_only(diagnoses: list, title: str, inputs: list[str] | None, generated: dt.datetime) -> list[str]:
    """The page when the inputs hold diagnoses but no score results."""
    return [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="meta">{len(diagnoses)} diagnosis(es) · generated {generated.strftime("%Y-%m-%d %H:%M UTC")} '
        f"by specreplay {html.escape(specreplay_version())} · inputs: {html.escape(', '.join(inputs or []))}</p>",
        diagnose_section(diagnoses),
    ]


def render_report(
    results: Results | None,
    title: str | None = None,
    worst: int = 10,
    inputs: list[str] | None = None,
    generated: dt.datetime | None = None,
    views: SampleViews | None = None,
    diagnoses: list | None = None,
    profile=None,
) -> str:
    """The complete HTML document as a string. An unknown --sample id raises ReportError.
    `diagnoses` (report_diagnose.load_diagnoses) add a Diagnose section after the summary;
    with no results they are the whole page. `profile` (scoring/speed/profile.py) adds the
    Predicted speed section."""
    views = views or SampleViews()
    title = title or "specreplay report"
    generated = generated or dt.datetime.now(dt.timezone.utc)
    if results is None:
        return _document(title, _diagnoses_only(diagnoses or [], title, inputs, generated))
    chosen = choose_samples(results, views)  # first: an unknown --sample id fails before any work
    worst_intro, worst_table = worst_prompts_table(results, worst)
    body = _header(results, title, inputs, generated)
    body += [
        "<h2>Summary</h2>",
        f'<p class="caption">One row per dataset and checkpoint; τ in {TAU_UNIT}. Hover a column title for its '
        f"definition. “(all)” pools every sample.{_sampled_caption(results)}</p>",
        summary_table(results),
        baselines_section(results),
        paired_section(results),
        _speed_section(results, profile),
        diagnose_section(diagnoses or []),
        *_plot_sections(results),
        groups_section(results),
        "<h2>Worst prompts</h2>",
        worst_intro,
        worst_table,
        '<h2 id="tokens">Token by token</h2>',
        sample_section(results, views, chosen),
        '<h2 id="inputs">Inputs</h2>',
        inputs_table(results),
    ]
    return _document(title, body)


def _document(title: str, body: list[str]) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head>"
        f"<body><main>{''.join(body)}</main></body></html>\n"
    )


@dataclass
class Written:
    """What write_report did: the file, the duplicates left out, the page anchors of --sample views."""

    path: str
    duplicates: list[Duplicate] = field(default_factory=list)
    sample_anchors: dict[str, str] = field(default_factory=dict)  # --sample value -> "#sample-..."


def write_atomically(out: str, text: str) -> None:
    """out, whole or not at all: written as out.tmp and renamed; the .tmp is removed when either fails."""
    tmp = out + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_report(
    paths: list[str],
    out: str,
    title: str | None = None,
    worst: int = 10,
    views: SampleViews | None = None,
    profile=None,
) -> Written:
    """Find, load, render and write atomically (nothing is written when rendering fails)."""
    diagnoses = load_diagnoses(paths)
    try:
        results = load_results(find_results_dirs(paths))
    except ReportError:
        if not diagnoses:
            raise
        results = None  # diagnoses only
    views = views or SampleViews()
    text = render_report(
        results, title=title, worst=worst, inputs=list(paths), views=views, diagnoses=diagnoses, profile=profile
    )
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    write_atomically(out, text)
    anchors = {}
    for row, _ in choose_samples(results, SampleViews(count=0, ids=views.ids)) if results is not None else []:
        anchors.setdefault(str(row["sample_id"]), "#" + anchor_id(str(row["dataset"]), str(row["sample_id"])))
    duplicates = results.duplicates if results is not None else []
    return Written(path=out, duplicates=duplicates, sample_anchors=anchors)
