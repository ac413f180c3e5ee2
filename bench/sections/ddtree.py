"""Section `ddtree`: DDTree's cost, before and after the compiled heap, and what it adds to a score.

1. Per core (one torch thread), on the same anchors: the score section's fitted drafter's logits
   (fitted here the same way when that section does not run)
   for the first anchors of its samples. before = what the scorer ran until issue 13:
   torch.topk(K) of the logits, their logsumexp, the target's rank, one Python heap per anchor;
   after = scoring.methods.ddtree_kernels.tree_pops (compiled, lazy top-K) given the logsumexp, which the
   scorer now computes once per chunk for log q(target) and KL too (timed apart). anchors/s at
   max budget 256 and 1024; pop indices compared with the definition (ddtree.tree_pops_reference)
   and with before (the two differ only where torch.topk ordered equal logits otherwise).
2. Exactness: compiled == definition on random anchors (bench.standins.tree_cases: plain, forced
   ties, near-ties; budgets 1..1024), 100k anchors (quick: 10k).
3. In the score loop: `run_score` all anchors chain only vs chain + DDTree budgets 4..1024, min
   of 2 each, alternated; the DDTree worker's busy seconds and the main thread's wait for it
   (stage events "ddtree", "ddtree wait"): the part of DDTree not hidden behind the drafter.
"""

from __future__ import annotations

import math
import time

import torch

from bench.common import Phase, Rows, StageClock, log, num
from bench.sections import fp32

BUDGETS = (256, 1024)
SCORE_BUDGETS = [4, 8, 16, 32, 64, 128, 256, 512, 1024]
EXACT_SHAPES = (  # (depth, vocab, max budget, share of the anchors)
    (15, 64, 64, 0.55),
    (7, 50, 16, 0.25),
    (15, 300, 256, 0.12),
    (4, 30, 1, 0.04),
    (15, 2000, 1024, 0.04),
)


def drafter_logits(ckpt: str, shard_dir: str, anchors: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [a, L, V], targets [a, L], known [a, L]) of the first `anchors` full blocks of the
    shards' samples, through the scorer's own replay steps."""
    from pipeline.shards import ShardSet
    from proposers.checkpoints.load import load_proposer
    from proposers.interface import Chunk
    from scoring.replay.packing import ReplayOptions, pack_samples, prepare_target_head, select_feature_columns
    from scoring.score.steps import SAMPLE_TENSORS

    shardset = ShardSet(shard_dir)
    head = prepare_target_head(shardset.target_head(), "cpu", torch.float32)
    proposer, info = load_proposer(ckpt, dtype=torch.float32, device="cpu")
    stored, block = shardset.settings["layer_ids"], info.config.block_size
    options, parts = ReplayOptions(methods={}), []
    for sample in shardset.samples(tensors=SAMPLE_TENSORS):
        columns = lambda f: select_feature_columns(f, stored, info.config.target_layer_ids)  # noqa: E731
        packed = pack_samples(proposer, [sample], columns, options, head)
        starts = torch.arange(sample.prompt_len, sample.input_ids.numel() - block)[
            : anchors - sum(len(p[0]) for p in parts)
        ]
        with torch.no_grad():
            [drafts] = proposer.propose(packed, [Chunk(torch.zeros_like(starts), starts, block)], head, options)
            logits = drafts.logits
        targets = sample.input_ids[starts[:, None] + torch.arange(1, block)[None]]  # [a, L]: all known
        parts.append((logits, targets))
        if sum(len(p[0]) for p in parts) >= anchors:
            break
    logits, targets = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return logits, targets, torch.ones_like(targets, dtype=torch.bool)


def before(logits, targets, known, max_nodes) -> torch.Tensor:
    """The scorer's DDTree until issue 13: torch.topk (its own order for equal logits), the
    logsumexp, ranks, then ddtree.path_pop_indices (a Python heap) per anchor."""
    from scoring.methods.ddtree_heap import NOT_IN_TREE, path_pop_indices, path_ranks

    top_logits, top_ids = torch.topk(logits, k=min(max_nodes, logits.shape[-1]), dim=-1)
    top_logp = (top_logits - torch.logsumexp(logits, dim=-1, keepdim=True)).numpy()
    ranks, depth = path_ranks(top_ids, targets).numpy(), known.sum(1).numpy()
    pops = torch.full(targets.shape, NOT_IN_TREE, dtype=torch.long)
    for i in range(targets.shape[0]):
        found = path_pop_indices(top_logp[i], ranks[i, : depth[i]], max_nodes)
        pops[i, : found.size] = torch.from_numpy(found)
    return pops


def timed(fn, *args) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - started, result


def per_core(logits, targets, known) -> dict:
    """Seconds per anchor before/after at each budget on one thread, alternated, min of 2."""
    from scoring.methods.ddtree_heap import tree_pops_reference
    from scoring.methods.ddtree_kernels import tree_pops
    from scoring.replay.chunk import logsumexp_rows

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tree_pops(logits[:2], torch.logsumexp(logits[:2], -1), targets[:2], known[:2], 8)  # compile / load
        lse_s, lse = min((timed(logsumexp_rows, logits) for _ in range(2)), key=lambda run: run[0])
        out = {"anchors": int(logits.shape[0]), "logsumexp_s": lse_s}
        for budget in BUDGETS:
            runs = [
                timed(before, logits, targets, known, budget),
                timed(tree_pops, logits, lse, targets, known, budget),
            ]
            runs += [
                timed(before, logits, targets, known, budget),
                timed(tree_pops, logits, lse, targets, known, budget),
            ]
            old, new = runs[0][1], runs[1][1]
            out[budget] = {
                "before_s": min(runs[0][0], runs[2][0]),
                "after_s": min(runs[1][0], runs[3][0]),
                "equals_definition": bool(torch.equal(new, tree_pops_reference(logits, targets, known, budget))),
                "anchors_differing_from_before": int((new != old).any(dim=1).sum()),
            }
        return out
    finally:
        torch.set_num_threads(threads)


def exactness(total: int) -> dict:
    """Compiled pop indices == the definition on `total` random anchors over EXACT_SHAPES x kinds."""
    from bench.standins import tree_cases
    from scoring.methods.ddtree_heap import tree_pops_reference
    from scoring.methods.ddtree_kernels import tree_pops

    checked = differing = 0
    for kind in ("plain", "ties", "near"):
        for seed, (depth, vocab, budget, share) in enumerate(EXACT_SHAPES):
            anchors = math.ceil(total * share / 3)
            logits, targets, known = tree_cases(seed, anchors, depth, vocab, kind)
            found = tree_pops(logits, torch.logsumexp(logits, -1), targets, known, budget)
            differing += int((found != tree_pops_reference(logits, targets, known, budget)).any(dim=1).sum())
            checked += anchors
    return {"anchors": checked, "differing": differing}


def score_overlap(ckpt: str, shard_dir: str, work) -> dict:
    """run_score chain only vs chain + DDTree up to 1024, alternated, min of 2; stage seconds."""
    from pipeline.common import timing
    from scoring.config import ScoreConfig
    from scoring.score.run import run_score

    def one(budgets, label):
        clock = StageClock()
        with Phase() as phase, timing.recording(clock):
            run_score(
                ScoreConfig(
                    ckpts=[ckpt], shards=shard_dir, out=str(work / f"ddtree-{label}"), tree_nodes=budgets, force=True
                )
            )
        return phase.seconds, clock, phase.others_cpu

    log("ddtree: score chain only vs chain + DDTree 4..1024 (2 each, alternated) ...")
    runs = {"chain": [], "ddtree": []}
    for _ in range(2):
        runs["chain"].append(one([], "chain"))
        runs["ddtree"].append(one(SCORE_BUDGETS, "ddtree"))
    chain, tree = min(runs["chain"], key=lambda r: r[0]), min(runs["ddtree"], key=lambda r: r[0])
    busy, wait = tree[1].get("ddtree") or 0.0, tree[1].get("ddtree wait") or 0.0
    return {
        "chain_s": chain[0],
        "ddtree_s": tree[0],
        "ratio": tree[0] / chain[0],
        "worker_busy_s": busy,
        "main_wait_s": wait,
        "hidden_share": 1 - wait / busy if busy else None,
        "logsumexp_s": tree[1].get("logsumexp"),
        "others_cpu": [r[2] for r in runs["chain"] + runs["ddtree"]],
    }


def checkpoint(ctx, shard_dir: str) -> str:
    """The score section's fitted drafter, or one fitted the same way now."""
    if "checkpoint" in ctx.figures.get("score", {}):
        return ctx.figures["score"]["checkpoint"]
    from bench.sections.score import fit

    return fit(ctx.args, shard_dir, ctx.work)[0]


