"""The report's plots: matplotlib figures (Agg, no pyplot global state) returned as PNG bytes.

Each plot function returns (png bytes, None) or (None, note saying why there is no plot), or a
note beside the plot when part of the data is left out.
"""

from __future__ import annotations

import io
import math

import polars as pl

from scoring.methods.chain import CHAIN
from scoring.methods.ddtree import DDTREE
from scoring.report.data import TAU_UNIT, Results, chain_all, datasets, ddtree_budgets, pick_evenly, run_of
from scoring.results import ALL_DATASETS as ALL, MIN_ANCHORS

# Plots with more lines than this stop being readable; we show an even spread, first and last kept.
MAX_SERIES = 10
FEW_COLOR = "#a8b0bd"


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


def _chain_tau(results: Results) -> dict[str, float | None]:
    rows = chain_all(results.summary)
    return dict(zip(rows["label"], rows["tau"]))


def plot_acceptance_histogram(results: Results) -> tuple[bytes | None, str | None]:
    if results.walk is None or results.walk.height == 0:
        return None, "No walk.parquet with chain steps in these results, so no histogram."
    labels = pick_evenly([lab for lab in results.order if lab in set(results.walk["label"])], MAX_SERIES)
    colors, taus = _colors(labels, results.steps), _chain_tau(results)
    counts = results.walk.filter(pl.col("label").is_in(labels)).group_by("label", "produced").len()
    top = int(counts["produced"].max())
    fig, ax = _new_figure()
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        mine = counts.filter(pl.col("label") == label)
        total = mine["len"].sum()
        share = {int(p): 100.0 * n / total for p, n in zip(mine["produced"], mine["len"])}
        # Both numbers are named: tau (the table's) averages each sample's mean first; the
        # per-step mean pools all steps, so long samples weigh more and it differs from tau.
        per_step = sum(p * s for p, s in share.items()) / 100.0
        tau = taus.get(label)
        name = f"{label} (τ {tau:.3f}; per-step mean {per_step:.2f})" if tau is not None else label
        xs = [x + (i - (len(labels) - 1) / 2) * width for x in range(1, top + 1)]
        ax.bar(xs, [share.get(x, 0.0) for x in range(1, top + 1)], width=width, color=colors[label], label=name)
    ax.set_xticks(range(1, top + 1))
    ax.set_xlabel(f"tokens produced in one decoding step ({TAU_UNIT})")
    ax.set_ylabel("share of decoding steps (%)")
    ax.set_title("Acceptance length per decoding step (chain, simulated walk)")
    ax.legend(fontsize=8, title="checkpoint", title_fontsize=8)
    return _png(fig), None


def _draw_rates(ax, ys: list[float], counts: list[int] | None, color, label: str, annotate: bool) -> None:
    """One checkpoint's per-position rates: solid where at least MIN_ANCHORS anchors reached the
    position, grey hollow points on a dotted line where fewer did, n written beside those (and
    beside every point when `annotate`)."""
    xs = list(range(1, len(ys) + 1))
    few = [counts is not None and counts[i] < MIN_ANCHORS for i in range(len(ys))]
    solid = [y if not f else math.nan for y, f in zip(ys, few)]
    ax.plot(xs, ys, linestyle=":", color=FEW_COLOR, linewidth=1)  # the whole curve, under the solid part
    ax.plot(xs, solid, marker="o", ms=4, color=color, label=label)
    grey = [(x, y) for x, y, f in zip(xs, ys, few) if f and not math.isnan(y)]
    if grey:
        ax.plot(*zip(*grey), linestyle="none", marker="o", ms=5, mfc="white", mec=FEW_COLOR)
    for i, (x, y) in enumerate(zip(xs, ys)):
        if counts is not None and not math.isnan(y) and (annotate or few[i]):
            ax.annotate(
                f"n={counts[i]}", (x, y), textcoords="offset points", xytext=(4, 5), fontsize=7, color="#5b6475"
            )


def _draw_interval(ax, interval: tuple[list, list], counts: list[int] | None, color) -> None:
    """A bar over each solid point from its Wilson low to high (none over the grey, thin ones)."""
    for k, (low, high) in enumerate(zip(*interval), start=1):
        thin = counts is not None and k <= len(counts) and counts[k - 1] < MIN_ANCHORS
        if low is not None and high is not None and not math.isnan(low) and not thin:
            ax.vlines(k, 100.0 * low, 100.0 * high, color=color, linewidth=1.2, alpha=0.7)


