"""Section `length`: scoring cost against response length at SmolLM2 shapes (hidden 576, vocab
49152, 5 feature layers).

Synthetic shards (one sample per length 512..8192, bench/standins.py), a random one-layer
drafter, block 16, all-anchor chain replay (no DDTree, fp32) in this process after a warm-up,
once per CPU attention backend, side by side: "dense" (explicit masked scores over every
context key, the reference path: before) and "blockwise" (context keys in chunks with a
running softmax, what `--attention auto` runs on CPU: after); each length runs both, one after
the other. Per sample the product's two replay steps are called and timed apart: the context pass
(`scoring.replay.packing.pack_samples`) and the anchor chunks (`replay_anchors`); the checkpoint load and
shard decoding are outside. The time inside the drafter's attention, masks, other layer work and
the lm_head comes from the product's stage events. A sample with more than 4 x 512 anchors
replays 4 windows of 512 contiguous anchors centred at 1/8, 3/8, 5/8 and 7/8 of its anchors and
scales that time to all anchors (midpoint rule: an anchor's cost is affine in its context
length; the check against full replays is in bench/README.md). Fitted exponent b of time =
a T^b over all lengths and the longer half per backend, next to the exponent of the FLOP count;
target (issue 13): the blockwise backend's exponents within TARGET_RATIO x the FLOP count's.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import (
    Rows,
    StageClock,
    current_rss,
    drafter_shape,
    fit_exponent,
    fmt_mib,
    log,
    num,
    others_cpu,
    peak_rss,
    replay_flops,
    reset_peak,
)
from bench.standins import write_synthetic_shards

SMOLLM2 = dict(hidden_size=576, vocab_size=49152, num_layers=30)
PROMPT_TOKENS = 32
BLOCK_SIZE = 16
# Stage names the product marks inside an anchor chunk (pipeline/common/timing.py), reported as shares.
PARTS = ("attention", "masks", "drafter layers", "lm_head")
# Before and after: the reference's dense masks, and the CPU default (`ReplayOptions.attention_backend`).
BACKENDS = ("dense", "blockwise")
TARGET_RATIO = 1.15  # issue 13: time exponent <= 1.15 x the FLOP count's


def anchor_windows(count: int, windows: int, width: int) -> list[int]:
    """Rows of `windows` runs of `width` contiguous anchors centred at (i + 1/2) / windows of
    the `count` anchors (all rows when they cover them): per-anchor replay cost is affine in the
    anchor's context length, so the midpoint rule gives the all-anchor total from them."""
    if windows * width >= count:
        return list(range(count))
    rows = []
    for i in range(windows):
        start = min(count - width, max(0, int((i + 0.5) * count / windows) - width // 2))
        rows.extend(range(start, start + width))
    return rows


def sample_flops(cfg, vocab: int, length: int) -> dict:
    """The all-anchor replay work of one sample, by part (bench.common's FLOP model)."""
    total = PROMPT_TOKENS + length
    anchors = np.arange(PROMPT_TOKENS, total - 1, dtype=np.float64)
    blocks = np.minimum(cfg.block_size, total - anchors)
    return replay_flops(drafter_shape(cfg, vocab), total, anchors, blocks)


def replay_length(sample, length, proposer, head, columns, options, windows, width, vocab) -> dict:
    """One sample replayed in the product's two steps, each timed; the anchor step over
    `anchor_windows` when the sample has more anchors."""
    from pipeline.common import timing
    from scoring.replay.anchors import empty_anchor_tensors, replay_anchors
    from scoring.replay.packing import pack_samples

    clock = StageClock()
    reset_peak()
    before = current_rss()
    start = began = time.perf_counter()
    result = empty_anchor_tensors(sample, length, proposer, options)
    packed = pack_samples(proposer, [sample], columns, options, head)
    context_s = time.perf_counter() - start
    count = result.anchors.numel()
    rows = anchor_windows(count, windows, width)
    start = time.perf_counter()
    with timing.recording(clock):
        replay_anchors(proposer, head, packed, [result], [(0, r) for r in rows], options)
    replay_s = time.perf_counter() - start
    peak = peak_rss()
    scale = count / len(rows)
    seconds = context_s + replay_s * scale
    flops = sample_flops(proposer.config, vocab, length)
    parts = {"context pass": context_s}
    for name in PARTS:  # each stage's own time (nested stages subtracted), None when not marked
        own = clock.get(name, own=True)
        parts[name] = None if own is None else own * scale
    marked = [parts[name] for name in PARTS]
    parts["other per-anchor work (log_softmax, KL, gathers, writes)"] = (
        None if None in marked else replay_s * scale - sum(marked)
    )
    share = {k: None if v is None else v / seconds for k, v in parts.items()}
    entry = {
        "seconds": seconds,
        "context_s": context_s,
        "replay_s_measured": replay_s,
        "anchors": count,
        "anchors_replayed": len(rows),
        "estimated": len(rows) < count,
        "anchors_per_s": count / seconds,
        "ms_per_anchor": 1000 * seconds / count,
        "gflop": flops["total"] / 1e9,
        "gflop_s": flops["total"] / seconds / 1e9,
        "time_share": share,
        "stages": clock.figures(),
        "flop_share": {k: flops[k] / flops["total"] for k in ("lm_head", "drafter_layers", "attention", "context")},
        "peak_rss_bytes": peak,
        "rss_before_bytes": before,
        "rss_growth_bytes": None if peak is None or before is None else peak - before,
        "others_cpu": others_cpu(began, time.perf_counter()),
    }
    log(
        f"length:   {length:5d} tokens, {options.attention:9s}: {seconds:6.1f} s{' (est.)' if entry['estimated'] else ''}, "
        f"{entry['anchors_per_s']:5.0f} anchors/s, time: attention {pct(share['attention'])} + masks "
        f"{pct(share['masks'])}, lm_head {pct(share['lm_head'])}; attention "
        f"{100 * entry['flop_share']['attention']:.1f}% of FLOPs; peak RSS +{fmt_mib(entry['rss_growth_bytes'])}"
    )
    return entry


def pct(share) -> str:
    return num(None if share is None else 100 * share, ".0f", "%")


def dominant(side: dict, lengths: list[int], flop_exponent: float) -> str | None:
    """Where one backend's time goes at the shortest and the longest length."""
    first, last = side["per_length"][str(lengths[0])], side["per_length"][str(lengths[-1])]
    if any(e["time_share"][k] is None for e in (first, last) for k in ("lm_head", "attention", "masks")):
        return None
    att = lambda e: e["time_share"]["attention"] + e["time_share"]["masks"]  # noqa: E731
    return (
        f"At {lengths[0]} tokens the lm_head takes {100 * first['time_share']['lm_head']:.0f}% of the time "
        f"and attention (with its masks) {100 * att(first):.0f}%; at {lengths[-1]} tokens "
        f"{100 * last['time_share']['lm_head']:.0f}% and {100 * att(last):.0f}%, for "
        f"{100 * last['flop_share']['attention']:.0f}% of the FLOPs. The FLOP count grows as "
        f"T^{flop_exponent:.2f}, the time as T^{side['fit_all']['b']:.2f}."
    )


def fits(per_length: dict, lengths: list[int], key: str) -> dict:
    """Fitted exponents of per_length[...][key] over all lengths and the longer half."""
    values = [per_length[str(t)][key] for t in lengths]
    half = len(lengths) // 2
    return {"fit_all": fit_exponent(lengths, values), "fit_top_half": fit_exponent(lengths[half:], values[half:])}


def target_check(result: dict) -> dict:
    """The blockwise backend's time exponents against TARGET_RATIO x the FLOP count's, all
    lengths and the longer half."""
    side, flops = result["backends"]["blockwise"], result["flop_fits"]
    checks = {}
    for fit in ("fit_all", "fit_top_half"):
        limit = TARGET_RATIO * flops[fit]["b"]
        checks[fit] = {"b": side[fit]["b"], "limit": limit, "met": side[fit]["b"] <= limit}
    return {"ratio": TARGET_RATIO, **checks, "met": all(c["met"] for c in checks.values())}


def run(ctx) -> tuple[dict, Rows]:
    from pipeline.common.distributed import Dist, resolve_device
    from pipeline.common.dtypes import resolve_dtype
    from pipeline.common.layer_ids import build_target_layer_ids
    from pipeline.shards import ShardSet
    from proposers.checkpoints.load import load_proposer
    from proposers.detect import parse_drafter_config
    from proposers.dflash.model import DFlashDrafter
    from scoring.fit import new_drafter_config, save_drafter
    from scoring.replay.anchors import replay_sample
    from scoring.replay.packing import ReplayOptions, prepare_target_head, select_feature_columns

    quick = ctx.args.quick
    work = Path(ctx.work) / "length"
    work.mkdir(parents=True, exist_ok=True)
    lengths = [256, 512, 1024, 2048] if quick else [512, 1024, 2048, 4096, 8192]
    windows, width = (2, 512) if quick else (4, 512)
    warmup = 128
    hidden, vocab, num_layers = SMOLLM2["hidden_size"], SMOLLM2["vocab_size"], SMOLLM2["num_layers"]
    layer_ids = build_target_layer_ids(num_layers, 5)
    result: dict = {
        "lengths": lengths,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "layer_ids": layer_ids,
        "block_size": BLOCK_SIZE,
        "drafter_layers": 1,
        "ddtree_budgets": [],
        "anchor_set": "all",
        "prompt_tokens": PROMPT_TOKENS,
        "threads": torch.get_num_threads(),
        "anchor_windows": {
            "windows": windows,
            "width": width,
            "rule": "samples with more anchors than windows x width replay those "
            "windows (midpoint rule) and scale the replay time to all anchors",
        },
        "backends": {name: {"per_length": {}} for name in BACKENDS},
    }
    try:
        log(f"length: synthetic shards at SmolLM2 shapes, one sample per length {lengths} ...")
        shard_dir = work / "shards"
        write_synthetic_shards(shard_dir, [warmup] + lengths, hidden, vocab, num_layers, layer_ids, PROMPT_TOKENS)
        shardset = ShardSet(str(shard_dir))
        raw = new_drafter_config(shardset.settings["target"], num_layers=1, block_size=BLOCK_SIZE, layer_ids=layer_ids)
        torch.manual_seed(0)
        ckpt = save_drafter(DFlashDrafter(parse_drafter_config(raw, "bench drafter")), str(work / "drafter"))
        device = resolve_device(None, Dist())  # what `specreplay score --device auto --dtype auto` picks
        dtype = resolve_dtype("auto", device)
        proposer, info = load_proposer(ckpt, dtype=dtype, device=device)
        head = prepare_target_head(shardset.target_head(), device, dtype)
        options = {  # chain only
            name: ReplayOptions(methods={}, dtype=dtype, device=device, attention=name) for name in BACKENDS
        }
        budget = options["dense"].memory_bytes
        result.update(device=device, dtype=str(dtype).removeprefix("torch."), memory_budget=budget)
        columns = lambda f: select_feature_columns(f, layer_ids, info.config.target_layer_ids)  # noqa: E731
        samples = {s.response_len: s for s in shardset.samples(prefetch=0)}
        log(f"length: all-anchor chain replay, {result['dtype']}, block {BLOCK_SIZE}, 1-layer drafter, {BACKENDS} ...")
        for name in BACKENDS:  # warm-up
            replay_sample(proposer, head, samples[warmup], columns, warmup, options[name])
        for length in lengths:  # both backends at each length, so that drift in load hits both
            for name in BACKENDS:
                result["backends"][name]["per_length"][str(length)] = replay_length(
                    samples[length], length, proposer, head, columns, options[name], windows, width, vocab
                )
        result["flop_fits"] = fits(result["backends"]["dense"]["per_length"], lengths, "gflop")
        result["flop_exponent"] = result["flop_fits"]["fit_all"]["b"]
        for side in result["backends"].values():
            side.update(fits(side["per_length"], lengths, "seconds"))
            side["dominant"] = dominant(side, lengths, result["flop_exponent"])
        result["target"] = target_check(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result, rows(result)


def rows(ls: dict) -> Rows:
    out = Rows()
    out.add(
        f"scoring cost vs response length (SmolLM2 shapes, {ls.get('dtype')}, all anchors, chain, block "
        f"{ls['block_size']}, 1-layer drafter), per CPU attention backend"
    )
    for name, when in zip(BACKENDS, ("before", "after")):
        side = ls["backends"][name]
        out.add(f'  attention "{name}" ({when})')
        for length, p in side["per_length"].items():
            out.add(f"    {int(length):5d} tokens", length_value(p), others=p.get("others_cpu"))
        fa, ft = side.get("fit_all"), side.get("fit_top_half")
        if fa:
            out.add(
                "    fitted exponent b (time = a T^b), all lengths / longer half",
                f"{fa['b']:.2f} / {ft['b']:.2f}" if ft else f"{fa['b']:.2f}",
            )
    flops = ls.get("flop_fits")
    if flops:
        out.add(
            "  exponent of the FLOP count, all lengths / longer half (for comparison)",
            f"{flops['fit_all']['b']:.2f} / {flops['fit_top_half']['b']:.2f}",
        )
        out.add("  speed-up blockwise over dense, per length", speedups(ls))
    check = ls.get("target")
    if check:
        blockwise = ls["backends"]["blockwise"]["per_length"].values()
        out.add(
            f"  blockwise: time exponent <= {check['ratio']} x FLOP exponent, all lengths / longer half",
            f"{check['fit_all']['b']:.2f} / {check['fit_top_half']['b']:.2f}",
            f"<= {check['fit_all']['limit']:.2f} / {check['fit_top_half']['limit']:.2f}",
            met=check["met"],
            sides=[p.get("others_cpu") for p in blockwise],
        )
    return out


def length_value(p: dict) -> str:
    share = p["time_share"]
    how = f"est. from {p['anchors_replayed']} of {p['anchors']} anchors" if p["estimated"] else "all anchors"
    return (
        f"{p['seconds']:.1f} s ({how}), {p['anchors_per_s']:.0f} anchors/s, "
        f"{p['ms_per_anchor']:.1f} ms/anchor; time in attention {pct(share['attention'])}, "
        f"lm_head {pct(share['lm_head'])}; attention {100 * p['flop_share']['attention']:.1f}% of "
        f"FLOPs; peak RSS +{fmt_mib(p['rss_growth_bytes'])}"
    )


def speedups(ls: dict) -> str:
    dense, blockwise = (ls["backends"][name]["per_length"] for name in BACKENDS)
    return ", ".join(f"{t}: {dense[t]['seconds'] / blockwise[t]['seconds']:.1f}x" for t in blockwise)
