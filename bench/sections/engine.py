"""Section `engine`: `extract --responses-from` (a real llama.cpp `llama-server` serving the
bundled SmolLM2-135M GGUF) against `extract` generating with transformers, on the same prompts,
CPU, side by side: reps alternated, ratio of the minima.

Both sides run `run_extract` with the loaded target reused, so model loading counts on neither
side; the server starts once before the runs (its start-up time is reported apart). Every rep
writes a fresh output directory: the engine side fetches every response again instead of reading
its response cache. The server runs one slot (tools/llama_server.py says why) while extract keeps
its default 4 requests in flight. Reported beside the ratio: each side's stage split (the
responses vs the capture forward) and how many engine responses the target's full forward
confirms token for token (no argmax mismatch: the walk on them is exact). The GGUF is Q4_1, the
target fp32, so a few responses differ from the target's own greedy output.
"""

from __future__ import annotations

import shutil
import time

from bench.common import Rows, log, num, others_cpu
from bench.sections.extract import timed_extract


def extract_config(ctx, out, responses_from=None):
    from pipeline.extract.config import ExtractConfig

    args = ctx.args
    return ExtractConfig(
        model="smollm2",
        prompts=args.prompt_set,
        limit=args.prompts,
        out=str(out),
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        overwrite=True,
        quiet=True,
        responses_from=responses_from,
    )


def one_side(config, loaded) -> dict:
    """One extract into a fresh directory: wall seconds, its stages, what the manifest counts."""
    shutil.rmtree(config.out, ignore_errors=True)
    start = time.perf_counter()
    manifest, wall, clock = timed_extract(config, loaded)
    totals = manifest["totals"]
    return {
        "wall_s": wall,
        "others_cpu": others_cpu(start, time.perf_counter()),
        "responses_s": clock.get("engine responses") or clock.get("generate"),
        "capture_s": clock.get("capture"),
        "response_tokens": totals["response_tokens"],
        "argmax_mismatches": totals["argmax_mismatches"],
    }


def exact_samples(out: str) -> tuple[int, int]:
    """(samples whose response the target's forward confirms token for token, samples)."""
    from pipeline.extract.inspect import inspect_extract

    report = inspect_extract(out, verify=False)
    return report["exact_samples"], report["samples"]


def side_by_side(ctx, url: str, loaded) -> dict:
    """`reps` alternations of the two sides; the figures of each side's fastest rep."""
    reps = ctx.args.reps or 2
    sides = {"generate": extract_config(ctx, ctx.work / "engine-generate"), "engine": None}
    sides["engine"] = extract_config(ctx, ctx.work / "engine-served", responses_from=[url])
    runs = {name: [] for name in sides}
    for rep in range(reps):
        for name, config in sides.items():
            log(f"engine: rep {rep + 1}/{reps} extract, responses from {name} ...")
            runs[name].append(one_side(config, loaded))
            log(f"engine:   {runs[name][-1]['wall_s']:.1f}s (other processes: {runs[name][-1]['others_cpu']} cores)")
    best = {name: min(r, key=lambda run: run["wall_s"]) for name, r in runs.items()}
    exact, samples = exact_samples(sides["engine"].out)
    return {
        "reps": reps,
        "runs": runs,
        "best": best,
        "ratio_engine_over_generate": best["engine"]["wall_s"] / best["generate"]["wall_s"],
        "engine_exact_samples": exact,
        "samples": samples,
    }


def run(ctx) -> tuple[dict, Rows]:
    from pipeline.extract.target import load_target, smollm2_gguf_path
    from tools.llama_server import LlamaServer

    loaded = load_target("smollm2")
    start = time.perf_counter()
    server = LlamaServer(smollm2_gguf_path(), ctx.work / "llama-server.log").start()
    started = time.perf_counter() - start
    try:
        figures = side_by_side(ctx, server.url, loaded)
    finally:
        server.stop()
    figures["server_start_s"] = started
    return figures, rows_of(figures)


def rows_of(figures: dict) -> Rows:
    best, rows = figures["best"], Rows()
    generate, engine = best["generate"], best["engine"]
    sides = [generate["others_cpu"], engine["others_cpu"]]
    rows.add(
        f"extract, responses from llama-server vs transformers generate ({figures['samples']} prompts, CPU; "
        "others' CPU includes the server)",
        f"{figures['ratio_engine_over_generate']:.2f}x wall",
        others=sides,
    )
    for name, side in (("transformers generate", generate), ("llama-server (Q4_1 GGUF)", engine)):
        rows.add(
            f"  {name}: wall / responses / capture",
            f"{side['wall_s']:.1f} / {num(side['responses_s'], '.1f')} / {num(side['capture_s'], '.1f')} s",
        )
    rows.add(
        "  engine responses the target confirms token for token",
        f"{figures['engine_exact_samples']}/{figures['samples']} ({engine['argmax_mismatches']} mismatched positions)",
    )
    rows.add("  llama-server start-up (not in the ratio)", f"{figures['server_start_s']:.1f} s")
    return rows
