"""What `score` prints: per checkpoint a headline (and, unless --quiet, the table of tau per
dataset and method, acceptance per block position, notes on inexact or lossy inputs); at the
end a table across checkpoints with the best marked, what failed, and what to run next."""

from __future__ import annotations

import math

import pyarrow as pa

from scoring import results
from scoring.breakdowns import by_context, by_segment, read_rows
from scoring.methods.chain import CHAIN
from scoring.methods.registry import method_order
from scoring.results import MIN_ANCHORS
from scoring.score.outcome import Status
from scoring.tool_figures import shown, tool_figures

STREAK_NOTE = (
    "streak = mean draft tokens accepted per anchor over all response positions (bonus-exclusive; "
    "steadier than tau, which follows one walk)"
)
# Below this pooled chain streak (draft tokens accepted per anchor) the drafter accepts
# essentially nothing: a drafter that learnt anything from its target is far above it.
FLOOR_STREAK = 0.01


def fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return f"{value:.{digits}f}"


def aligned(headers: list[str], cells: list[list[str]], left: set[str] | None = None) -> list[str]:
    """Text columns two spaces apart, each as wide as its widest cell; columns named in `left`
    (every column when None) left-aligned, the others right-aligned."""
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]

    def line(values):
        parts = [v.ljust(w) if left is None or h in left else v.rjust(w) for h, v, w in zip(headers, values, widths)]
        return "  ".join(parts).rstrip()

    return [line(headers)] + [line(row) for row in cells]


def pooled_rows(summary: pa.Table) -> dict[str, dict]:
    """method -> its summary row for dataset ALL_DATASETS."""
    return {row["method"]: row for row in summary.to_pylist() if row["dataset"] == results.ALL_DATASETS}


def best_tree(pooled: dict[str, dict]) -> tuple[str, float] | None:
    """(method, tau) of the tree (DDTree budget or EAGLE tree) with the highest pooled tau, the
    smaller on a tie; None without trees."""
    trees = [(m, r["tau"]) for m, r in pooled.items() if m != CHAIN and r["tau"] is not None]
    return max(trees, key=lambda item: (item[1], -method_order(item[0])[1])) if trees else None


def headline(name: str, summary: pa.Table) -> str:
    """'tiny/step_600 (DFlash, z-lab layout): tau chain 1.340 (all, 16 samples, exact 16/16, K 15),
    best ddtree-256 2.665, streak 0.318'."""
    pooled = pooled_rows(summary)
    chain = pooled[CHAIN]
    drafter = results.drafter_label(chain.get("drafter_family"), chain.get("drafter_layout"))
    name = f"{name} ({drafter})" if drafter else name
    exact = chain["samples"] - chain["inexact_samples"]
    k = results.chain_drafts(chain)  # families of different K compare fairly only when K is said
    line = f"{name}: tau chain {fmt(chain['tau'])} (all, {chain['samples']} samples, exact {exact}/{chain['samples']}, K {k})"
    if results.sampling_of_row(chain) is not None:
        line = f"{name}: expected tau chain {fmt(chain['tau'])} ({sampled_words(chain)}, K {k})"
    tree = best_tree(pooled)
    if tree is not None:
        line += f", best {tree[0]} {fmt(tree[1])}"
    if chain.get("anchor_accepted_len_mean") is not None:
        visited = " (walk anchors only)" if chain.get("anchor_set") == "walk" else ""
        line += f", streak {fmt(chain['anchor_accepted_len_mean'])}{visited}"
    return line


def sampled_words(row: dict) -> str:
    """'sampled at T=0.6, top-p 0.95, top-k 20: expected tau, exact in distribution; ± 0.012 over 64 responses'."""
    return (
        f"sampled at {results.sampling_of_row(row).describe()}: expected tau, exact in distribution; "
        f"± {fmt(row.get('tau_se'))} over {row['samples'] - row['samples_without_steps']} responses"
    )


