"""Section `gemm`: the score pass's useful FLOP/s as a fraction of this machine's matmul peak at
the replay's own GEMM shapes, measured in the same run (issue 13, item 5; target >= 60%).

The scorer (`scoring.score.steps.run_score`, all anchors, chain only, the fp32 score shards, the score
section's drafter when that section ran, else a random one of the same shape: all-anchor work
does not depend on the weights) runs twice after a warm-up; its stage events
(`pipeline.common.timing`) give the shape of every GEMM it ran: the anchors of each chunk ("drafter
layers"), the lm_head rows ("lm_head"), the context positions ("context keys/values").
The peak is `F.linear` (the call nn.Linear and the lm_head make) at those shapes, contiguous
inputs, same thread count, best of several reps after a warm-up, measured after each score run
(best per GEMM over the passes, so both sides meet a shared machine's moods alike): per weight
(fc, the layer's q/k/v/o and MLP projections, the lm_head) at the FLOP-weighted median row
count of the run, and combined as total FLOPs / sum(FLOPs / rate), the rate the run's GEMMs
would have at peak.
Useful FLOPs are bench.common's model (`replay_flops`, attention included) over the anchors the
run wrote; wall is the whole call, as the score section's "useful GFLOP/s". The stage events
also split that wall into parts, each with its FLOPs and in-place rate; below the target a
torch.profiler table follows (the score section's `profile_offline`).

`StageCalls`, `replay_gemms` and `measure_peak` are shared with `bench/gpu.py` (bf16, CUDA).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from bench.common import Phase, Rows, StageClock, drafter_shape, log, num, replay_flops

TARGET = 0.60  # issue 13 item 5: useful FLOP/s >= 60% of the matmul peak at the replay's shapes
LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONTEXT_LINEARS = ("k_proj", "v_proj")  # per layer, over the context positions (context_kv)


class StageCalls(StageClock):
    """StageClock that also keeps every call: (name, info, seconds), in order. The product's
    infos carry the shapes: "drafter layers" anchors=A, then "lm_head" rows=A x (b - 1).

    A stage reported with `timing.elapsed` (work another thread did, e.g. DDTree's worker) shows
    as a start and stop with more seconds between them than passed: it is kept apart (`parallel`)
    and not subtracted from the stage it was reported in, whose own time it did not take."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple[str, dict, float]] = []
        self.parallel: set[str] = set()
        self._began: list[float] = []

    def start(self, name: str, info: dict) -> None:
        super().start(name, info)
        self._began.append(time.perf_counter())

    def stop(self, name: str, info: dict, seconds: float) -> None:
        passed = time.perf_counter() - self._began.pop()  # >= seconds for a stage that ran here
        super().stop(name, info, seconds)
        if seconds > passed + 1e-3:  # reported by timing.elapsed: another thread's time
            self.parallel.add(name)
            if self._nested:
                self._nested[-1] -= seconds  # the enclosing stage's own time was not spent on it
        self.log.append((name, dict(info), seconds))


def drafter_calls(calls: list[tuple[str, dict, float]]) -> list[tuple[int, int]]:
    """(anchors, block length) of every drafter call the replay made."""
    return [(int(info["anchors"]), int(info["block"])) for name, info, _ in calls if name == "drafter layers"]


def head_calls(calls: list[tuple[str, dict, float]]) -> list[dict]:
    """Per lm_head GEMM: its rows, seconds and the block lengths of the drafter calls it served
    (one for a full chunk; several when a sample's tail chunks share one GEMM, see
    replay.SMALL_CHUNK_ROWS)."""
    out, blocks = [], []
    for name, info, seconds in calls:
        if name == "drafter layers":
            blocks.append(int(info["block"]))
        elif name == "lm_head" and blocks:
            out.append({"rows": int(info["rows"]), "seconds": seconds, "blocks": blocks})
            blocks = []
    return out


def weighted_median(values, weights) -> int:
    """The value below and above which half the weight lies (the typical row count by FLOPs)."""
    order = np.argsort(values)
    cum = np.cumsum(np.asarray(weights, dtype=np.float64)[order])
    return int(np.asarray(values)[order][np.searchsorted(cum, cum[-1] / 2)])


def drafter_linears(ckpt: str) -> tuple[object, dict[str, tuple[int, int]]]:
    """(config, {name: (in, out)}) of the drafter's fc and first layer's projections, from a
    skeleton on the meta device (no weights read)."""
    from proposers.checkpoints.load import read_drafter_config
    from proposers.dflash.model import DFlashDrafter

    config = read_drafter_config(ckpt)
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    layer = drafter.layers[0]
    modules = {"fc": drafter.fc}
    for name in LAYER_LINEARS:  # q/k/v/o live in self_attn, gate/up/down in mlp
        modules[name] = getattr(layer.self_attn if hasattr(layer.self_attn, name) else layer.mlp, name)
    return config, {name: (m.in_features, m.out_features) for name, m in modules.items()}


def replay_gemms(ckpt: str, lm_head_shape: tuple[int, int], calls) -> list[dict]:
    """The GEMMs a replay ran, one entry per weight: {name, rows (FLOP-weighted median), K, N,
    flops (the run's total through that weight)}. lm_head_shape is the target's [V, H]."""
    config, linears = drafter_linears(ckpt)
    layers = config.num_hidden_layers
    layer_rows = [anchors * block for anchors, block in drafter_calls(calls)]
    head_rows = [c["rows"] for c in head_calls(calls)]
    ctx_rows = [int(info["tokens"]) for name, info, _ in calls if name == "context keys/values"]
    vocab, hidden = lm_head_shape
    out = []
    for name, (k, n) in linears.items():
        rows = ctx_rows if name == "fc" else layer_rows
        per = 1 if name == "fc" else layers
        out.append(gemm(name, rows, k, n, per))
        if name in CONTEXT_LINEARS:
            out.append(gemm(f"{name} (context)", ctx_rows, k, n, layers))
    out.append(gemm("lm_head", head_rows, hidden, vocab, 1))
    return [g for g in out if g["flops"] > 0]


def gemm(name: str, rows: list[int], k: int, n: int, per_call: int) -> dict:
    flops = [2.0 * r * k * n * per_call for r in rows]
    typical = weighted_median(rows, flops) if rows else 0
    return {"name": name, "rows": typical, "K": k, "N": n, "flops": float(sum(flops)), "calls": len(rows) * per_call}


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def time_linear(rows: int, k: int, n: int, dtype, device: str, min_s: float = 0.5, max_reps: int = 20) -> dict:
    """F.linear([rows, k], [n, k]) best of >= 3 reps (more while under min_s in all, up to
    max_reps) after one warm-up call: {seconds, gflop_s, reps}. A rep is `inner` calls between
    two synchronisations, enough for ~10 ms, so a GPU's launch and sync latency (~10 us) does
    not count against a GEMM of ~0.1 ms; on CPU one call is already milliseconds."""
    x = torch.randn(rows, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) * k**-0.5
    inner = max(1, min(100, int(0.01 / max(calls(x, w, 1, device), 1e-6))))
    best, spent, reps = float("inf"), 0.0, 0
    while reps < 3 or (spent < min_s and reps < max_reps):
        seconds = calls(x, w, inner, device)
        best, spent, reps = min(best, seconds / inner), spent + seconds, reps + 1
    return {"seconds": best, "gflop_s": 2.0 * rows * k * n / best / 1e9, "reps": reps, "inner": inner}


def calls(x, w, count: int, device: str) -> float:
    """Seconds of `count` back-to-back F.linear calls, the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    for _ in range(count):
        torch.nn.functional.linear(x, w)
    sync(device)
    return time.perf_counter() - start


def measure_peak(gemms: list[dict], dtype, device: str, earlier: dict | None = None) -> dict:
    """Each GEMM's rate at its typical rows (the best of this pass and an `earlier` one at the
    same shapes), and the FLOP-weighted peak: the run's total FLOPs over the time they would
    take at those rates."""
    before = {g["name"]: g for g in earlier["gemms"]} if earlier else {}
    per = []
    for g in gemms:
        timed = time_linear(g["rows"], g["K"], g["N"], dtype, device)
        log(f"gemm:   {g['name']:18s} [{g['rows']} x {g['K']}] x [{g['K']} x {g['N']}]: {timed['gflop_s']:.1f} GFLOP/s")
        old = before.get(g["name"])
        per.append({**g, **(old if old and old["gflop_s"] > timed["gflop_s"] else timed)})
    total = sum(g["flops"] for g in per)
    at_peak = sum(g["flops"] / (g["gflop_s"] * 1e9) for g in per)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "gemms": per,
        "flops": total,
        "seconds_at_peak": at_peak,
        "peak_gflop_s": total / at_peak / 1e9,
        "passes": 1 + (earlier or {}).get("passes", 0),
    }


# ---------------------------------------------------------------------------------------------
# the score pass and where its time goes


def useful_flops(model: dict, shard_dir: str, results_dir: Path) -> dict:
    """bench.common's replay FLOPs, by part, over the anchors a run wrote (anchors.parquet)."""
    import polars as pl

    from pipeline.shards import ShardSet

    anchors = pl.read_parquet(str(results_dir / "anchors.parquet"), glob=False)
    parts: dict[str, float] = {}
    for sample in ShardSet(shard_dir).samples(tensors=[], prefetch=0):
        mine = anchors.filter(pl.col("sample_id") == sample.sample_id)
        counted = replay_flops(
            model, sample.input_ids.numel() - 2, mine["anchor"].to_numpy(), mine["block_len"].to_numpy()
        )
        for key, value in counted.items():
            parts[key] = parts.get(key, 0.0) + value
    return parts


