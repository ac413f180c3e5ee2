"""What `score` prints: per checkpoint a headline (and, unless --quiet, the table of tau per
dataset and method, acceptance per block position, notes on inexact or lossy inputs); at the
end a table across checkpoints with the best marked, what failed, and what to run next."""

from __future__ import annotations

import pyarrow as pa

from scoring import results
from scoring.score.outcome import Status

STREAK_NOTE = (
    "streak = mean draft tokens accepted per anchor over all response positions (bonus-exclusive; "
    "steadier than tau, which follows one walk)"
)


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
    """(method, tau) of the DDTree budget with the highest pooled tau; None without DDTree."""
    trees = [(m, r["tau"]) for m, r in pooled.items() if m != results.CHAIN and r["tau"] is not None]
    return max(trees, key=lambda item: (item[1], -results.method_order(item[0])[1])) if trees else None


def headline(name: str, summary: pa.Table) -> str:
    """'tiny/step_600: tau chain 1.340 (all, 16 samples, exact 16/16), best ddtree-256 2.665, streak 0.318'."""
    pooled = pooled_rows(summary)
    chain = pooled[results.CHAIN]
    exact = chain["samples"] - chain["inexact_samples"]
    line = f"{name}: tau chain {fmt(chain['tau'])} (all, {chain['samples']} samples, exact {exact}/{chain['samples']})"
    if results.sampling_of_row(chain) is not None:
        line = f"{name}: expected tau chain {fmt(chain['tau'])} ({sampled_words(chain)})"
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


def print_table(summary: pa.Table, record: dict, out_dir: str) -> None:
    """The per-checkpoint detail: tau per dataset and method, streak, acceptance by position, notes."""
    rows = summary.to_pylist()
    print(
        f"  {record['shards']['samples']} samples, {record['anchors']} anchors, {record['dtype']} on "
        f"{record['device']}, {record['wall_time_s']:.1f}s -> {out_dir}"
    )
    methods = list(dict.fromkeys(r["method"] for r in rows))
    pooled_chain = pooled_rows(summary)[results.CHAIN]
    if results.sampling_of_row(pooled_chain) is not None:
        print(f"  {sampled_words(pooled_chain)}; DDTree walks follow the sampled responses")
    print("  tau (mean accepted + bonus per step, simulated walk)")
    print(f"  {'dataset':<16}" + "".join(f"{m:>12}" for m in methods) + f"{'streak':>10}")
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        taus = {r["method"]: r for r in rows if r["dataset"] == dataset}
        streak = taus[results.CHAIN].get("anchor_accepted_len_mean")
        cells = "".join(f"{fmt(taus[m]['tau'] if m in taus else None):>12}" for m in methods)
        print(f"  {dataset:<16}{cells}{fmt(streak):>10}")
    print(f"  {STREAK_NOTE}")
    overall = pooled_rows(summary)[results.CHAIN]
    rates = overall.get("accept_rate_by_position") or []
    if rates:
        print("  chain acceptance per block position (all anchors, given the position was reached):")
        print("    " + " ".join(f"{k + 1}:{fmt(r, 2)}" for k, r in enumerate(rates)))
    for note in notes(overall, record):
        print(f"  note: {note}")
    for line in warning_lines(record):
        print(f"  {line}")


def notes(overall: dict, record: dict) -> list[str]:
    """Caveats on the numbers: inexact walks, lossy features."""
    found = []
    if overall["inexact_samples"]:
        found.append(
            f"{overall['inexact_samples']} of {overall['samples']} samples are not exact walks "
            f"(given responses or {overall['argmax_mismatches']} positions where the stored token is not "
            f"the full-forward argmax); their walk numbers approximate the online loop"
        )
    # pipeline/common/dtypes.py FP8, spelled out: the console and compare never import torch
    if record["shards"].get("feature_dtype") == "float8_e4m3fn":
        found.append(
            "the shards hold lossy fp8 features (extract --feature-dtype fp8); numbers approximate "
            "a lossless extract (bench/README.md measures the tau change)"
        )
    return found


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
        chain = pooled[results.CHAIN]
        tree = best_tree(pooled)
        cells.append((o.name, chain["tau"], tree, chain.get("anchor_accepted_len_mean"), o.status))
    width = max([len("checkpoint")] + [len(c[0]) for c in cells])
    best = [max((c[i] for c in cells if c[i] is not None), default=None) for i in (1, 3)]
    best_tree_tau = max((c[2][1] for c in cells if c[2] is not None), default=None)
    mark = lambda value, top: "*" if value is not None and value == top else " "  # noqa: E731
    lines = [f"{'checkpoint':<{width}}  {'tau chain':>10}  {'best DDTree':>22}  {'streak':>8}"]
    for name, tau, tree, streak, status in cells:
        tree_cell = f"{tree[0]} {fmt(tree[1])}{mark(tree[1], best_tree_tau)}" if tree else "-"
        lines.append(
            f"{name:<{width}}  {fmt(tau):>9}{mark(tau, best[0])}  {tree_cell:>22}  {fmt(streak):>7}{mark(streak, best[1])}"
            + ("  (already scored)" if status == Status.SKIPPED else "")
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


def failure_lines(outcomes: list) -> list[str]:
    failed = [o for o in outcomes if o.status == Status.FAILED]
    if not failed:
        return []
    lines = [f"{len(failed)} of {len(outcomes)} checkpoints failed:"]
    return lines + [f"  {o.ckpt}: {o.error}" for o in failed]


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
        chain = pooled[results.CHAIN]
        item.update(
            samples=chain["samples"],
            exact_samples=chain["samples"] - chain["inexact_samples"],
            tau={m: r["tau"] for m, r in sorted(pooled.items(), key=lambda kv: results.method_order(kv[0]))},
            streak=chain.get("anchor_accepted_len_mean"),
            headline=headline(outcome.name, outcome.summary),
        )
    if outcome.record is not None:
        item["wall_time_s"] = outcome.record.get("wall_time_s")
        item["nonfinite_drafter_samples"] = len(outcome.record.get("nonfinite_drafter") or [])
        item["extract_excluded_samples"] = (outcome.record.get("shards") or {}).get("excluded_samples") or 0
    return item