def print_table(summary: pa.Table, record: dict, out_dir: str, took: str | None = None) -> None:
    """The per-checkpoint detail: tau per dataset and method, streak, acceptance by position, notes.
    `took` says the time (PassTimes.took); default run.json's wall time, right for a checkpoint
    scored alone."""
    rows = summary.to_pylist()
    took = f"{record['wall_time_s']:.1f}s" if took is None else took
    print(
        f"  {record['shards']['samples']} samples, {record['anchors']} anchors, {record['dtype']} on "
        f"{record['device']}, {took} -> {out_dir}"
    )
    methods = list(dict.fromkeys(r["method"] for r in rows))
    pooled_chain = pooled_rows(summary)[CHAIN]
    if results.sampling_of_row(pooled_chain) is not None:
        print(f"  {sampled_words(pooled_chain)}; DDTree walks follow the sampled responses")
    print("  tau (mean accepted + bonus per step, simulated walk)")
    widths = {m: max(12, len(m) + 2) for m in methods}  # eagle-tree-4x5-8 is wider than ddtree-256
    print(f"  {'dataset':<16}" + "".join(f"{m:>{widths[m]}}" for m in methods) + f"{'streak':>10}")
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        taus = {r["method"]: r for r in rows if r["dataset"] == dataset}
        streak = taus[CHAIN].get("anchor_accepted_len_mean")
        cells = "".join(f"{fmt(taus[m]['tau'] if m in taus else None):>{widths[m]}}" for m in methods)
        print(f"  {dataset:<16}{cells}{fmt(streak):>10}")
    print(f"  {STREAK_NOTE}")
    overall = pooled_rows(summary)[CHAIN]
    rates = overall.get("accept_rate_by_position") or []
    if rates:
        print("  chain acceptance per block position (all anchors, given the position was reached):")
        print("    " + format_positions(rates, overall.get("reached_by_position")))
    for line in context_lines(out_dir) + tool_lines(out_dir):
        print(line)
    for note in notes(overall, record):
        print(f"  note: {note}")
    for line in warning_lines(record):
        print(f"  {line}")


def group_cells(groups) -> str:
    return "; ".join(
        f"{g.label}: tau {fmt(g.tau, 2)} ({g.steps} steps), streak {fmt(g.streak, 2)} ({g.anchors} anchors)"
        for g in groups
    )


def context_lines(out_dir: str) -> list[str]:
    """The chain's tau and streak by context length, and inside / after a reasoning model's
    thinking (scoring/breakdowns.py), one group an entry."""
    lines, rows = [], read_rows(out_dir)
    buckets = by_context(out_dir, rows=rows)
    if buckets:
        lines += ["  by context length (tokens before the anchor; docs/breakdowns.md):", "    " + group_cells(buckets)]
    segments = by_segment(out_dir, rows=rows)
    if segments:
        lines += ["  inside the thinking (<think> .. </think>) and in the answer:", "    " + group_cells(segments)]
    return lines


def tool_lines(out_dir: str) -> list[str]:
    """The chain's acceptance as each tool prints it (scoring/tool_figures.py), one line a tool."""
    figures = tool_figures(out_dir)
    if not figures:
        return []
    by_tool: dict[str, list[str]] = {}
    for f in figures:
        unit = "%" if f.definition.endswith("(%)") else ""
        by_tool.setdefault(f.tool, []).append(f"{f.name} {shown(f.value)}{unit}")
    lines = ["  the same acceptance as each tool prints it (docs/tool-figures.md):"]
    return lines + [f"    {tool}: {'; '.join(items)}" for tool, items in by_tool.items()]


