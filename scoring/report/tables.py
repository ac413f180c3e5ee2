"""The report's HTML tables: summary, anchors per block position, worst prompts, inputs, and the
helpers they share (the user's message out of a chat-templated prompt, identifiers that wrap)."""

from __future__ import annotations

import html
import re

import polars as pl

from scoring.methods.chain import CHAIN
from scoring.methods.ddtree import DDTREE
from scoring.prompts import user_message
from scoring.report.data import (
    TAU_UNIT,
    Results,
    datasets,
    ddtree_budgets,
    eagle_trees,
    fmt,
    pick_evenly,
    reference_label,
)
from scoring.results import chain_drafts

PROMPT_PREVIEW_CHARS = 160


def breakable(text: str, after: str = "/_") -> str:
    """Escaped text that may wrap after the characters in `after` (/ and _ for paths, / for
    checkpoint names) instead of mid-word; browsers already wrap after a hyphen."""
    return re.sub(f"([{re.escape(after)}])", r"\1<wbr>", html.escape(text))


def label_html(label: str) -> str:
    """A checkpoint label: whole when short (runs/step_200 stays on one line), else wrapping after /."""
    return breakable(label, "/") if len(label) > 24 else html.escape(label)


# The summary's column titles (hover text); the per-budget DDTree ones are built in _tree_titles.
SUMMARY_TITLES = {
    "Dataset": "the prompt set the samples come from; (all) pools every sample",
    "Checkpoint": "the drafter checkpoint scored (its name; † fitted on the very samples it is scored on)",
    "Step": "training step, from the checkpoint's config or its path (step_N); – when it carries none",
    "K": "draft tokens per chain step (block size - 1 for a block drafter, the chain's length for EAGLE-3): "
    "a longer chain can accept more, so drafters of different K compare fairly only with K beside τ",
    "τ chain": f"mean over samples of tokens per decoding step ({TAU_UNIT}) with chain verification; on "
    "sampled shards the expected value, exact in distribution, ± its standard error over the responses",
    "Best τ DDTree": "the highest τ over the DDTree budgets scored, with its budget N (nodes per tree); "
    "every budget is in the τ DDTree-N columns",
    "All-anchor streak": "mean accepted draft tokens per anchor over every response position (chain, bonus-exclusive)",
    "Exact walks": "samples whose simulated walk is exact (greedy, no argmax mismatch) out of the samples "
    "scored: the console's exact k/n",
    "τ DDTree-N": f"τ ({TAU_UNIT}) when each step verifies a tree of the N most probable prefixes of the "
    "same drafter pass, per budget N",
    "τ EAGLE tree": f"τ ({TAU_UNIT}) when each step verifies sglang's dynamic tree topk x depth - draft tokens "
    "(EAGLE-3 drafters, docs/eagle-tree.md), per setting",
}


def _tree_title(nodes: int) -> str:
    return (
        f"τ DDTree-{nodes}: tokens per step ({TAU_UNIT}) when each step verifies a tree of the "
        f"{nodes} most probable prefixes of the same drafter pass"
    )


def _th(text: str, title: str, span: str = "") -> str:
    return f'<th{span} title="{html.escape(title)}">{html.escape(text)}</th>'


def summary_table(results: Results) -> str:
    """The headline figures (the console's tau chain, best ddtree-N, streak, exact k/n), then τ per
    tree budget in a table of its own (budgets_table): one row holding both was wider than a
    narrow window, and the budgets sat behind a sideways scroll."""
    s = results.summary
    budgets = ddtree_budgets(s)
    has_streak = "anchor_accepted_len_mean" in s.columns
    head = ["Dataset", "Checkpoint", "Step", "K", "τ chain"] + (["Best τ DDTree"] if budgets else [])
    head += (["All-anchor streak"] if has_streak else []) + ["Exact walks"]
    out = ['<div class="scroll"><table class=summary><thead><tr>']
    out += [_th(h, SUMMARY_TITLES[h]) for h in head]
    out.append("</tr></thead><tbody>")
    for dataset in datasets(s):
        out += _rows(results, dataset, lambda label, by, best: _headline_cells(results, label, by, best, budgets))
    out.append("</tbody></table></div>")
    return "".join(out) + fitted_note(results) + budgets_table(results)


def budgets_table(results: Results) -> str:
    """τ per DDTree budget and per EAGLE tree setting, one row per dataset and checkpoint (nothing
    when neither was scored)."""
    budgets, trees = ddtree_budgets(results.summary), eagle_trees(results.summary)
    if not budgets and not trees:
        return ""
    span = ' rowspan="2"'
    out = ['<div class="scroll"><table class="summary budgets"><thead><tr>']
    out += [_th(h, SUMMARY_TITLES[h], span) for h in ("Dataset", "Checkpoint")]
    if budgets:
        out.append(_th("τ DDTree-N", SUMMARY_TITLES["τ DDTree-N"], f' colspan="{len(budgets)}" class="group"'))
    if trees:
        out.append(_th("τ EAGLE tree", SUMMARY_TITLES["τ EAGLE tree"], f' colspan="{len(trees)}" class="group"'))
    out.append("</tr><tr>" + "".join(_th(f"N={n}", _tree_title(n)) for n in budgets))
    out.append("".join(_th(tree.name, tree.method) for tree in trees) + "</tr></thead><tbody>")
    methods = [DDTREE.name(n) for n in budgets] + [tree.method for tree in trees]
    for dataset in datasets(results.summary):
        out += _rows(
            results, dataset, lambda label, by, best: [fmt((by.get((label, m)) or {}).get("tau")) for m in methods]
        )
    out.append("</tbody></table></div>")
    return "".join(out)