def timed_score(ckpt: str, shard_dir: str, out: Path, **config) -> dict:
    """One `run_score` with its stage calls recorded: wall, others' CPU, anchors, calls."""
    from pipeline.common import timing
    from scoring.config import ScoreConfig
    from scoring.score.run import run_score

    calls = StageCalls()
    with Phase() as phase, timing.recording(calls):
        [outcome] = run_score(ScoreConfig(ckpts=[ckpt], shards=shard_dir, out=str(out), force=True, **config))
    return {
        "wall_s": phase.seconds,
        "others_cpu": phase.others_cpu,
        "anchors": outcome.record["anchors"],
        "out_dir": outcome.out_dir,
        "stages": calls.figures(),
        "parallel": sorted(calls.parallel),
        "calls": calls.log,
    }


PARTS = (  # part of the wall: (the product stages whose own time it is, FLOP part, peak GEMMs)
    ("lm_head GEMM", ("lm_head",), "lm_head", ("lm_head",)),
    ("drafter layers (GEMMs, norms, RoPE)", ("drafter layers",), "drafter_layers", LAYER_LINEARS),
    ("attention", ("attention",), "attention", ()),
    ("attention masks", ("masks",), None, ()),
    (
        "context keys/values (fc, k/v)",
        ("context keys/values",),
        "context",
        ("fc", "k_proj (context)", "v_proj (context)"),
    ),
    ("logsumexp over the vocabulary", ("logsumexp",), None, ()),
    ("rest of each chunk (argmax, KL, gathers, writes, DDTree wait)", ("replay anchors", "ddtree wait"), None, ()),
    ("load drafter, target head", ("load drafter", "read target head", "prepare target head"), None, ()),
)