def position_rates(results: Results) -> dict[str, list[float]]:
    """label -> chain acceptance per block position (all datasets), for the checkpoints shown:
    at most MAX_SERIES, spread evenly over the order."""
    rows = chain_all(results.summary)
    if "accept_rate_by_position" not in rows.columns:
        return {}
    rates = {lab: r for lab, r in zip(rows["label"], rows["accept_rate_by_position"]) if r is not None and len(r)}
    return {lab: rates[lab] for lab in pick_evenly([lab for lab in results.order if lab in rates], MAX_SERIES)}


def position_intervals(results: Results) -> dict[str, tuple[list, list]]:
    """label -> (low, high) per block position: the 95% Wilson interval score wrote beside each
    rate (summary.parquet's accept_rate_low/high_by_position); absent for results of an older score."""
    rows = chain_all(results.summary)
    if "accept_rate_low_by_position" not in rows.columns or "accept_rate_high_by_position" not in rows.columns:
        return {}
    found = zip(rows["label"], rows["accept_rate_low_by_position"], rows["accept_rate_high_by_position"])
    return {lab: (list(low), list(high)) for lab, low, high in found if low is not None and high is not None}


def plot_acceptance_by_position(results: Results) -> tuple[bytes | None, str | None]:
    if "accept_rate_by_position" not in results.summary.columns:
        return None, "The summaries carry no accept_rate_by_position (no all-anchor results)."
    rates = position_rates(results)
    labels = list(rates)
    if not labels:
        return None, "No checkpoint has per-position acceptance rates (no anchors were scored)."
    colors, intervals = _colors(labels, results.steps), position_intervals(results)
    fig, ax = _new_figure()
    longest = 0
    for label in labels:
        # NaN (a position no anchor reached) leaves a gap rather than a fake zero
        ys = [100.0 * v if v is not None else math.nan for v in rates[label]]
        longest = max(longest, len(ys))
        counts = results.reach.get(label, (None, None))[0]
        _draw_rates(ax, ys, counts, colors[label], label, annotate=len(labels) == 1)
        if label in intervals:
            _draw_interval(ax, intervals[label], counts, colors[label])
    ax.set_xticks(range(1, longest + 1))
    ax.set_ylim(0, 108)
    ax.set_xlabel("block position k (draft token k after the anchor)")
    ax.set_ylabel("P(accepted | position reached) (%)")
    ax.set_title(
        f"Acceptance per block position (chain, every anchor; bars: 95% Wilson; grey: < {MIN_ANCHORS} anchors)"
    )
    ax.legend(fontsize=8, title="checkpoint", title_fontsize=8)
    return _png(fig), _missing_counts_note(results, labels)


def _missing_counts_note(results: Results, labels: list[str]) -> str | None:
    """Which checkpoints' points carry no n: greedy ones lacking anchors.parquet, sampled ones whose
    summary lacks reached_by_position (anchors.parquet cannot give the expected count at T > 0)."""
    missing = [lab for lab in labels if lab not in results.reach]
    greedy = [lab for lab in missing if results.kind.get(lab, "greedy") == "greedy"]
    sampled = [lab for lab in missing if lab not in greedy]
    notes = []
    if greedy:
        notes.append(f"No anchors.parquet for {', '.join(greedy)}")
    if sampled:
        notes.append(f"no reached_by_position in the summary of {', '.join(sampled)} (an older score)")
    if not notes:
        return None
    return "; ".join(notes) + ", so the number of anchors behind each point is unknown there and no point is greyed."


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
        xs = [n for n in budgets if tau.get(DDTREE.name(n)) is not None]
        ax.plot(xs, [tau[DDTREE.name(n)] for n in xs], marker="o", ms=4, color=colors[label], label=label)
        if tau.get(CHAIN) is not None:
            ax.axhline(tau[CHAIN], color=colors[label], linestyle="--", linewidth=1, alpha=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(n) for n in budgets])
    ax.set_xlabel("DDTree node budget N (log2 scale)")
    ax.set_ylabel(f"τ ({TAU_UNIT})")
    ax.set_title("τ against DDTree budget (dashed: chain τ of the same checkpoint)")
    ax.legend(fontsize=8, title="checkpoint", title_fontsize=8)
    return _png(fig), None