def fitted_note(results: Results) -> str:
    """Says which checkpoints were fitted on the very samples they are scored on (data.fitted_on_scored_shards)."""
    names = [lab for lab in results.order if lab in results.fitted_here]
    if not names:
        return ""
    one = len(names) == 1
    return (
        f'<p class="note fitted">† {html.escape(", ".join(names))} {"was" if one else "were"} fitted by '
        f"<code>specreplay fit</code> on the very samples {'it is' if one else 'they are'} scored on (the "
        f"checkpoint's config.json names these shards): {'its' if one else 'their'} τ shows the tool at work, "
        "not what a real drafter reaches on prompts it has not seen.</p>"
    )


def _best_tree(by: dict, label: str, budgets: list[int]) -> str:
    """'2.665 (N=256)': the highest DDTree tau of a row, the smaller budget on a tie (as the console)."""
    taus = [(tau, -n) for n in budgets if (tau := (by.get((label, DDTREE.name(n))) or {}).get("tau")) is not None]
    if not taus:
        return fmt(None)
    tau, nodes = max(taus)
    return f'{fmt(tau)} <span class="muted">(N={-nodes})</span>'


def _exact(chain: dict) -> str:
    if chain.get("temperature"):  # a sampled response has no greedy walk to be exact against
        return "n/a (sampled)"
    samples, inexact = chain.get("samples"), chain.get("inexact_samples")
    if samples is None or inexact is None:
        return fmt(None)
    return f"{samples - inexact}/{samples}"


def _rows(results: Results, dataset: str, cells) -> list[str]:
    """One dataset's rows, one per checkpoint with a chain row: its dataset and checkpoint cells,
    then cells(label, (label, method) -> summary row, the best chain tau when there are several)."""
    by = {
        (r["label"], r["method"]): r for r in results.summary.filter(pl.col("dataset") == dataset).iter_rows(named=True)
    }
    chain_taus = [
        by[(lab, CHAIN)]["tau"] for lab in results.order if (by.get((lab, CHAIN)) or {}).get("tau") is not None
    ]
    best = max(chain_taus) if len(chain_taus) > 1 else None
    out, first = [], True
    for label in results.order:
        if by.get((label, CHAIN)) is None:
            continue
        css, first = (' class="group-start"' if first else ""), False
        name = label_html(label)
        if label in results.fitted_here:
            name += '&nbsp;<sup class="fitted" title="fitted on the very samples it is scored on: see below">†</sup>'
        row = [html.escape(dataset), name, *cells(label, by, best)]
        out.append(f"<tr{css}>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>")
    return out


def _headline_cells(results: Results, label: str, by: dict, best: float | None, budgets: list[int]) -> list[str]:
    """Step, K, τ chain (bold when the best of several), best DDTree, streak, exact walks."""
    chain = by[(label, CHAIN)]
    tau = fmt(chain["tau"])
    if chain.get("tau_se") is not None:  # sampled shards: an expectation with its sampling error
        tau += f" ± {fmt(chain['tau_se'])}"
    cells = [fmt(results.steps.get(label)), fmt(chain_drafts(chain) or None)]
    cells.append(f"<b>{tau}</b>" if best is not None and chain["tau"] == best else tau)
    if budgets:
        cells.append(_best_tree(by, label, budgets))
    if "anchor_accepted_len_mean" in results.summary.columns:
        cells.append(fmt(chain.get("anchor_accepted_len_mean")))
    return cells + [_exact(chain)]


def _prompt_cell(text: str | None) -> str:
    """The user's message (a preview when long), expandable to the full prompt as the target saw it."""
    if not text:
        return '<span class="muted">(no prompt text)</span>'
    question = user_message(text)
    preview = question if len(question) <= PROMPT_PREVIEW_CHARS else question[:PROMPT_PREVIEW_CHARS].rstrip() + "…"
    if preview == text:
        return f'<div class="prompt">{html.escape(text)}</div>'
    return (
        f'<details><summary class="prompt">{html.escape(preview)}</summary>'
        f'<div class="prompt full">{html.escape(text)}</div></details>'
    )