def notes(overall: dict, record: dict) -> list[str]:
    """Caveats on the numbers: inexact walks, lossy features."""
    found = []
    shards = record["shards"]
    if shards.get("responses"):
        made = shards["responses"]
        found.append(f"responses from {made['engine']} serving {made['model']!r}, teacher-forced through the target")
    if overall["inexact_samples"]:
        found.append(
            f"{overall['inexact_samples']} of {overall['samples']} samples are not exact walks "
            f"(given responses or {overall['argmax_mismatches']} positions where the stored token is not "
            f"the full-forward argmax); their walk numbers approximate the online loop"
            + named_samples(shards.get("mismatched_samples") or {})
        )
    # pipeline/common/dtypes.py FP8, spelled out: the console and compare never import torch
    if record["shards"].get("feature_dtype") == "float8_e4m3fn":
        found.append(
            "the shards hold lossy fp8 features (extract --feature-dtype fp8); numbers approximate "
            "a lossless extract (bench/README.md measures the tau change)"
        )
    return found


def named_samples(mismatched: dict, listed: int = 5) -> str:
    """'; with mismatches in the shards: q3 (2 positions), q7 (1)' (the first `listed`), or ''."""
    if not mismatched:
        return ""
    named = [f"{sid} ({n} position{'s' if n != 1 else ''})" for sid, n in list(mismatched.items())[:listed]]
    more = [f"{len(mismatched) - listed} more"] if len(mismatched) > listed else []
    return "; with mismatches in the shards: " + ", ".join(named + more)


def at_floor(summary: pa.Table) -> bool:
    """Whether the drafter accepted essentially nothing: pooled chain streak below FLOOR_STREAK."""
    chain = pooled_rows(summary).get(CHAIN) or {}
    streak = chain.get("anchor_accepted_len_mean")
    return streak is not None and streak < FLOOR_STREAK


def floor_warning(summary: pa.Table, ckpt: str, shards: str, program: str) -> list[str]:
    """When acceptance is at the floor: that it is, what usually causes it, and the commands that
    look into it, on the checkpoint and shards as the user named them. [] otherwise."""
    if not at_floor(summary):
        return []
    chain = pooled_rows(summary)[CHAIN]
    streak = chain["anchor_accepted_len_mean"]
    anchors = chain.get("anchors")
    none = (
        f"no draft token at any of {anchors} anchors"
        if streak == 0
        else f"essentially no draft token ({streak:.4f} per anchor over {anchors} anchors)"
    )
    return [
        f"warning: acceptance is at the floor: the chain accepted {none} "
        f"(tau chain {fmt(chain['tau'])}: the target's bonus token {'alone' if streak == 0 else 'and little more'}). "
        "Usually the shards come from "
        "another target or tokenizer than the drafter was trained on, the feature layers are wrong "
        "(target_layer_ids, or the layer-numbering convention: hidden_states[i] vs [i + 1], "
        "docs/layer-numbering.md), or the drafter is untrained or randomly initialised.",
        f"  look into it: {program} inspect {shards}   # the target the shards come from",
        f"                {program} diagnose --ckpt {ckpt} --shards {shards}   # conventions, layers, numerics",
    ]


class PassTimes:
    """A pipeline.common.timing recorder of what a score run shares between its checkpoints:
    preparing the target head (once) and each pass over the shards (once for every checkpoint
    replayed in it), so the console says a shared time once, as shared."""

    def __init__(self):
        self.head_s: float | None = None
        self.passes: list[tuple[int, float]] = []  # (checkpoints replayed, seconds) per pass, in order
        self.told = -1  # the last pass whose shared time took() has said

    def start(self, name: str, info: dict) -> None:
        pass

    def stop(self, name: str, info: dict, seconds: float) -> None:
        if name == "prepare target head":
            self.head_s = (self.head_s or 0.0) + seconds
        elif name == "shard pass":
            self.passes.append((int(info.get("checkpoints", 1)), seconds))

    def took(self, record: dict) -> str:
        """The time of a checkpoint just scored (its pass is the latest): run.json's wall time when
        it had its pass alone; the pass's time once, said as shared, when it shared it."""
        if not self.passes or self.passes[-1][0] < 2:
            return f"{record['wall_time_s']:.1f}s"
        checkpoints, seconds = self.passes[-1]
        if self.told == len(self.passes) - 1:
            return "in the shared pass above"
        self.told = len(self.passes) - 1
        return f"{seconds:.1f}s for a pass shared by {checkpoints} checkpoints (the shards decoded once for all)"

    def summary_line(self) -> str | None:
        """'time: target head prepared once in 3.1s; pass over the shards 66.0s (2 checkpoints)': each
        shared time once; None when no pass was timed."""
        if not self.passes:
            return None
        head = "" if self.head_s is None else f"target head prepared once in {self.head_s:.1f}s; "
        passes = ", ".join(f"{s:.1f}s ({n} checkpoint{'s' if n != 1 else ''})" for n, s in self.passes)
        noun = "pass" if len(self.passes) == 1 else "passes"
        return f"time: {head}{noun} over the shards {passes}"


