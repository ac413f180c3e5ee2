"""`specreplay report`: one self-contained HTML file from `specreplay score` results.

    dirs = find_results_dirs(["data/results"])   # every directory holding a summary.parquet
    results = load_results(dirs)
    html_text = render_report(results, title="Drafter run 7", worst=10)
    write_report(["data/results"], "report.html")  # the three steps, written atomically

Everything the page needs is inside it: plots are base64 PNGs (matplotlib, Agg, no pyplot
global state), CSS is inline, nothing is fetched, so the file can be mailed or opened offline.
A missing piece (no steps, no DDTree budgets, no walk.parquet) becomes a short note in place of
its plot rather than an error: results from older or partial runs still make a report.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import json
import math
import os
from dataclasses import dataclass, field

import polars as pl

from pipeline.errors import UserError
from pipeline.versions import specreplay_version
from scoring.results import ALL_DATASETS as ALL, CHAIN, FILES, tree_method, tree_nodes_of

# Plots with more lines than this stop being readable; we show an even spread, first and last kept.
MAX_SERIES = 10
PROMPT_PREVIEW_CHARS = 160
TAU_UNIT = "tokens per step, bonus-inclusive"


class ReportError(UserError):
    """Results that cannot make a report (none found, unreadable file); the message names the path."""


# ---------------------------------------------------------------- loading


def find_results_dirs(paths: list[str]) -> list[str]:
    """Every directory at or below `paths` that holds a summary.parquet, sorted, without duplicates."""
    found: list[str] = []
    for path in paths:
        if not os.path.isdir(path):
            raise ReportError(f"{path}: not a directory (pass results directories written by `specreplay score`)")
        for root, dirs, files in os.walk(path):
            dirs.sort()
            if FILES["summary"] in files:
                found.append(os.path.abspath(root))
    unique = sorted(set(found))
    if not unique:
        raise ReportError(f"no summary.parquet at or below {', '.join(paths)}; run `specreplay score` first")
    return unique


@dataclass
class Results:
    """Everything the report shows, with a `label` column naming each checkpoint uniquely."""

    dirs: list[str]
    summary: pl.DataFrame
    samples: pl.DataFrame | None  # method chain only
    walk: pl.DataFrame | None  # method chain only: label, produced
    runs: dict[str, dict] = field(default_factory=dict)  # dir -> run.json (or {})
    order: list[str] = field(default_factory=list)  # labels by training step, then name
    steps: dict[str, int | None] = field(default_factory=dict)


def _read(path: str, method: str | None = None, columns: list[str] | None = None) -> pl.DataFrame:
    try:
        frame = pl.scan_parquet(path)
        names = frame.collect_schema().names()
        if method is not None:
            frame = frame.filter(pl.col("method") == method)
        if columns is not None:
            frame = frame.select([c for c in columns if c in names])
        return frame.collect()
    except Exception as error:  # polars raises several types for a truncated or foreign file
        raise ReportError(f"{path}: cannot read ({error})") from error


def _labels(summaries: list[tuple[str, pl.DataFrame]]) -> dict[str, str]:
    """dir -> display label. The checkpoint name is the label unless two directories share it
    (one checkpoint scored on two shard sets, or two runs both called step_300): then the
    directory name tells them apart."""
    names = {
        d: (s["checkpoint"][0] if "checkpoint" in s.columns and s.height else os.path.basename(d)) for d, s in summaries
    }
    counts: dict[str, int] = {}
    for name in names.values():
        counts[name] = counts.get(name, 0) + 1
    return {d: name if counts[name] == 1 else f"{name} [{os.path.basename(d)}]" for d, name in names.items()}


def load_results(dirs: list[str]) -> Results:
    """Read summary (all columns), samples and walk (chain rows, needed columns) of each directory."""
    summaries = [(d, _read(os.path.join(d, FILES["summary"]))) for d in dirs]
    labels = _labels(summaries)
    sample_cols = ["dataset", "sample_id", "tau", "steps", "response_len", "finish_reason", "prompt_text"]
    summary_parts, sample_parts, walk_parts, runs = [], [], [], {}
    for d, summary in summaries:
        label = pl.lit(labels[d])
        summary_parts.append(summary.with_columns(label=label, results_dir=pl.lit(d)))
        if os.path.exists(os.path.join(d, FILES["samples"])):
            s = _read(os.path.join(d, FILES["samples"]), CHAIN, sample_cols)
            sample_parts.append(s.with_columns(label=label))
        if os.path.exists(os.path.join(d, FILES["walk"])):
            w = _read(os.path.join(d, FILES["walk"]), CHAIN, ["produced"])
            walk_parts.append(w.with_columns(label=label))
        runs[d] = _read_run(d)
    # diagonal_relaxed: directories may differ in budgets (columns) or have an all-null step
    # column (Null dtype), which a plain concat refuses.
    summary_df = pl.concat(summary_parts, how="diagonal_relaxed")
    if "checkpoint_step" not in summary_df.columns:
        summary_df = summary_df.with_columns(checkpoint_step=pl.lit(None, dtype=pl.Int64))
    steps = {}
    for row in summary_df.select("label", "checkpoint_step").unique("label").iter_rows():
        steps[row[0]] = None if row[1] is None else int(row[1])
    order = sorted(steps, key=lambda lab: (steps[lab] is None, steps[lab] or 0, lab))
    return Results(
        dirs=list(dirs),
        summary=summary_df,
        samples=pl.concat(sample_parts, how="diagonal_relaxed") if sample_parts else None,
        walk=pl.concat(walk_parts, how="diagonal_relaxed") if walk_parts else None,
        runs=runs,
        order=order,
        steps=steps,
    )


def _read_run(directory: str) -> dict:
    try:
        with open(os.path.join(directory, FILES["run"])) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}  # run.json is context for the inputs table, never required


# ---------------------------------------------------------------- helpers


def ddtree_budgets(summary: pl.DataFrame) -> list[int]:
    """The DDTree budgets (tree nodes) present in a summary, ascending."""
    nodes = set()
    for method in summary["method"].unique().to_list():
        try:
            nodes.add(tree_nodes_of(method))
        except ValueError:
            continue  # a method this version does not know: not a budget
    return sorted(nodes - {None})


def datasets(summary: pl.DataFrame) -> list[str]:
    """(all) first, then the datasets by name."""
    names = sorted(set(summary["dataset"].to_list()) - {ALL})
    return ([ALL] if ALL in set(summary["dataset"]) else []) + names


def pick_evenly(items: list, k: int) -> list:
    """At most k items spread evenly over the list, first and last always kept."""
    if len(items) <= k:
        return list(items)
    index = sorted({round(i * (len(items) - 1) / (k - 1)) for i in range(k)})
    return [items[i] for i in index]


def _colors(labels: list[str], steps: dict[str, int | None]) -> dict[str, tuple]:
    """Checkpoints ordered by training step get a sequential palette, so progress reads as a
    gradient; otherwise a categorical one."""
    from matplotlib import colormaps

    if len(labels) > 1 and all(steps.get(lab) is not None for lab in labels):
        cmap = colormaps["viridis"]
        return {lab: cmap(0.85 * i / (len(labels) - 1)) for i, lab in enumerate(labels)}
    cmap = colormaps["tab10"]
    return {lab: cmap(i % 10) for i, lab in enumerate(labels)}


def _new_figure(width: float = 9.2, height: float = 4.4):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    ax = fig.subplots()
    ax.grid(True, alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)
    return fig, ax


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", facecolor="white")
    return buffer.getvalue()


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _chain_all(summary: pl.DataFrame) -> pl.DataFrame:
    return summary.filter((pl.col("dataset") == ALL) & (pl.col("method") == CHAIN))


# ---------------------------------------------------------------- plots
# Each returns (png bytes, None) or (None, note saying why there is no plot).


def plot_acceptance_histogram(results: Results) -> tuple[bytes | None, str | None]:
    if results.walk is None or results.walk.height == 0:
        return None, "No walk.parquet with chain steps in these results, so no histogram."
    labels = pick_evenly([lab for lab in results.order if lab in set(results.walk["label"])], MAX_SERIES)
    colors = _colors(labels, results.steps)
    counts = results.walk.filter(pl.col("label").is_in(labels)).group_by("label", "produced").len()
    top = int(counts["produced"].max())
    fig, ax = _new_figure()
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        mine = counts.filter(pl.col("label") == label)
        total = mine["len"].sum()
        share = {int(p): 100.0 * n / total for p, n in zip(mine["produced"], mine["len"])}
        mean = sum(p * s for p, s in share.items()) / 100.0
        xs = [x + (i - (len(labels) - 1) / 2) * width for x in range(1, top + 1)]
        ax.bar(
            xs,
            [share.get(x, 0.0) for x in range(1, top + 1)],
            width=width,
            color=colors[label],
            label=f"{label} (mean {mean:.2f})",
        )
    ax.set_xticks(range(1, top + 1))
    ax.set_xlabel(f"tokens produced in one decoding step ({TAU_UNIT})")
    ax.set_ylabel("share of decoding steps (%)")
    ax.set_title("Acceptance length per decoding step (chain, simulated walk)")
    ax.legend(fontsize=8, title="checkpoint", title_fontsize=8)
    return _png(fig), None


def plot_acceptance_by_position(results: Results) -> tuple[bytes | None, str | None]:
    rows = _chain_all(results.summary)
    if "accept_rate_by_position" not in rows.columns:
        return None, "The summaries carry no accept_rate_by_position (no all-anchor results)."
    rates = {lab: r for lab, r in zip(rows["label"], rows["accept_rate_by_position"]) if r is not None and len(r)}
    labels = pick_evenly([lab for lab in results.order if lab in rates], MAX_SERIES)
    if not labels:
        return None, "No checkpoint has per-position acceptance rates (no anchors were scored)."
    colors = _colors(labels, results.steps)
    fig, ax = _new_figure()
    longest = 0
    for label in labels:
        # NaN (a position no anchor reached) leaves a gap rather than a fake zero
        ys = [100.0 * v if v is not None else math.nan for v in rates[label]]
        longest = max(longest, len(ys))
        ax.plot(range(1, len(ys) + 1), ys, marker="o", ms=4, color=colors[label], label=label)
    ax.set_xticks(range(1, longest + 1))
    ax.set_ylim(0, 102)
    ax.set_xlabel("block position k (draft token k after the anchor)")
    ax.set_ylabel("P(accepted | position reached) (%)")
    ax.set_title("Acceptance per block position (chain, every anchor, all datasets)")
    ax.legend(fontsize=8, title="checkpoint", title_fontsize=8)
    return _png(fig), None


def plot_tau_vs_budget(results: Results) -> tuple[bytes | None, str | None]:
    budgets = ddtree_budgets(results.summary)
    if not budgets:
        return None, "No DDTree budgets were scored (ddtree-N methods absent), so there is no budget curve."
    rows = results.summary.filter(pl.col("dataset") == ALL)
    labels = pick_evenly([lab for lab in results.order if lab in set(rows["label"])], MAX_SERIES)
    colors = _colors(labels, results.steps)
    fig, ax = _new_figure()
    for label in labels:
        mine = rows.filter(pl.col("label") == label)
        tau = dict(zip(mine["method"], mine["tau"]))
        xs = [n for n in budgets if tau.get(tree_method(n)) is not None]
        ax.plot(xs, [tau[tree_method(n)] for n in xs], marker="o", ms=4, color=colors[label], label=label)
        if tau.get(CHAIN) is not None:
            ax.axhline(tau[CHAIN], color=colors[label], linestyle="--", linewidth=1, alpha=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(n) for n in budgets])
    ax.set_xlabel("DDTree node budget N (log2 scale)")
    ax.set_ylabel(f"τ ({TAU_UNIT})")
    ax.set_title("τ against DDTree budget (dashed: chain τ of the same checkpoint)")
    ax.legend(fontsize=8, title="checkpoint", title_fontsize=8)
    return _png(fig), None


def plot_tau_vs_step(results: Results) -> tuple[bytes | None, str | None]:
    stepped = [lab for lab in results.order if results.steps.get(lab) is not None]
    if not stepped:
        return None, (
            "No checkpoint carries a training step (none in its config or path, e.g. step_2000), "
            "so there is no training curve."
        )
    rows = results.summary.filter((pl.col("method") == CHAIN) & pl.col("label").is_in(stepped))
    # Checkpoints from several runs (run_a/step_100, run_b/step_100) get one line per run and
    # dataset; a single line through both would zigzag between runs.
    run_of = {lab: lab.rsplit("/", 1)[0] if "/" in lab else "" for lab in stepped}
    several_runs = len(set(run_of.values())) > 1
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    fig, ax = _new_figure()
    names = datasets(rows)
    for d_index, dataset in enumerate(names):
        for run in sorted(set(run_of.values())):
            mine = rows.filter(
                (pl.col("dataset") == dataset) & pl.col("label").is_in([lab for lab in stepped if run_of[lab] == run])
            )
            points = sorted(
                (results.steps[lab], tau) for lab, tau in zip(mine["label"], mine["tau"]) if tau is not None
            )
            if not points:
                continue
            name = f"{run} · {dataset}" if several_runs else dataset
            overall = dataset == ALL
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker="o",
                ms=4,
                color="black" if overall else cmap(d_index % 10),
                linewidth=2.2 if overall else 1.3,
                linestyle=["-", "--", ":", "-."][sorted(set(run_of.values())).index(run) % 4],
                label=name,
            )
    ax.set_xlabel("training step")
    ax.set_ylabel(f"chain τ ({TAU_UNIT})")
    ax.set_title("Chain τ against training step, per dataset")
    ax.legend(fontsize=8, title="dataset", title_fontsize=8)
    note = None
    if len(stepped) == 1:
        note = "Only one checkpoint carries a training step, so the curve is a single point."
    elif len(stepped) < len(results.order):
        note = f"{len(results.order) - len(stepped)} checkpoint(s) without a training step are left out of this plot."
    return _png(fig), note


# ---------------------------------------------------------------- HTML pieces


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def summary_table(results: Results) -> str:
    s = results.summary
    budgets = ddtree_budgets(s)
    has_streak = "anchor_accepted_len_mean" in s.columns
    head = ["Dataset", "Checkpoint", "Step", "Samples", "τ chain"] + [f"τ DDTree-{n}" for n in budgets]
    if has_streak:
        head.append("All-anchor streak")
    head.append("Inexact samples")
    titles = {
        "τ chain": f"mean over samples of tokens per decoding step ({TAU_UNIT})",
        "All-anchor streak": "mean accepted draft tokens per anchor over every response position "
        "(chain, bonus-exclusive)",
        "Inexact samples": "samples whose walk is not exact (not greedy, or argmax mismatches)",
    }
    out = ["<table class=summary><thead><tr>"]
    out += [f'<th title="{html.escape(titles.get(h, ""))}">{html.escape(h)}</th>' for h in head]
    out.append("</tr></thead><tbody>")
    for dataset in datasets(s):
        rows = s.filter(pl.col("dataset") == dataset)
        by = {(r["label"], r["method"]): r for r in rows.iter_rows(named=True)}
        chain_taus = [
            by[(lab, CHAIN)]["tau"]
            for lab in results.order
            if (lab, CHAIN) in by and by[(lab, CHAIN)]["tau"] is not None
        ]
        best = max(chain_taus) if len(chain_taus) > 1 else None
        first = True
        for label in results.order:
            chain = by.get((label, CHAIN))
            if chain is None:
                continue
            css, first = (' class="group-start"' if first else ""), False
            cells = [
                html.escape(dataset),
                html.escape(label),
                _fmt(results.steps.get(label)),
                _fmt(chain.get("samples")),
            ]
            tau = _fmt(chain["tau"])
            cells.append(f"<b>{tau}</b>" if best is not None and chain["tau"] == best else tau)
            cells += [_fmt((by.get((label, tree_method(n))) or {}).get("tau")) for n in budgets]
            if has_streak:
                cells.append(_fmt(chain.get("anchor_accepted_len_mean")))
            cells.append(_fmt(chain.get("inexact_samples")))
            out.append(f"<tr{css}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _prompt_cell(text: str | None) -> str:
    if not text:
        return '<span class="muted">(no prompt text)</span>'
    if len(text) <= PROMPT_PREVIEW_CHARS:
        return f'<div class="prompt">{html.escape(text)}</div>'
    preview = html.escape(text[:PROMPT_PREVIEW_CHARS].rstrip()) + "…"
    return (
        f'<details><summary class="prompt">{preview}</summary>'
        f'<div class="prompt full">{html.escape(text)}</div></details>'
    )


def worst_prompts_table(results: Results, worst: int) -> tuple[str, str]:
    """(intro paragraph, table) for the `worst` samples of the latest checkpoint by chain tau;
    the tau of the same sample under earlier checkpoints shows whether it is improving."""
    if worst <= 0:
        return "", '<p class="note">Not requested (--worst 0).</p>'
    if results.samples is None or results.samples.height == 0:
        return "", '<p class="note">No samples.parquet in these results, so no per-prompt view.</p>'
    samples = results.samples
    with_samples = [lab for lab in results.order if lab in set(samples["label"])]
    reference = with_samples[-1]
    ref = samples.filter((pl.col("label") == reference) & pl.col("tau").is_not_null()).sort("tau").head(worst)
    history_labels = pick_evenly(with_samples, 6) if len(with_samples) > 1 else []
    key_tau = {(r["label"], r["dataset"], r["sample_id"]): r["tau"] for r in samples.iter_rows(named=True)}
    head = ["#", "Dataset", "Sample", "τ chain", "Steps", "Response tokens", "Finish"]
    if history_labels:
        head.insert(4, "τ across checkpoints")
    out = ["<table class=worst><thead><tr>"] + [f"<th>{h}</th>" for h in head] + ["<th>Prompt</th></tr></thead><tbody>"]
    for rank, r in enumerate(ref.iter_rows(named=True), start=1):
        cells = [str(rank), html.escape(str(r["dataset"])), html.escape(str(r["sample_id"])), _fmt(r["tau"], 2)]
        if history_labels:
            trail = [_fmt(key_tau.get((lab, r["dataset"], r["sample_id"])), 2) for lab in history_labels]
            cells.append(" → ".join(trail))
        cells += [_fmt(r.get("steps")), _fmt(r.get("response_len")), html.escape(str(r.get("finish_reason") or "–"))]
        out.append(
            "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + f"<td>{_prompt_cell(r.get('prompt_text'))}</td></tr>"
        )
    out.append("</tbody></table>")
    skipped = samples.filter((pl.col("label") == reference) & pl.col("tau").is_null()).height
    which = "the latest checkpoint" if results.steps.get(reference) is not None else "the last checkpoint listed"
    intro = f"The {ref.height} samples with the lowest chain τ under <b>{html.escape(reference)}</b> ({which})"
    if history_labels:
        intro += "; “τ across checkpoints” follows the same sample through " + ", ".join(
            html.escape(lab) for lab in history_labels
        )
    intro += ". Click a long prompt to see all of it."
    if skipped:
        intro += f" {skipped} sample(s) with no decoding step (empty response) are left out."
    return f"<p>{intro}</p>", "".join(out)


def inputs_table(results: Results) -> str:
    out = [
        "<table class=inputs><thead><tr><th>Results directory</th><th>Checkpoint</th><th>Hash</th>"
        "<th>Step</th><th>Shards</th><th>Samples</th><th>Device / dtype</th><th>Scoring time</th></tr></thead><tbody>"
    ]
    first = {r["results_dir"]: r for r in results.summary.unique("results_dir", keep="first").iter_rows(named=True)}
    for d in results.dirs:
        row, run = first.get(d, {}), results.runs.get(d, {})
        shards = run.get("shards", {})
        device = f"{run['device']} / {run.get('dtype', '?')}" if "device" in run else "–"
        wall = f"{run['wall_time_s']:.1f} s" if isinstance(run.get("wall_time_s"), (int, float)) else "–"
        cells = [
            d,
            row.get("label", "–"),
            row.get("checkpoint_hash", "–"),
            _fmt(row.get("checkpoint_step")),
            shards.get("uri", "–"),
            _fmt(shards.get("samples")),
            device,
            wall,
        ]
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:#1d2330;background:#fff;
     margin:0;line-height:1.45}
main{max-width:1100px;margin:0 auto;padding:24px 28px 60px}
h1{font-size:1.7em;margin:0 0 4px}
h2{font-size:1.25em;margin:34px 0 8px;padding-bottom:4px;border-bottom:1px solid #dde2ea}
.meta{color:#5b6475;font-size:.9em;margin:0 0 14px}
.howto{background:#f4f7fb;border-left:4px solid #4a78c2;padding:10px 16px;font-size:.93em}
.howto p{margin:6px 0}
table{border-collapse:collapse;font-size:.88em;margin:8px 0;width:100%}
th,td{border-bottom:1px solid #e3e7ee;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f0f3f8;font-weight:600}
table.summary td:nth-child(n+3){text-align:right;font-variant-numeric:tabular-nums}
table.summary tr.group-start td{border-top:2px solid #b8c2d3}
table.worst td:nth-child(-n+7){white-space:nowrap}
table.inputs td{word-break:break-all}
img{max-width:100%;height:auto;display:block;margin:6px 0}
.note{color:#7a5b00;background:#fff8e1;border-left:4px solid #e0b000;padding:6px 12px;font-size:.9em}
.muted{color:#8a93a3}
.prompt{white-space:pre-wrap;font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:.92em}
details summary{cursor:pointer}
details .full{margin-top:6px;padding:6px;background:#f7f7f9}
caption,.caption{color:#5b6475;font-size:.9em}
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
are noise: compare checkpoints with a paired confidence interval before trusting them.</p>
</div>
"""


