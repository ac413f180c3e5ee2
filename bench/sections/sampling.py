"""Section `sampling`: offline expected tau at T > 0 against the reference online loop (issue 14).

On the real SmolLM2-135M target (fp32, CPU) at temperature 0.6, top-p 0.95, top-k 20, with the
score section's checkpoint (fitted here on the score prompts' greedy fp32 shards when that
section did not run):

- offline: `specreplay extract` samples `draws` responses per score prompt at those settings, then
  `specreplay score` gives each response's expected tau (chain); mean ± standard error over
  responses (summary.parquet, dataset "(all)");
- online: `dflash.model.dflash_generate` at the same settings, `seeds` runs per prompt
  (`torch.manual_seed` per run); tau of a run = mean(acceptance_lengths); mean ± standard error
  over runs.

Both estimate the same expectation (speculative sampling is exact in distribution), so their
difference should lie within 3 combined standard errors. Wall time of each side: extract and
score separately (target loaded once, outside both), the online loop after a warm-up.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from bench.common import Phase, Rows, log
from bench.sections import fp32, score

TEMPERATURE, TOP_P, TOP_K = 0.6, 0.95, 20
SEED = 0  # extract's seed (with the prompt id and the draw, each response's generator)
ONLINE_SEED = 1000  # online run s of prompt i: torch.manual_seed(ONLINE_SEED + 100 * i + s)


def sizes(args) -> dict:
    """Draws per prompt, online seeds per prompt and new tokens. Full: 254 s of the section's own
    time on the 2-core AMD EPYC (2026-12-01; 174 s of it the online loop), quick: ~100 s."""
    if args.quick:
        return {"draws": 2, "seeds": 2, "max_new_tokens": args.max_new_tokens}
    return {"draws": 3, "seeds": 2, "max_new_tokens": min(args.max_new_tokens, 64)}


def checkpoint(ctx) -> tuple[str, dict | None]:
    """The score section's drafter, or one fitted the same way now (its fit figures)."""
    if "checkpoint" in ctx.figures.get("score", {}):
        return ctx.figures["score"]["checkpoint"], None
    log("sampling: the score section did not run; fitting its drafter on the score prompts ...")
    return score.fit(ctx.args, fp32.shards(ctx), ctx.work)


def mean_se(values: list[float]) -> tuple[float, float | None]:
    from scoring.replay.metrics import tau_standard_error

    return float(np.mean(values)), tau_standard_error(values)