def worst_prompts_table(results: Results, worst: int) -> tuple[str, str]:
    """(intro paragraph, table) for the `worst` samples of the latest checkpoint by chain tau;
    the tau of the same sample under earlier checkpoints shows whether it is improving."""
    if worst <= 0:
        return "", '<p class="note">Not requested (--worst 0).</p>'
    reference = reference_label(results)
    if reference is None:
        return "", '<p class="note">No samples.parquet in these results, so no per-prompt view.</p>'
    samples = results.samples
    kind = results.kind.get(reference, "greedy")
    # only runs of the reference's kind: a sampled τ beside a greedy one compares two experiments
    with_samples = [
        lab for lab in results.order if lab in set(samples["label"]) and results.kind.get(lab, kind) == kind
    ]
    ref = samples.filter((pl.col("label") == reference) & pl.col("tau").is_not_null()).sort("tau").head(worst)
    history = pick_evenly(with_samples, 6) if len(with_samples) > 1 else []
    key_tau = {(r["label"], r["dataset"], r["sample_id"]): r["tau"] for r in samples.iter_rows(named=True)}
    head = ["#", "Dataset", "Sample", "τ chain", "Steps", "Response tokens", "Finish", "Exact walk"]
    if history:
        head.insert(4, "τ across checkpoints")
    # --cols: the grid a narrow window lays the rows out on, each prompt on a line of its own (CSS)
    out = [f'<table class=worst style="--cols:{len(head)}"><thead><tr>'] + [f"<th>{h}</th>" for h in head]
    out.append('<th class="prompt-cell">Prompt</th></tr></thead><tbody>')
    for rank, r in enumerate(ref.iter_rows(named=True), start=1):
        cells = [str(rank), html.escape(str(r["dataset"])), html.escape(str(r["sample_id"])), fmt(r["tau"], 2)]
        if history:
            cells.append(" → ".join(fmt(key_tau.get((lab, r["dataset"], r["sample_id"])), 2) for lab in history))
        cells += [fmt(r.get("steps")), fmt(r.get("response_len")), html.escape(str(r.get("finish_reason") or "–"))]
        cells.append(_exact_cell(r) if kind == "greedy" else "n/a (sampled)")
        out.append(
            "<tr>"
            + "".join(f"<td>{c}</td>" for c in cells)
            + f'<td class="prompt-cell">{_prompt_cell(r.get("prompt_text"))}</td></tr>'
        )
    out.append("</tbody></table>")
    skipped = samples.filter((pl.col("label") == reference) & pl.col("tau").is_null()).height
    return f"<p>{_worst_intro(results, reference, ref.height, history, skipped)}</p>", "".join(out)


def _exact_cell(row: dict) -> str:
    """'yes', 'no: 3 argmax mismatches' (teacher-forced along the stored tokens), 'no' (given), '–'."""
    if row.get("exact") is None:
        return "–"
    if row["exact"]:
        return "yes"
    mismatches = row.get("argmax_mismatches") or 0
    return f"no: {mismatches} argmax mismatch{'es' if mismatches != 1 else ''}" if mismatches else "no"


def _worst_intro(results: Results, reference: str, count: int, history: list[str], skipped: int) -> str:
    which = "the latest checkpoint" if results.steps.get(reference) is not None else "the last checkpoint listed"
    kind = results.kind.get(reference, "greedy")
    intro = (
        f"The {count} samples with the lowest chain τ under <b>{html.escape(reference)}</b> ({which}; "
        f"{html.escape(kind)} runs only)"
    )
    if history:
        intro += "; “τ across checkpoints” follows the same sample through " + ", ".join(
            html.escape(lab) for lab in history
        )
    intro += ". The prompt column shows the user's message; click it to see the whole prompt as the target saw it."
    if skipped:
        intro += f" {skipped} sample(s) with no decoding step (empty response) are left out."
    return intro


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
            f'<td class="path">{breakable(d)}</td>',
            f"<td>{label_html(str(row.get('label', '–')))}</td>",
            f'<td class="hash">{html.escape(str(row.get("checkpoint_hash") or "–"))}</td>',
            f"<td>{fmt(row.get('checkpoint_step'))}</td>",
            f'<td class="path">{breakable(str(shards.get("uri", "–")))}</td>',
            f"<td>{fmt(shards.get('samples'))}</td>",
            f"<td>{html.escape(device)}</td>",
            f"<td>{html.escape(wall)}</td>",
        ]
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out) + duplicates_note(results)


def duplicates_note(results: Results) -> str:
    """The directories left out as duplicates, each with the one kept instead and why."""
    if not results.duplicates:
        return ""
    items = "".join(
        f"<li><span class=path>{breakable(d.skipped)}</span>: same checkpoint (hash {html.escape(d.checkpoint_hash)}) "
        f"on the same shards as <span class=path>{breakable(d.kept)}</span>, which was kept ({html.escape(d.reason)})</li>"
        for d in results.duplicates
    )
    return (
        f'<div class="note duplicates"><p>{len(results.duplicates)} results director'
        f"{'y' if len(results.duplicates) == 1 else 'ies'} left out as duplicates (a checkpoint scored twice "
        f"on the same shards counts once: the run on the most samples is kept, then the most recent):</p>"
        f"<ul>{items}</ul></div>"
    )