def format_positions(positions: list[float], anchors: list[float | None] | None = None) -> str:
    """'1: 0.62, 2: 0.41, ...' ('-' where never reached). With `anchors`, a position fewer than
    MIN_ANCHORS anchors reached is left out, and said so: '...; positions 9-15 left out (fewer
    than 30 anchors reached each)': one anchor's 0 or 1 there is no reading."""
    anchors = anchors or [None] * len(positions)
    shown, thin = [], []
    for k, (p, n) in enumerate(zip(positions, anchors), start=1):
        if n is not None and n < MIN_ANCHORS:
            thin.append(k)
        else:
            shown.append(f"{k}: {'-' if math.isnan(p) else f'{p:.2f}'}")
    if not thin:
        return ", ".join(shown)
    which = f"positions {anchor_ranges(thin)}" if len(thin) > 1 else f"position {thin[0]}"
    left = f"{which} left out (fewer than {MIN_ANCHORS} anchors reached {'each' if len(thin) > 1 else 'it'})"
    return "; ".join(part for part in (", ".join(shown), left) if part)


def anchor_ranges(anchors: list[int]) -> str:
    """'5, 6, 9-40' from sorted anchor positions (consecutive runs of three or more as a range)."""
    runs: list[list[int]] = []
    for anchor in anchors:
        if runs and anchor == runs[-1][-1] + 1:
            runs[-1].append(anchor)
        else:
            runs.append([anchor])
    parts = [f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs]
    return ", ".join(parts)


def describe_nonfinite(records: list[dict], listed: int = 5) -> str:
    """'2 samples excluded: the drafter produced NaN/Inf logits (q1 anchors 5, 6; q4 anchors 9-40)'."""
    where = [f"{r['sample_id']} anchors {anchor_ranges(r['anchors'])}" for r in records[:listed]]
    if len(records) > listed:
        where.append(f"{len(records) - listed} more")
    noun = "sample" if len(records) == 1 else "samples"
    return f"{len(records)} {noun} excluded: the drafter produced NaN/Inf logits ({'; '.join(where)})"


def warning_lines(record: dict) -> list[str]:
    """Samples left out of every number: NaN/Inf drafter logits (run.json nonfinite_drafter),
    and samples the extract never stored for NaN/Inf target values (shards.excluded_samples)."""
    lines = []
    bad = record.get("nonfinite_drafter") or []
    if bad:
        lines.append(
            f"warning: {describe_nonfinite(bad)}; not in any table or tau "
            f"(run.json nonfinite_drafter lists every anchor)"
        )
    excluded = (record.get("shards") or {}).get("excluded_samples") or 0
    if excluded:
        noun = "sample" if excluded == 1 else "samples"
        lines.append(
            f"note: the extract excluded {excluded} {noun} with NaN/Inf target values; they are not in the "
            f"shards and not scored (`specreplay inspect {record['shards'].get('uri')}` lists them)"
        )
    return lines