def breakdown(run: dict, flops: dict, peak: dict) -> dict:
    """The wall of a run split into the product's stages (own time), each with its FLOPs, its
    rate in place and the seconds it would take at the peak rate of its GEMMs. Stages not named
    in PARTS get a part of their own; the wall no stage covers is one part; stages another
    thread reported (DDTree's worker) are not parts of the wall."""
    own = dict(run["stages"]["own_seconds"])
    for name in run.get("parallel", ()):
        own.pop(name, None)
    rates = {g["name"]: g for g in peak["gemms"]}
    parts = {}
    for label, stages, flop_part, gemm_names in PARTS:
        seconds = sum(own.pop(n, 0.0) for n in stages)
        work = flops.get(flop_part, 0.0) if flop_part else 0.0
        parts[label] = part(
            seconds, work, part_ideal(work, [rates[n] for n in gemm_names if n in rates]), run["wall_s"]
        )
    for name, seconds in own.items():
        parts[f"stage '{name}'"] = part(seconds, 0.0, None, run["wall_s"])
    rest = run["wall_s"] - sum(p["seconds"] for p in parts.values())
    parts["outside every stage (shard decoding, metrics, parquet)"] = part(rest, 0.0, None, run["wall_s"])
    return parts


def part_ideal(work: float, gemms: list[dict]) -> float | None:
    """Seconds `work` FLOPs take at the FLOP-weighted rate of these GEMMs (None: no GEMM peak)."""
    if not gemms or not work:
        return None
    total = sum(g["flops"] for g in gemms)
    return work * sum(g["flops"] / (g["gflop_s"] * 1e9) for g in gemms) / total