def _step_lines(results: Results, stepped: list[str]):
    """(name, [(step, tau)], dataset index, run index, is the pooled line) per run and dataset.
    Checkpoints from several runs (run_a/step_100, run_b/step_100) get one line per run and
    dataset; a single line through both would zigzag between runs."""
    rows = results.summary.filter((pl.col("method") == CHAIN) & pl.col("label").is_in(stepped))
    # a run is a training run and a decoding kind: greedy and sampled τ are different experiments
    named = len(set(results.kind.values())) > 1
    runs_of = {lab: run_of(results, lab, named) for lab in stepped}
    runs = sorted(set(runs_of.values()))
    for d_index, dataset in enumerate(datasets(rows)):
        for r_index, run in enumerate(runs):
            mine = rows.filter(
                (pl.col("dataset") == dataset) & pl.col("label").is_in([lab for lab in stepped if runs_of[lab] == run])
            )
            points = sorted(
                (results.steps[lab], tau) for lab, tau in zip(mine["label"], mine["tau"]) if tau is not None
            )
            if points:
                name = f"{run} · {dataset}" if len(runs) > 1 else dataset
                yield name, points, d_index, r_index, dataset == ALL


def _tree_step_lines(results: Results, stepped: list[str]):
    """('(all) ddtree-N', [(step, tau)]) per DDTree budget over every dataset pooled; one run
    only (several runs' checkpoints share steps, and their lines would zigzag)."""
    if len({(lab.rsplit("/", 1)[0], results.kind.get(lab)) for lab in stepped}) > 1:
        return
    rows = results.summary.filter((pl.col("dataset") == ALL) & pl.col("label").is_in(stepped))
    for nodes in ddtree_budgets(results.summary):
        mine = rows.filter(pl.col("method") == DDTREE.name(nodes))
        points = sorted((results.steps[lab], tau) for lab, tau in zip(mine["label"], mine["tau"]) if tau is not None)
        if points:
            yield f"{ALL} {DDTREE.name(nodes)}", points


def plot_tau_vs_step(results: Results) -> tuple[bytes | None, str | None]:
    fig, note = tau_vs_step_figure(results)
    return (None if fig is None else _png(fig)), note


def tau_vs_step_figure(results: Results):
    """(figure, note) of chain tau per dataset and pooled DDTree tau against training step, or
    (None, why not). The legend sits right of the axes: inside, it covered the DDTree lines."""
    stepped = [lab for lab in results.order if results.steps.get(lab) is not None]
    if not stepped:
        return None, (
            "No checkpoint carries a training step (none in its config or path, e.g. step_2000), "
            "so there is no training curve."
        )
    fig, ax = _new_figure(width=10.4)
    _draw_step_lines(ax, results, stepped)
    newest = max(results.steps[lab] for lab in stepped)
    ax.axvline(newest, color="#d62728", linestyle=":", linewidth=1)
    ax.annotate(
        f"newest: step {newest}",
        (newest, 1),
        xycoords=("data", "axes fraction"),
        xytext=(-4, -12),
        textcoords="offset points",
        ha="right",
        fontsize=8,
        color="#d62728",
    )
    ax.set_xlabel("training step")
    ax.set_ylabel(f"τ ({TAU_UNIT})")
    ax.set_title("τ against training step: chain per dataset, DDTree-N pooled (grey)")
    ax.legend(
        fontsize=8,
        title="chain by dataset;\nDDTree pooled",
        title_fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0.0,
    )
    note = None
    if len(stepped) == 1:
        note = "Only one checkpoint carries a training step, so the curve is a single point."
    elif len(stepped) < len(results.order):
        note = f"{len(results.order) - len(stepped)} checkpoint(s) without a training step are left out of this plot."
    return fig, note


def _draw_step_lines(ax, results: Results, stepped: list[str]) -> None:
    """Chain tau per dataset (black: all pooled) and pooled tau per DDTree budget (greys)."""
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    for name, points, d_index, r_index, overall in _step_lines(results, stepped):
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker="o",
            ms=4,
            color="black" if overall else cmap(d_index % 10),
            linewidth=2.2 if overall else 1.3,
            linestyle=["-", "--", ":", "-."][r_index % 4],
            label=name,
        )
    for index, (name, points) in enumerate(_tree_step_lines(results, stepped)):
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker=".",
            ms=3,
            linewidth=1,
            color=str(0.25 + 0.5 * index / max(1, len(ddtree_budgets(results.summary)))),
            label=name,
        )