def across_table(outcomes: list) -> list[str]:
    """One line per scored or skipped checkpoint: pooled chain tau, best DDTree and streak,
    '*' on the best of each column."""
    done = [o for o in outcomes if o.summary is not None]
    cells = []
    for o in done:
        pooled = pooled_rows(o.summary)
        chain = pooled[CHAIN]
        tree = best_tree(pooled)
        cells.append(
            (o.name, chain["tau"], tree, chain.get("anchor_accepted_len_mean"), o.status, results.chain_drafts(chain))
        )
    width = max([len("checkpoint")] + [len(c[0]) for c in cells])
    best = [max((c[i] for c in cells if c[i] is not None), default=None) for i in (1, 3)]
    best_tree_tau = max((c[2][1] for c in cells if c[2] is not None), default=None)
    mark = lambda value, top: "*" if value is not None and value == top else " "  # noqa: E731
    lines = [f"{'checkpoint':<{width}}  {'K':>3}  {'tau chain':>10}  {'best DDTree':>22}  {'streak':>8}"]
    for name, tau, tree, streak, status, k in cells:
        tree_cell = f"{tree[0]} {fmt(tree[1])}{mark(tree[1], best_tree_tau)}" if tree else "-"
        lines.append(
            f"{name:<{width}}  {k:>3}  {fmt(tau):>9}{mark(tau, best[0])}  {tree_cell:>22}  "
            f"{fmt(streak):>7}{mark(streak, best[1])}" + ("  (already scored)" if status == Status.SKIPPED else "")
        )
    return lines + ["* best of the column"]


def next_lines(outcomes: list, out: str, program: str) -> list[str]:
    """What to run next: report over --out; compare the two latest results when there are two."""
    done = [o.out_dir for o in outcomes if o.status != Status.FAILED]
    if not done:
        return []
    lines = [f"next: {program} report {out} --out {out.rstrip('/')}/report.html"]
    if len(done) >= 2:
        lines.append(f"      {program} compare {done[-2]} {done[-1]}")
    return lines


def failure_text(outcome) -> str:
    """A failed checkpoint's error, naming its path once (errors that start with it keep theirs)."""
    text = str(outcome.error)
    return text if text.startswith(outcome.ckpt) else f"{outcome.ckpt}: {text}"


def failure_lines(outcomes: list) -> list[str]:
    """The count of failures after several checkpoints, by name: each error was printed as it came."""
    failed = [o for o in outcomes if o.status == Status.FAILED]
    if not failed or len(outcomes) < 2:
        return []
    return [f"{len(failed)} of {len(outcomes)} checkpoints failed (errors above): {', '.join(o.ckpt for o in failed)}"]


def outcome_json(outcome) -> dict:
    """One checkpoint for `score --json`: where, what happened, the pooled numbers."""
    item = {
        "checkpoint": outcome.name,
        "path": outcome.ckpt,
        "out_dir": outcome.out_dir,
        "status": outcome.status.value,
    }
    if outcome.error is not None:
        item["error"] = outcome.error
    if outcome.summary is not None:
        pooled = pooled_rows(outcome.summary)
        chain = pooled[CHAIN]
        item.update(
            samples=chain["samples"],
            exact_samples=chain["samples"] - chain["inexact_samples"],
            tau={m: r["tau"] for m, r in sorted(pooled.items(), key=lambda kv: method_order(kv[0]))},
            streak=chain.get("anchor_accepted_len_mean"),
            headline=headline(outcome.name, outcome.summary),
            acceptance_at_floor=at_floor(outcome.summary),
        )
    if outcome.record is not None:
        item["wall_time_s"] = outcome.record.get("wall_time_s")
        item["nonfinite_drafter_samples"] = len(outcome.record.get("nonfinite_drafter") or [])
        item["extract_excluded_samples"] = (outcome.record.get("shards") or {}).get("excluded_samples") or 0
    return item