def part(seconds: float, work: float, ideal: float | None, wall: float) -> dict:
    return {
        "seconds": seconds,
        "share_of_wall": seconds / wall,
        "gflop": work / 1e9,
        "gflop_s": work / seconds / 1e9 if seconds > 0 and work else None,
        "seconds_at_peak": ideal,
        "of_peak": ideal / seconds if ideal and seconds > 0 else None,
    }


def lm_head_split(calls, block_size: int, peak: dict) -> dict:
    """lm_head time and rate for full-block chunks vs the tail chunks (truncated blocks at the
    end of every response, one chunk per block length, few rows each, sharing GEMMs)."""
    rate = next(g for g in peak["gemms"] if g["name"] == "lm_head")
    flop_per_row = 2.0 * rate["K"] * rate["N"]
    out = {}
    for label, tail in (("full blocks", False), ("tail blocks", True)):
        mine = [c for c in head_calls(calls) if (max(c["blocks"]) < block_size) == tail]
        rows = sum(c["rows"] for c in mine)
        seconds = sum(c["seconds"] for c in mine)
        out[label] = {
            "gemms": len(mine),
            "chunks": sum(len(c["blocks"]) for c in mine),
            "rows": rows,
            "median_rows": int(np.median([c["rows"] for c in mine])) if mine else 0,
            "seconds": seconds,
            "gflop_s": rows * flop_per_row / seconds / 1e9 if seconds else None,
            "seconds_at_peak": rows * flop_per_row / (rate["gflop_s"] * 1e9),
        }
    return out


# ---------------------------------------------------------------------------------------------
# the section


def inputs(ctx) -> tuple[str, str, str]:
    """(fp32 shards, drafter checkpoint, where it came from): the score section's, or the fp32
    shards (extracted now when needed) and a random drafter shaped like the score section's."""
    from bench.sections import fp32

    shard_dir = fp32.shards(ctx)
    fitted = ctx.figures.get("score", {}).get("checkpoint")
    if fitted and Path(fitted).exists():
        return shard_dir, fitted, "the score section's fitted drafter"
    return shard_dir, random_drafter(shard_dir, ctx.args.block_size, Path(ctx.work) / "gemm-drafter"), "random"


def random_drafter(shard_dir: str, block_size: int, out: Path) -> str:
    from pipeline.shards import ShardSet
    from proposers.detect import parse_drafter_config
    from proposers.dflash.model import DFlashDrafter
    from scoring.fit import new_drafter_config, save_drafter

    settings = ShardSet(shard_dir).settings
    raw = new_drafter_config(
        settings["target"], num_layers=1, block_size=block_size, layer_ids=list(settings["layer_ids"])
    )
    torch.manual_seed(0)
    return save_drafter(DFlashDrafter(parse_drafter_config(raw, "bench drafter")), str(out))


def alternated(ckpt: str, shard_dir: str, work: Path, lm_head_shape, reps: int = 2) -> tuple[dict, dict, list]:
    """Chain-only all-anchor runs after a one-sample warm-up, each followed by a pass of the
    peak at the shapes it ran (best per GEMM over the passes): on a shared machine both sides
    then meet its busy and quiet moments alike. (fastest run, peak, others' CPU per pass)."""
    log("gemm: warm-up score (1 sample) ...")
    timed_score(ckpt, shard_dir, work / "gemm-warmup", tree_nodes=[], limit=1)
    runs, peak, others = [], None, []
    for rep in range(reps):
        log(f"gemm: score, all anchors, chain only, run {rep + 1}/{reps} ...")
        runs.append(timed_score(ckpt, shard_dir, work / f"gemm-chain-{rep}", tree_nodes=[]))
        log(f"gemm:   {runs[-1]['wall_s']:.1f} s, {runs[-1]['anchors']} anchors (others: {runs[-1]['others_cpu']})")
        log(f"gemm: fp32 F.linear at the replay's shapes, {torch.get_num_threads()} threads, pass {rep + 1}/{reps} ...")
        with Phase() as phase:
            peak = measure_peak(replay_gemms(ckpt, lm_head_shape, runs[-1]["calls"]), torch.float32, "cpu", peak)
        others.append(phase.others_cpu)
    best = min(runs, key=lambda r: r["wall_s"])
    best["runs_s"] = [r["wall_s"] for r in runs]
    return best, peak, others