def _section(title: str, caption: str, plot: tuple[bytes | None, str | None]) -> str:
    png, note = plot
    parts = [f"<h2>{html.escape(title)}</h2>", f'<p class="caption">{caption}</p>']
    if png is not None:
        parts.append(_img(png, title))
    if note:
        parts.append(f'<p class="note">{html.escape(note)}</p>')
    return "".join(parts)


def render_report(
    results: Results,
    title: str | None = None,
    worst: int = 10,
    inputs: list[str] | None = None,
    generated: dt.datetime | None = None,
) -> str:
    """The complete HTML document as a string."""
    # Long only because it lists the page's sections in order, each with its caption.
    generated = generated or dt.datetime.now(dt.timezone.utc)
    title = title or "specreplay report"
    n_ckpt, n_data = len(results.order), len([d for d in datasets(results.summary) if d != ALL])
    worst_intro, worst_table = worst_prompts_table(results, worst)
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="meta">{n_ckpt} checkpoint(s), {n_data} dataset(s) · generated '
        f"{generated.strftime('%Y-%m-%d %H:%M UTC')} by specreplay {html.escape(specreplay_version())} · inputs: "
        f"{html.escape(', '.join(inputs or results.dirs))}</p>",
        HOW_TO_READ,
        "<h2>Summary</h2>",
        f'<p class="caption">One row per dataset and checkpoint; τ in {TAU_UNIT}. Hover a column title for its '
        f"definition. “(all)” pools every sample.</p>",
        summary_table(results),
        _section(
            "Acceptance length per step",
            "How many tokens each step of the simulated chain walk produced: 1 means the first draft token "
            "was rejected (only the bonus token), the block size means every draft token was accepted.",
            plot_acceptance_histogram(results),
        ),
        _section(
            "Acceptance per block position",
            "Probability that draft token k is accepted given that tokens 1..k-1 were, over every anchor. "
            "A steep early drop means the drafter loses the thread quickly.",
            plot_acceptance_by_position(results),
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
        "<h2>Worst prompts</h2>",
        worst_intro,
        worst_table,
        "<h2>Inputs</h2>",
        inputs_table(results),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head>"
        f"<body><main>{''.join(body)}</main></body></html>\n"
    )


def write_report(paths: list[str], out: str, title: str | None = None, worst: int = 10) -> str:
    """Find, load, render and write atomically; returns the absolute output path."""
    results = load_results(find_results_dirs(paths))
    text = render_report(results, title=title, worst=worst, inputs=list(paths))
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, out)
    return out
