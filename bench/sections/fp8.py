"""Section `fp8`: opt-in lossy features (issue 4 item 4). The score prompts extracted again from
the fp32 target with `--feature-dtype fp8` (e4m3 values, one float32 scale per token and feature
layer), their bytes against raw bf16, and the score section's checkpoint scored on them: tau per
method against the lossless run, and how many chain walks stay identical step for step."""

from __future__ import annotations

from pathlib import Path

from bench.common import Phase, Rows, log
from bench.sections.extract import stored_bytes
from bench.sections.score import summary_tau, walk_lists


def run(ctx) -> tuple[dict, Rows]:
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.run import run_extract
    from scoring.config import ScoreConfig
    from scoring.score.run import run_score

    args, lossless = ctx.args, ctx.figures["score"]
    out = ctx.work / "shards-fp8"
    log("fp8: extract with --feature-dtype fp8 (fp32 target, score prompts) ...")
    with Phase() as phase:
        run_extract(
            ExtractConfig(
                model="smollm2",
                prompts=args.prompt_set,
                limit=args.score_prompts,
                out=str(out),
                max_new_tokens=args.max_new_tokens,
                dtype="fp32",
                feature_dtype="fp8",
                overwrite=True,
                quiet=True,
                batch_size=args.batch_size,
            )
        )
    result = {"extract_s": phase.seconds, "storage": stored_bytes(str(out))}
    log(f"fp8:   features {result['storage']['features_vs_raw_bf16']:.3f} of raw bf16; scoring ...")
    [outcome] = run_score(
        ScoreConfig(
            ckpts=[lossless["checkpoint"]],
            shards=str(out),
            out=str(ctx.work / "results-fp8"),
            tree_nodes=list(lossless["ddtree_budgets"]),
            force=True,
        )
    )
    results_dir = Path(outcome.out_dir)
    tau = summary_tau(results_dir)
    result.update(
        tau=tau,
        tau_lossless=lossless["tau"],
        tau_change={m: tau[m] - lossless["tau"][m] for m in tau if lossless["tau"].get(m) is not None},
    )
    fp8_walks, lossless_walks = walk_lists(str(results_dir / "walk.parquet")), lossless["chain_walks"]
    result["chain_walks_identical"] = sum(fp8_walks.get(k) == v for k, v in lossless_walks.items())
    result["samples"] = len(lossless_walks)

    rows = Rows()
    st = result["storage"]
    rows.add(f"fp8 features (--feature-dtype fp8, lossy), {result['samples']} score prompts")
    rows.add(
        "  features bytes/token vs raw bf16",
        f"{st['features_bytes_per_token']:.0f}/"
        f"{st['raw_bf16_features_bytes_per_token']} = {st['features_vs_raw_bf16']:.3f}",
    )
    rows.add("  tau fp8 - tau lossless", ", ".join(f"{k} {v:+.3f}" for k, v in result["tau_change"].items()))
    rows.add("  chain walks identical to lossless", f"{result['chain_walks_identical']}/{result['samples']}")
    return result, rows
