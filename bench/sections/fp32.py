"""Section `fp32`: the CPU default model dtype. The score prompts extracted from the fp32 target
(one bare / extract pair): its overhead and its stored features against raw fp32 and raw bf16.
These are also the shards the score section replays (fp32 gives exact parity with the fp32
online loop); without this section, score extracts them itself."""

from __future__ import annotations

from bench.common import Rows
from bench.sections.extract import measure_extract, stored_bytes


def shards(ctx) -> str:
    """The fp32 shards of the score prompts: this section's, or extracted now (no bare side)."""
    if "fp32" not in ctx.figures:
        ctx.figures["fp32"] = {"run": measure_extract(ctx, "fp32", ctx.args.score_prompts, 1, with_bare=False)}
    return ctx.figures["fp32"]["run"]["out"]


def run(ctx) -> tuple[dict, Rows]:
    ex = measure_extract(ctx, "fp32", ctx.args.score_prompts, 1)
    st = stored_bytes(ex["out"])
    rows = Rows()
    rows.add(f"extract fp32 (CPU default): {ex['prompts']} prompts, one pair")
    rows.add(
        "  features vs raw fp32 / raw bf16",
        f"{st['features_vs_raw_same_dtype']:.3f} / {st['features_vs_raw_bf16']:.3f}",
    )
    rows.add(
        "  fp32 extract overhead (extract / bare)",
        f"{ex['overhead_ratio']:.3f}x",
        others=[ex["bare_runs"][0].get("others_cpu"), ex["extract_runs_others_cpu"][0]],
    )
    return {"run": ex, "storage": st}, rows
