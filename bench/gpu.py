"""`make bench-gpu` = `python -m bench.gpu`: the figures `make bench` cannot measure without a
GPU, as one prepared run (issue 13, item 6): about 10 minutes on one H200 (its parts timed there on 2026-12-04), nothing downloaded.

    .venv/bin/python -m bench.gpu                      # CUDA: full sizes; no CUDA: CPU sizes (times: bench/README.md)
    .venv/bin/python -m bench.gpu --size tiny          # seconds: proves the script runs (tests/bench/test_gpu.py)
    .venv/bin/python -m bench.gpu --only parity,extract

Parts, all through the product's own entry points on random-weight stand-ins (bench/standins.py):
  parity      `run_score` with attention "flex" and "dense" on the same synthetic shards and
              drafter: in fp32 the walks of every method (chain, DDTree 16..1024) must be
              identical; in bf16 the tau difference per method. A small vocabulary, so that the
              DDTree walks (random drafter, random tokens) are not trivially one token a step.
  throughput  a drafter of a 27B target's DFlash shapes (5 layers, hidden 5120, vocab 248320,
              block 16), all anchors, chain only, bf16: anchors/s, and its useful FLOP/s as a
              fraction of the bf16 `F.linear` peak measured here at the replay's own GEMM shapes
              (bench/sections/gemm.py; target >= 40%, issue 4).
  ddtree      the same anchors scored chain only and chain + DDTree budgets 16..1024, alternated:
              ratio of times, the share of the DDTree run that DDTree adds, and how much of
              DDTree's worker-thread time the drafter overlaps (stages "ddtree", "ddtree wait").
  extract     extract overhead at a mid-size random target built from a config: `run_extract`
              against the bare generate + forward (bench/sections/extract.py's measures).
  speed       `specreplay speed`'s predicted speedup against transformers' own prompt lookup and
              assisted generation at K 1..8 on a random stand-in target (bench/gpu_speed.py).

Without CUDA every part runs at shrunken shapes in fp32 (the CPU default) so CI can prove the
script works, and the rows that only a GPU can give print "skipped: no CUDA". Writes
bench/results/bench-gpu-<date>-<time>.json (figures, the printed rows, the environment).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from bench import common
from bench.common import ROOT, Rows, environment, finish_run, format_table, log, num, start_run

PARTS = ("parity", "throughput", "ddtree", "extract", "speed")
BUDGETS = [16, 32, 64, 128, 256, 512, 1024]
FRACTION_TARGET = 0.40  # issue 4: >= 40% of the bf16 matmul peak on a GPU
CUDA_ONLY = (  # rows only a GPU gives; without CUDA they print "skipped: no CUDA"
    "flex_attention compiled (CUDA kernel) vs dense",
    "27B drafter shapes, bf16: anchors/s",
    "27B drafter shapes, bf16: useful FLOP/s / bf16 matmul peak",
    "27B drafter shapes: DDTree 16..1024 time share",
    "extract overhead, mid-size target, bf16 on CUDA",
)


def target(hidden, vocab, layers, heads, kv_heads, head_dim, intermediate) -> dict:
    return dict(
        hidden_size=hidden,
        vocab_size=vocab,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
    )


def drafter(layers, heads, kv_heads, head_dim, intermediate, mask_token_id, block_size=16) -> dict:
    return dict(
        num_layers=layers,
        block_size=block_size,
        num_heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        mask_token_id=mask_token_id,
    )


# Per size: the parity set (target widths of the synthetic shards, drafter, response lengths),
# the throughput set, and the extract target. full: one H200 in ~10 min; cpu: see bench/README.md;
# tiny: seconds (the test). Target layer counts place the 5 feature layers (8 or more: 5 distinct ids).
SIZES = {
    "full": {
        "parity": dict(
            target=target(1024, 4096, 32, 16, 4, 64, 3072),
            drafter=drafter(1, 16, 4, 64, 3072, 4095),
            lengths=[256, 512, 1024, 2048],  # distinct: a synthetic sample's id is its length
        ),
        "big": dict(
            name="27B drafter shapes",
            target=target(5120, 248320, 64, 24, 4, 256, 17408),
            drafter=drafter(5, 32, 8, 128, 17408, 248070),
            lengths=[2048, 1536, 1024],
        ),
        "extract": dict(
            target=target(2048, 65536, 16, 16, 4, 128, 6144), prompts=16, prompt_tokens=32, new_tokens=128, batch=8
        ),
        "reps": 2,
    },
    "cpu": {
        "parity": dict(
            target=target(256, 1024, 8, 4, 2, 64, 768), drafter=drafter(1, 4, 2, 64, 768, 1023), lengths=[80, 128]
        ),
        "big": dict(
            name="CPU stand-in shapes",
            target=target(512, 8192, 8, 8, 2, 64, 1536),
            drafter=drafter(2, 8, 2, 64, 1536, 8191),
            lengths=[160, 224],
        ),
        "extract": dict(
            target=target(256, 4096, 8, 4, 2, 64, 768), prompts=8, prompt_tokens=16, new_tokens=32, batch=4
        ),
        "reps": 2,
    },
    "tiny": {
        "parity": dict(
            target=target(128, 256, 8, 2, 1, 64, 256), drafter=drafter(1, 2, 1, 64, 256, 255), lengths=[24, 40]
        ),
        "big": dict(
            name="tiny stand-in shapes",
            target=target(128, 1024, 8, 2, 1, 64, 256),
            drafter=drafter(2, 2, 1, 64, 256, 1023),
            lengths=[48],
        ),
        "extract": dict(target=target(128, 1024, 8, 2, 1, 64, 256), prompts=2, prompt_tokens=8, new_tokens=8, batch=2),
        "reps": 1,
    },
}
PROMPT_TOKENS = 32  # of every synthetic shard sample


@dataclass
class Env:
    size: dict
    device: str
    cuda: bool
    dtype: str  # the compute dtype of the throughput and extract parts: bf16 on CUDA, fp32 on CPU
    work: Path
    budgets: list[int]
    chain: dict | None = None  # the throughput part's best chain-only run, which ddtree compares with
    size_name: str = "full"


# ---------------------------------------------------------------------------------------------
# stand-ins and score runs


def stand_in(env: Env, name: str, spec: dict) -> tuple[str, str]:
    """(shard dir, drafter checkpoint): synthetic shards at the spec's target widths and a
    random-weight drafter for them, both written once per run."""
    from bench.standins import build_drafter, write_synthetic_shards
    from pipeline.common.layer_ids import build_target_layer_ids

    shard_dir, ckpt = env.work / f"{name}-shards", env.work / f"{name}-drafter"
    if not shard_dir.exists():
        t = spec["target"]
        layer_ids = build_target_layer_ids(t["num_hidden_layers"], 5)
        write_synthetic_shards(
            shard_dir,
            spec["lengths"],
            t["hidden_size"],
            t["vocab_size"],
            t["num_hidden_layers"],
            layer_ids,
            PROMPT_TOKENS,
        )
        build_drafter(ckpt, t, spec["drafter"], layer_ids)
    return str(shard_dir), str(ckpt)


def score(env: Env, ckpt: str, shards: str, label: str, **config) -> dict:
    """One timed `run_score` (bench/sections/gemm.py's `timed_score`) on env's device."""
    from bench.sections.gemm import timed_score

    config.setdefault("device", env.device)
    run = timed_score(ckpt, shards, env.work / f"results-{label}", **config)
    seconds = run["stages"]["seconds"]
    run["replay_s"] = seconds.get("replay anchors", 0.0) + seconds.get("context keys/values", 0.0)
    log(f"gpu:   {label}: {run['wall_s']:.1f} s ({run['replay_s']:.1f} s replay), {run['anchors']} anchors")
    return run


def tau(run: dict) -> dict:
    from bench.sections.score import summary_tau

    return summary_tau(Path(run["out_dir"]))


# ---------------------------------------------------------------------------------------------
# parity: flex vs dense


def walks(run: dict):
    import polars as pl

    walk = pl.read_parquet(str(Path(run["out_dir"]) / "walk.parquet"), glob=False)
    return walk.select("sample_id", "method", "step", "produced").sort("sample_id", "method", "step")


def drafts(run: dict):
    import polars as pl

    anchors = pl.read_parquet(str(Path(run["out_dir"]) / "anchors.parquet"), glob=False)
    return anchors.select("sample_id", "anchor", "draft_tokens", "target_prob").sort("sample_id", "anchor")


def compare(dense: dict, flex: dict) -> dict:
    """Walks per sample (every method), draft tokens per block position, target probabilities,
    tau per method of two runs on the same anchors."""
    a, b = walks(dense), walks(flex)
    samples = a["sample_id"].unique().to_list()
    same = sum(a.filter(a["sample_id"] == s).equals(b.filter(b["sample_id"] == s)) for s in samples)
    da, db = drafts(dense), drafts(flex)
    tokens_a, tokens_b = (np.concatenate(d["draft_tokens"].to_list()) for d in (da, db))
    probs_a, probs_b = (np.concatenate(d["target_prob"].to_list()).astype(np.float64) for d in (da, db))
    tau_a, tau_b = tau(dense), tau(flex)
    return {
        "samples": len(samples),
        "walks_identical": same,
        "walk_steps": a.height,
        "draft_positions": int(tokens_a.size),
        "draft_positions_equal": int((tokens_a == tokens_b).sum()),
        "target_prob_max_abs_diff": float(np.nanmax(np.abs(probs_a - probs_b))),
        "tau_dense": tau_a,
        "tau_flex": tau_b,
        "tau_max_abs_diff": max(abs(tau_a[m] - tau_b[m]) for m in tau_a if tau_a[m] is not None),
    }


def part_parity(env: Env) -> tuple[dict, Rows]:
    spec = env.size["parity"]
    shards, ckpt = stand_in(env, "parity", spec)
    out = {"lengths": spec["lengths"], "target": spec["target"], "drafter": spec["drafter"], "budgets": env.budgets}
    for dtype in ("fp32", "bf16"):
        runs = {}
        for attention in ("dense", "flex"):
            label = f"parity-{dtype}-{attention}"
            config = dict(tree_nodes=env.budgets, dtype=dtype, attention=attention, anchor_drafts=True)
            runs[attention] = score(env, ckpt, shards, label, **config)  # not timed: no warm-up needed
        out[dtype] = compare(runs["dense"], runs["flex"])
        out[dtype]["wall_s"] = {k: r["wall_s"] for k, r in runs.items()}
    return out, parity_rows(out, env)


def parity_rows(p: dict, env: Env) -> Rows:
    out = Rows()
    kernel = "compiled flex_attention" if env.cuda else "eager flex_attention (CPU reference path)"
    out.add(
        f"parity on {env.device}: {kernel} vs dense, synthetic shards (vocab {p['target']['vocab_size']}, "
        f"{sum(p['lengths'])} response tokens), DDTree {p['budgets'][0]}..{p['budgets'][-1]}"
    )
    f32, b16 = p["fp32"], p["bf16"]
    out.add(
        "  fp32: walks identical, every method",
        f"{f32['walks_identical']}/{f32['samples']} samples ({f32['walk_steps']} steps)",
        "all",
        f32["walks_identical"] == f32["samples"],
    )
    out.add(
        "  fp32: draft tokens equal; max |d target prob|",
        f"{f32['draft_positions_equal']}/{f32['draft_positions']}; {f32['target_prob_max_abs_diff']:.2e}",
    )
    out.add("  bf16: max |tau flex - tau dense| over methods", f"{b16['tau_max_abs_diff']:.4f}")
    from scoring.methods.chain import CHAIN
    from scoring.methods.ddtree import DDTREE

    deepest = DDTREE.name(p["budgets"][-1])
    out.add(
        f"  bf16: draft tokens equal; tau dense / flex, chain and {deepest}",
        f"{b16['draft_positions_equal']}/{b16['draft_positions']}; {b16['tau_dense'][CHAIN]:.3f} / "
        f"{b16['tau_flex'][CHAIN]:.3f}, {b16['tau_dense'][deepest]:.3f} / {b16['tau_flex'][deepest]:.3f}",
    )
    return out


# ---------------------------------------------------------------------------------------------
# throughput at the 27B drafter's shapes, and the DDTree share on the same anchors


def part_throughput(env: Env) -> tuple[dict, Rows]:
    from bench.common import drafter_shape
    from bench.sections.gemm import breakdown, drafter_linears, measure_peak, replay_gemms, useful_flops

    spec = env.size["big"]
    shards, ckpt = stand_in(env, "big", spec)
    score(env, ckpt, shards, "big-warmup", tree_nodes=[], dtype=env.dtype, limit=1)
    runs = [score(env, ckpt, shards, f"big-chain-{i}", tree_nodes=[], dtype=env.dtype) for i in range(env.size["reps"])]
    best = min(runs, key=lambda r: r["replay_s"])
    vocab, hidden = spec["target"]["vocab_size"], spec["target"]["hidden_size"]
    config, _ = drafter_linears(ckpt)
    flops = useful_flops(drafter_shape(config, vocab, hidden), shards, Path(best["out_dir"]))
    log(f"gpu: {env.dtype} F.linear peak at the replay's shapes on {env.device} ...")
    peak = measure_peak(replay_gemms(ckpt, (vocab, hidden), best["calls"]), torch_dtype(env.dtype), env.device)
    out = {
        "shapes": spec,
        "dtype": env.dtype,
        "anchors": best["anchors"],
        "wall_s": best["wall_s"],
        "replay_s": best["replay_s"],
        "replay_runs_s": [r["replay_s"] for r in runs],
        "anchors_per_s": best["anchors"] / best["replay_s"],
        "anchors_per_s_wall": best["anchors"] / best["wall_s"],
        "useful_flops": flops,
        "useful_gflop_s": flops["total"] / best["replay_s"] / 1e9,
        "peak": peak,
        "fraction_of_peak": flops["total"] / best["replay_s"] / (peak["peak_gflop_s"] * 1e9),
        "fraction_of_peak_wall": flops["total"] / best["wall_s"] / (peak["peak_gflop_s"] * 1e9),
        "breakdown": breakdown(best, flops, peak),
        "stages": best["stages"],
    }
    env.chain = best  # the ddtree part compares with this run
    return out, throughput_rows(out, env)


def rate(gflop_s: float) -> str:
    return f"{gflop_s / 1e3:.2f} TFLOP/s" if gflop_s >= 1e3 else f"{gflop_s:.1f} GFLOP/s"


def torch_dtype(name: str):
    from pipeline.common.dtypes import resolve_dtype

    return resolve_dtype(name)


def throughput_rows(t: dict, env: Env) -> Rows:
    out = Rows()
    name, d = t["shapes"]["name"], t["shapes"]["drafter"]
    label = f"{name}, {t['dtype']}" + ("" if env.cuda else " (CPU, not a GPU figure)")
    out.add(
        f"throughput, {label}: {d['num_layers']} layers, hidden {t['shapes']['target']['hidden_size']}, vocab "
        f"{t['shapes']['target']['vocab_size']}, block {d['block_size']}, all anchors, chain"
    )
    out.add(
        "  anchors/s (replay: context pass + anchors; whole call)",
        f"{t['anchors_per_s']:.0f} ({t['anchors']} anchors in {t['replay_s']:.2f} s); {t['anchors_per_s_wall']:.0f}",
    )
    out.add(f"  {t['dtype']} F.linear peak at the replay's shapes (FLOP-weighted)", rate(t["peak"]["peak_gflop_s"]))
    for g in t["peak"]["gemms"]:
        out.add(f"    {g['name']} [{g['rows']} x {g['K']}] x [{g['K']} x {g['N']}]", rate(g["gflop_s"]))
    target = f">= {100 * FRACTION_TARGET:.0f}%" if env.cuda else ""
    out.add(
        "  useful FLOP/s / peak (replay; whole call)",
        f"{100 * t['fraction_of_peak']:.0f}%; {100 * t['fraction_of_peak_wall']:.0f}% ({rate(t['useful_gflop_s'])})",
        target,
        t["fraction_of_peak"] >= FRACTION_TARGET if env.cuda else None,
    )
    for label_, p in t["breakdown"].items():
        share = f"{p['seconds']:.2f} s = {100 * p['share_of_wall']:.0f}% of the call"
        of_peak = "" if p["of_peak"] is None else f", {100 * p['of_peak']:.0f}% of its GEMM peak"
        out.add(f"    {label_}", share + of_peak)
    return out


def part_ddtree(env: Env) -> tuple[dict, Rows]:
    """Chain-only and chain + DDTree runs alternated (the throughput part's chain runs count
    too); the fastest replay of each."""
    spec = env.size["big"]
    shards, ckpt = stand_in(env, "big", spec)
    chains, trees = [env.chain] if env.chain else [], []
    for rep in range(env.size["reps"]):
        trees.append(score(env, ckpt, shards, f"big-ddtree-{rep}", tree_nodes=env.budgets, dtype=env.dtype))
        chains.append(score(env, ckpt, shards, f"big-chain-again-{rep}", tree_nodes=[], dtype=env.dtype))
    chain, tree = (min(runs, key=lambda r: r["replay_s"]) for runs in (chains, trees))
    seconds = tree["stages"]["seconds"]
    busy, wait = seconds.get("ddtree"), seconds.get("ddtree wait")  # DDTree's worker thread; main thread waiting
    out = {
        "budgets": env.budgets,
        "anchors": tree["anchors"],
        "chain_replay_s": chain["replay_s"],
        "ddtree_replay_s": tree["replay_s"],
        "replay_ratio": tree["replay_s"] / chain["replay_s"],
        "wall_ratio": tree["wall_s"] / chain["wall_s"],
        "added_share": 1 - chain["replay_s"] / tree["replay_s"],
        "ddtree_busy_s": busy,
        "ddtree_wait_s": wait,
        "overlapped_share": None if not busy else 1 - (wait or 0.0) / busy,
        "tau": tau(tree),
    }
    return out, ddtree_rows(out, env)


def ddtree_rows(d: dict, env: Env) -> Rows:
    rows = Rows()
    rows.add(
        f"DDTree {d['budgets'][0]}..{d['budgets'][-1]} on the same anchors, {env.size['big']['name']}, {env.dtype}"
    )
    rows.add(
        "  chain + DDTree / chain only (replay; whole call)",
        f"{d['replay_ratio']:.2f}x; {d['wall_ratio']:.2f}x ({d['ddtree_replay_s']:.2f} s vs {d['chain_replay_s']:.2f} s)",
    )
    rows.add("  share of the DDTree run's replay that DDTree adds", f"{100 * d['added_share']:.0f}%")
    overlap = "-" if d["overlapped_share"] is None else f"{100 * d['overlapped_share']:.0f}%"
    rows.add(
        "  DDTree work overlapped with the drafter (1 - wait / worker busy)",
        f"{overlap} ({num(d['ddtree_wait_s'], '.2f', ' s')} waited of {num(d['ddtree_busy_s'], '.2f', ' s')})",
    )
    return rows


# ---------------------------------------------------------------------------------------------
# extract overhead at a mid-size target


def write_prompts(path: Path, count: int, tokens: int, seed: int = 0) -> None:
    """Prompts given as token ids the stand-in tokenizer decodes (ids 3..28)."""
    rng = np.random.default_rng(seed)
    lines = [json.dumps({"id": f"p{i}", "input_ids": rng.integers(3, 29, tokens).tolist()}) for i in range(count)]
    path.write_text("\n".join(lines) + "\n")


def bare_once(loaded, items, layer_ids, spec) -> float:
    """Seconds of the bare model work (bench/sections/extract.py): generate + full-logits forward."""
    from bench.sections.extract import bare_model_work

    model, _, info = loaded
    return bare_model_work(model, info, items, layer_ids, spec["new_tokens"], spec["batch"])["total_s"]


def part_extract(env: Env) -> tuple[dict, Rows]:
    from bench.sections.extract import timed_extract
    from bench.standins import build_target
    from pipeline.common.layer_ids import build_target_layer_ids
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.plan import prepare_items
    from pipeline.extract.prompts import load_prompts
    from pipeline.extract.target import load_target

    spec = env.size["extract"]
    model_dir, prompts = env.work / "extract-target", env.work / "extract-prompts.jsonl"
    built = build_target(model_dir, spec["target"])
    write_prompts(prompts, spec["prompts"], spec["prompt_tokens"])
    loaded = load_target(str(model_dir), dtype=env.dtype, device=env.device)
    items = prepare_items(load_prompts(str(prompts)), loaded[1], None)
    layer_ids = build_target_layer_ids(loaded[2].num_layers, 5)
    config = ExtractConfig(
        model=str(model_dir),
        prompts=str(prompts),
        out=str(env.work / "extract-shards"),
        max_new_tokens=spec["new_tokens"],
        dtype=env.dtype,
        overwrite=True,
        quiet=True,
        batch_size=spec["batch"],
        device=env.device,
    )
    bare, extract, stages = [], [], []
    bare_once(loaded, items[:1], layer_ids, spec)  # warm-up: first-call allocations
    for rep in range(env.size["reps"]):
        bare.append(bare_once(loaded, items, layer_ids, spec))
        manifest, seconds, clock = timed_extract(config, loaded)
        extract.append(seconds)
        stages.append(clock.figures())
        log(f"gpu:   extract rep {rep + 1}: bare {bare[-1]:.1f} s, extract {seconds:.1f} s")
    best = int(np.argmin(extract))
    out = {
        "target": spec["target"],
        "target_params": built["params"],
        "dtype": env.dtype,
        "prompts": spec["prompts"],
        "new_tokens": spec["new_tokens"],
        "tokens": manifest["totals"]["tokens"],
        "bare_runs_s": bare,
        "extract_runs_s": extract,
        "overhead_ratio": min(extract) / min(bare),
        "extract_stages_of_min": stages[best],
    }
    return out, extract_rows(out, env)


def extract_rows(e: dict, env: Env) -> Rows:
    out = Rows()
    t = e["target"]
    out.add(
        f"extract, random target {e['target_params'] / 1e6:.0f}M params (hidden {t['hidden_size']}, "
        f"{t['num_hidden_layers']} layers, vocab {t['vocab_size']}), {e['dtype']} on {env.device}: "
        f"{e['prompts']} prompts x {e['new_tokens']} new tokens"
    )
    generate = e["extract_stages_of_min"]["seconds"].get("generate")
    out.add(
        "  bare generate + forward / specreplay extract (min)",
        f"{min(e['bare_runs_s']):.2f} s / {min(e['extract_runs_s']):.2f} s"
        + ("" if generate is None else f" (its generate {generate:.2f} s)"),
    )
    out.add("  extract overhead", f"{e['overhead_ratio']:.3f}x", "<= 1.05" if env.cuda else "")
    return out


# ---------------------------------------------------------------------------------------------
# the run


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full" if cuda else "cpu")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts: {','.join(PARTS)}")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="DDTree budgets (default 16..1024)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results directory")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(args.only) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; parts: {', '.join(PARTS)}")
    args.budgets = [int(b) for b in args.budgets.split(",") if b]
    return args


def skipped_rows(cuda: bool) -> Rows:
    out = Rows()
    if not cuda:
        for name in CUDA_ONLY:
            out.add(name, "skipped: no CUDA")
    return out


def part_speed(env: Env) -> tuple[dict, Rows]:
    from bench.gpu_speed import part_speed as speed

    return speed(env)


def run_parts(args, env: Env, figures: dict, rows: Rows, failed: list) -> None:
    """Each part asked for, into `figures`, `rows` and `failed` as it ends: a run stopped at its
    limit (SIGTERM) keeps the parts that finished."""
    for name in PARTS:
        if name not in args.only:
            continue
        log(f"gpu: part {name} ({args.size} size, {env.device}) ...")
        try:
            figures[name], part_rows = globals()[f"part_{name}"](env)
        except Exception as error:  # one broken part must not hide the others' figures
            failed.append(name)
            log(f"gpu: {name} FAILED:\n{traceback.format_exc()}")
            figures[name] = {"error": traceback.format_exc()}
            part_rows = Rows()
            part_rows.add(f"part {name}", f"FAILED: {type(error).__name__}: {error}"[:200], met=False)
        rows += part_rows


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    cuda = str(args.device).startswith("cuda")
    if not cuda:  # the eager flex path is the point of the CPU parity run, not a mistake to warn of
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    common.OTHERS = common.OthersCpu().start()
    out_dir, stamp, work = start_run(args.out, "work-gpu")
    env = Env(SIZES[args.size], args.device, cuda, "bf16" if cuda else "fp32", work, args.budgets, size_name=args.size)
    results = {"args": vars(args), "env": environment(), "size": args.size, "device": args.device}
    figures, rows, failed = {}, Rows(), []
    try:
        run_parts(args, env, figures, rows, failed)
        rows += skipped_rows(cuda)
    finally:
        results.update(figures=figures, rows=[asdict(r) for r in rows], failed=failed)
        results["skipped"] = [] if cuda else list(CUDA_ONLY)
        results["others_cpu_whole_run"] = common.OTHERS.stop()
        path = finish_run(results, out_dir, f"bench-gpu-{stamp}", work, args.keep)
        print()
        print(format_table(rows))
    print(
        f"\ntotal {results['wall_s']:.0f} s; other processes used {results['others_cpu_whole_run']} cores; written {path}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