def run(ctx) -> tuple[dict, Rows]:
    from pipeline.shards import ShardSet

    work = Path(ctx.work)
    shard_dir, ckpt, source = inputs(ctx)
    lm_head_shape = tuple(ShardSet(shard_dir).target_head()["lm_head"].shape)
    best, peak, peak_others = alternated(ckpt, shard_dir, work, lm_head_shape)
    config, _ = drafter_linears(ckpt)
    flops = useful_flops(drafter_shape(config, *lm_head_shape), shard_dir, Path(best["out_dir"]))
    useful = flops["total"] / best["wall_s"]
    result = {
        "drafter": source,
        "threads": torch.get_num_threads(),
        "peak": peak,
        "peak_others_cpu": max((o for o in peak_others if o is not None), default=None),
        "score": {k: v for k, v in best.items() if k != "calls"},
        "useful_flops": flops,
        "useful_gflop_s": useful / 1e9,
        "efficiency": useful / (peak["peak_gflop_s"] * 1e9),
        "target": TARGET,
        "breakdown": breakdown(best, flops, peak),
        "lm_head_split": lm_head_split(best["calls"], config.block_size, peak),
        "score_section_gflop_s": ctx.figures.get("score", {}).get("offline_chain", {}).get("gflop_s"),
    }
    result["met"] = result["efficiency"] >= TARGET
    if not result["met"] or ctx.args.profile:
        from bench.sections.score import profile_offline

        log("gemm: torch.profiler over a chain-only score of 2 samples ...")
        result["profile"] = profile_offline(work, shard_dir, ckpt)
        # printed here: bench/__main__.py prints only the score section's profile after the table
        log("gemm: aten ops by own CPU time (chain-only score, 2 samples):\n" + "\n".join(result["profile"]))
    return result, rows(result)


def rows(g: dict) -> Rows:
    out = Rows()
    peak, score = g["peak"], g["score"]
    out.add(
        f"gemm: fp32 F.linear at the replay's shapes ({peak['threads']} threads, best of >= 3 after warm-up, "
        f"{peak['passes']} passes)"
    )
    for x in peak["gemms"]:
        out.add(
            f"  {x['name']} [{x['rows']} x {x['K']}] x [{x['K']} x {x['N']}]",
            f"{x['gflop_s']:.1f} GFLOP/s ({100 * x['flops'] / peak['flops']:.1f}% of the run's GEMM FLOPs)",
            others=g["peak_others_cpu"],
        )
    out.add("  FLOP-weighted peak", f"{peak['peak_gflop_s']:.1f} GFLOP/s")
    out.add(
        f"  score, all anchors, chain only ({g['drafter']} drafter; min of {len(score['runs_s'])})",
        f"{g['useful_flops']['total'] / 1e9:.0f} GFLOP in {score['wall_s']:.1f} s = {g['useful_gflop_s']:.1f} GFLOP/s",
        others=score["others_cpu"],
    )
    if g.get("score_section_gflop_s") is not None:
        out.add("  (score section's offline chain, same FLOP model)", f"{g['score_section_gflop_s']:.1f} GFLOP/s")
    out.add(
        "  GEMM efficiency: useful FLOP/s / peak",
        f"{100 * g['efficiency']:.0f}%",
        f">= {100 * g['target']:.0f}%",
        g["met"],
        sides=[score["others_cpu"], g["peak_others_cpu"]],
    )
    out.extend(breakdown_rows(g))
    return out


def breakdown_rows(g: dict) -> Rows:
    out = Rows()
    out.add("  where the wall goes (product stages, own time): share, GFLOP/s in place, of its GEMM peak")
    for label, p in g["breakdown"].items():
        out.add(
            f"    {label}",
            f"{p['seconds']:.2f} s = {100 * p['share_of_wall']:.0f}%, {num(p['gflop_s'], '.1f')} GFLOP/s, "
            f"{num(None if p['of_peak'] is None else 100 * p['of_peak'], '.0f', '%')} of peak",
        )
    for label, s in g["lm_head_split"].items():
        out.add(
            f"    lm_head, {label}",
            f"{s['chunks']} chunks in {s['gemms']} GEMMs, {s['rows']} rows (median {s['median_rows']}), {s['seconds']:.2f} s, "
            f"{num(s['gflop_s'], '.1f')} GFLOP/s; {s['seconds_at_peak']:.2f} s at peak",
        )
    return out