def run(ctx):
    args = ctx.args
    shard_dir = fp32.shards(ctx)
    ckpt = checkpoint(ctx, shard_dir)
    log("ddtree: drafter logits of the score samples ...")
    logits, targets, known = drafter_logits(ckpt, shard_dir, 96 if args.quick else 256)
    log(f"ddtree: per core, before / after, {logits.shape[0]} anchors, budgets {BUDGETS} ...")
    figures = {"per_core": per_core(logits, targets, known)}
    log("ddtree: exactness on random anchors ...")
    figures["exactness"] = exactness(10_000 if args.quick else 100_000)
    figures["score"] = score_overlap(ckpt, shard_dir, ctx.work)
    return figures, rows(figures)


def rows(figures: dict) -> Rows:
    rows, core = Rows(), figures["per_core"]
    n = core["anchors"]
    rows.add(
        "DDTree per core, same anchors",
        f"{n} anchors of the score drafter, 1 thread; logsumexp {1e3 * core['logsumexp_s'] / n:.2f} ms/anchor (shared with the chain's metrics)",
    )
    for budget in BUDGETS:
        f = core[budget]
        speedup = f["before_s"] / f["after_s"]
        rows.add(
            f"  max budget {budget}: anchors/s before / after",
            f"{n / f['before_s']:.0f} / {n / f['after_s']:.0f} ({speedup:.1f}x); = definition: {'yes' if f['equals_definition'] else 'NO'}; differ from before: {f['anchors_differing_from_before']}",
            target=">= 10x",
            met=speedup >= 10 and f["equals_definition"],
        )
    ex = figures["exactness"]
    rows.add(
        "DDTree compiled == definition (random anchors, ties, near-ties)",
        f"{ex['anchors']} anchors, {ex['differing']} differ",
        target="0 differ",
        met=ex["differing"] == 0,
    )
    sc = figures["score"]
    rows.add(
        "score all anchors: chain / chain + DDTree 4..1024",
        f"{sc['chain_s']:.1f} s / {sc['ddtree_s']:.1f} s = {sc['ratio']:.2f}x; DDTree worker {num(sc['worker_busy_s'], '.1f')} s, main waited {num(sc['main_wait_s'], '.1f')} s",
        target="<= 1.3x",
        met=sc["ratio"] <= 1.3,
    )
    return rows