def run(ctx) -> tuple[dict, Rows]:
    import dflash.model as reference
    import polars as pl

    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.run import run_extract
    from pipeline.extract.target import load_target
    from pipeline.shards import ShardSet
    from scoring.config import ScoreConfig
    from scoring.score.run import run_score

    args, work = ctx.args, ctx.work
    size = sizes(args)
    ckpt, fit_figures = checkpoint(ctx)
    result = {
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "top_k": TOP_K,
        **size,
        "prompts": args.score_prompts,
        "checkpoint": ckpt,
        "fit": fit_figures,
        "threads": torch.get_num_threads(),
    }
    loaded = load_target("smollm2", dtype="fp32")
    target = loaded[0]

    # offline: sampled extract, then score (chain only: the figure is the chain's expected tau)
    out = work / "shards-sampled"
    log(
        f"sampling: extract at T {TEMPERATURE}, top-p {TOP_P}, top-k {TOP_K}: {args.score_prompts} prompts x "
        f"{size['draws']} draws, {size['max_new_tokens']} new tokens ..."
    )
    config = ExtractConfig(
        model="smollm2",
        prompts=args.prompt_set,
        limit=args.score_prompts,
        out=str(out),
        max_new_tokens=size["max_new_tokens"],
        dtype="fp32",
        overwrite=True,
        quiet=True,
        batch_size=args.batch_size,
        temperature=TEMPERATURE,
        top_p=TOP_P,
        sample_top_k=TOP_K,
        num_samples=size["draws"],
        seed=SEED,
    )
    with Phase() as phase:
        run_extract(config, loaded=loaded)  # the loaded target: neither side includes model loading
    result["extract"] = phase.figures()
    log(f"sampling:   {phase.seconds:.1f}s (other processes: {phase.others_cpu} cores); scoring ...")
    with Phase() as phase:
        [outcome] = run_score(
            ScoreConfig(ckpts=[ckpt], shards=str(out), out=str(work / "results-sampled"), tree_nodes=[], force=True)
        )
    results_dir = Path(outcome.out_dir)
    summary = (
        pl.read_parquet(str(results_dir / "summary.parquet"), glob=False)
        .filter((pl.col("dataset") == "(all)") & (pl.col("method") == "chain"))
        .row(0, named=True)
    )
    per_response = (
        pl.read_parquet(str(results_dir / "samples.parquet"), glob=False)
        .filter(pl.col("method") == "chain")
        .select("sample_id", "tau")
        .sort("sample_id")
    )
    taus = [t for t in per_response["tau"].to_list() if t is not None]
    result["score"] = {**phase.figures(), "anchors": outcome.record["anchors"]}
    result["offline"] = {
        "tau": summary["tau"],
        "tau_se": summary["tau_se"],
        "responses": len(taus),
        "responses_without_steps": per_response.height - len(taus),
        "tokens": int(sum(s.response_len for s in ShardSet(str(out)).samples(tensors=[], prefetch=0))),
        "per_response_tau": dict(per_response.iter_rows()),
        # the same mean from the per-response rows (a check of the summary)
        "tau_from_samples": mean_se(taus)[0] if taus else None,
    }
    log(
        f"sampling:   {phase.seconds:.1f}s; offline expected tau {summary['tau']:.3f} ± {summary['tau_se']:.3f} "
        f"over {len(taus)} responses"
    )

    # online: the reference loop at the same settings, `seeds` seeded runs per prompt
    reference._cuda_time = time.perf_counter  # its stats use CUDA events; on CPU a wall clock
    shardset = ShardSet(str(out))
    stop_ids = list(shardset.settings["target"]["stop_token_ids"])
    prompts = {}
    for sample in shardset.samples(tensors=[], prefetch=0):
        prompts.setdefault(sample.sample_id.rsplit("#", 1)[0], sample.input_ids[: sample.prompt_len][None])
    draft = reference.DFlashDraftModel.from_pretrained(ckpt, dtype=torch.float32).eval()
    sampling = dict(temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, return_stats=True)
    log("sampling: warm-up online (1 prompt, 16 new tokens) ...")
    torch.manual_seed(ONLINE_SEED - 1)
    reference.dflash_generate(draft, target, next(iter(prompts.values())), 16, stop_ids, **sampling)
    log(f"sampling: online dflash_generate, {len(prompts)} prompts x {size['seeds']} seeds ...")
    runs = []
    with Phase() as phase:
        for i, (prompt_id, prompt) in enumerate(sorted(prompts.items())):
            for s in range(size["seeds"]):
                torch.manual_seed(ONLINE_SEED + 100 * i + s)
                stats = reference.dflash_generate(draft, target, prompt, size["max_new_tokens"], stop_ids, **sampling)
                lengths = list(stats.acceptance_lengths)
                runs.append(
                    {
                        "prompt": prompt_id,
                        "seed": s,
                        "tau": float(np.mean(lengths)),
                        "steps": len(lengths),
                        "tokens": sum(lengths),
                    }
                )
    del draft, target, loaded
    tau, se = mean_se([r["tau"] for r in runs])
    tokens = sum(r["tokens"] for r in runs)
    result["online"] = {
        **phase.figures(),
        "tau": tau,
        "tau_se": se,
        "runs": len(runs),
        "steps": sum(r["steps"] for r in runs),
        "tokens": tokens,
        "tokens_per_s": tokens / phase.seconds,
        "per_run": runs,
    }
    log(f"sampling:   {phase.seconds:.1f}s; online tau {tau:.3f} ± {se:.3f} over {len(runs)} runs")

    off = result["offline"]
    combined = float(np.hypot(off["tau_se"], se))
    difference = tau - off["tau"]
    result["agreement"] = {
        "difference_online_minus_offline": difference,
        "combined_se": combined,
        "z": difference / combined,
        "within_3_se": abs(difference) <= 3 * combined,
    }
    return result, rows(result)


def rows(r: dict) -> Rows:
    out = Rows()
    off, on, agree = r["offline"], r["online"], r["agreement"]
    fit = r["fit"]
    out.add(
        f"sampling T {r['temperature']}, top-p {r['top_p']}, top-k {r['top_k']}: {r['prompts']} prompts, "
        f"{r['max_new_tokens']} new tokens, "
        + ("score section's drafter" if fit is None else f"drafter fitted here ({fit['seconds']:.0f} s)")
    )
    out.add(
        f"  offline expected tau (chain), {r['draws']} draws/prompt",
        f"{off['tau']:.3f} ± {off['tau_se']:.3f} ({off['responses']} responses)",
    )
    out.add(
        f"  online dflash_generate tau, {r['seeds']} seeds/prompt",
        f"{on['tau']:.3f} ± {on['tau_se']:.3f} ({on['runs']} runs)",
    )
    out.add(
        "  online - offline (combined SE)",
        f"{agree['difference_online_minus_offline']:+.3f} ({agree['combined_se']:.3f}; z {agree['z']:+.2f})",
        "within 3 SE",
        agree["within_3_se"],
    )
    out.add(
        "  offline sampled extract / score",
        f"{r['extract']['wall_s']:.1f} s ({off['tokens']} tokens) / {r['score']['wall_s']:.1f} s "
        f"({r['score']['anchors']} anchors)",
        others=[r["extract"]["others_cpu"], r["score"]["others_cpu"]],
    )
    out.add(
        "  online dflash_generate",
        f"{on['wall_s']:.1f} s ({on['steps']} steps, {on['tokens']} tokens)",
        others=on["others_cpu"],
    )
    return out
