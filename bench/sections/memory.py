"""Section `memory`: peak RSS at a 27B model's shapes, per phase, extract then score.

A stand-in target with a 27B model's widths (Qwen3.5/3.6-27B: hidden 5120, vocab 248320, 24 q /
4 kv heads of 256, MLP 17408, untied) with only as many decoder layers as there are
feature layers (5; random bf16 weights written straight to safetensors, 7.9 GiB), and a drafter
shaped like z-lab's Qwen3.5-27B DFlash (hidden 5120, 32 / 8 heads of 128, MLP 17408, block 16,
mask token 248070) with one layer instead of five. `specreplay extract` (bf16, teacher-forced
responses of 8192 and 2048 tokens, default memory budget) runs in one fresh process, then the
scorer (the CPU default, fp32; no DDTree) in another. Each child reports its own peak RSS
(VmHWM, reset per phase) for every phase; the parent also polls it and kills a child before the
machine runs out of memory. The longer sample goes first, and the children run with a fixed
glibc mmap threshold (CHILD_MALLOC_ENV), so the shorter sample's phases are not hidden by memory
the longer one freed.

Extract's phases are the product's own stages (`pipeline.common.timing`, recorded by
bench.common.PhaseMemory): load, target head, and per sample the forward (+ features), the
lm_head windows (top-k) and the shard write. Scoring all anchors at vocab 248320 costs 2 x 15 x
5120 x 248320 FLOP per anchor in the lm_head alone (hundreds of TFLOP for 8192 anchors, far
beyond a bench run on CPU), so the score child calls the scorer's own steps (target head,
`prepare_job`: checkpoint and drafter, shard decoding, the context pass over all positions,
`replay_anchors`) and replays only each sample's LAST anchors: one full anchor chunk (as the
memory budget sizes it) + 1, the longest contexts, the worst case for the attention working set.

Extract's forward is also measured alone, before and after, in two more fresh processes that
load the same target, map all its weights (as extract's target-head and fingerprint phases map
most of them) and run only `capture_features` on the same two sequences, longest first: with
`CaptureConfig(windowed=False)` (before: one pass over all positions) and as the product runs it
(after: the layers over windows of positions, pipeline.extract.chunked_forward). No shard writer runs
there: in the extract child the writer still holds the longer sample's compressed bytes while
the shorter one is captured, which raises the shorter sample's peak and understates the growth.

Verdicts: the working set of every phase whose size the budget sets stays within its share; the
phases that are not budgeted (extract's forward, score's context pass, both with the sample's
stored tensors resident) grow from the shorter to the longer sample by at most 1.5 x the stored
tensors' growth + 256 MiB ("memory flat in T apart from the stored tensors"); extract's forward
phase peak grows by at most 1.2 x the stored tensors' growth (issue 13). --quick: "mid" shapes
(hidden 2048, vocab 65536), 4096 and 1024 tokens: checks the method, not the 27B claim.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import GiB, MiB, PhaseMemory, Rows, fmt_mib, log, quiet_transformers, watch_child
from bench.standins import build_drafter, build_target

SHAPES = {
    "27b": {
        "target": dict(
            hidden_size=5120,
            vocab_size=248320,
            intermediate_size=17408,
            num_hidden_layers=5,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
        ),
        "drafter": dict(
            num_layers=1,
            block_size=16,
            num_heads=32,
            kv_heads=8,
            head_dim=128,
            intermediate_size=17408,
            mask_token_id=248070,
        ),
        "lengths": [8192, 2048],
    },
    "mid": {
        "target": dict(
            hidden_size=2048,
            vocab_size=65536,
            intermediate_size=6144,
            num_hidden_layers=5,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
        ),
        "drafter": dict(
            num_layers=1,
            block_size=16,
            num_heads=16,
            kv_heads=4,
            head_dim=128,
            intermediate_size=6144,
            mask_token_id=65000,
        ),
        "lengths": [4096, 1024],
    },
}
LAYER_IDS = [0, 1, 2, 3, 4]
PROMPT_TOKENS = 16
TOP_K = 32
FLAT_FACTOR = 1.5  # RSS growth allowed per byte of stored-tensor growth
FLAT_SLACK = 256 * MiB  # plus this constant
FORWARD_FACTOR = 1.2  # extract's forward phase: peak growth per byte of stored-tensor growth, no slack
PEAK_LIMIT = 16 * GiB  # a child above this is a memory problem (the machine has 23-24 GiB)
# glibc's default mmap threshold rises to 32 MiB after large frees, so blocks freed by the longer
# sample's phases would stay in the heap and be reused by the shorter one, hiding its own working
# set; a fixed threshold returns every block over 128 KiB to the kernel when freed.
CHILD_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
DISK_NEEDED = {"27b": 16 * GiB, "mid": 3 * GiB}  # stand-in weights, target head, shards
# Per child: a bf16 27B-width forward of 8192 tokens takes hours on a CPU without native bf16.
CHILD_TIMEOUT_S = {"27b": 12 * 3600, "mid": 3600}
FORWARD_SIDES = {"before (one pass)": False, "after (windows)": True}  # CaptureConfig.windowed
PARTS = {"extract": None, "score": None, "forward-before": "before (one pass)", "forward-after": "after (windows)"}


def chosen_parts(names: list[str] | None) -> set[str]:
    """The children to run (bench --memory-parts; default all); score reads extract's shards."""
    parts = set(names or PARTS)
    unknown = parts - set(PARTS)
    if unknown:
        raise SystemExit(f"bench: --memory-parts: unknown {sorted(unknown)}; choose from {', '.join(PARTS)}")
    return parts | ({"extract"} if "score" in parts else set())


def tag(tokens: int) -> str:
    return f"T={tokens}"


# ---------------------------------------------------------------------------------------------
# child processes (fresh interpreter, own peak RSS): python -m bench.sections.memory --child ...


class ChildFailed(RuntimeError):
    """A measured child process failed or was killed (its output tail is in the message)."""


def run_child(kind: str, payload: dict, work: Path, timeout_s: float) -> dict:
    result_path = work / f"child-{kind}.json"
    err_path = result_path.with_suffix(".err")
    cmd = [sys.executable, "-m", "bench.sections.memory", "--child", kind, json.dumps(payload), str(result_path)]
    env = {**os.environ, **CHILD_MALLOC_ENV, "TOKENIZERS_PARALLELISM": "false"}
    with open(err_path, "w") as err:
        watched = watch_child(cmd, b"--child", err, env=env, timeout_s=timeout_s, poll_s=0.05)
    if watched["returncode"] != 0 or not result_path.exists():
        tail = err_path.read_text()[-3000:] if err_path.exists() else ""
        killed = watched["killed"]
        raise ChildFailed(
            f"bench child {kind} failed{' (' + killed + ')' if killed else ''}, rc {watched['returncode']}:\n{tail}"
        )
    result = json.loads(result_path.read_text())
    result["parent_polled_peak_rss_bytes"] = watched["peak_rss_bytes"]
    result["wall_s_incl_startup"] = watched["wall_s_incl_startup"]
    return result


def extract_phases(lengths: list[int]):
    """Phase names of extract's stages; per-sample ones tagged with the sample's length (samples
    are captured in prompt order, which is `lengths`' order)."""
    sample = [-1]

    def label(name: str, info: dict) -> str | None:
        if name == "capture":
            sample[0] += 1
        t = tag(lengths[sample[0]]) if 0 <= sample[0] < len(lengths) else "before the first sample"
        return {
            "load target": "load target",
            "weights fingerprint": "weights fingerprint",
            "store target head": "store target head",
            "generate": "generate",
            "capture": f"forward + features, {t}",
            "next-token distribution": f"lm_head + top-k, {t}",
            "shard write": f"write shards, {t}",
            "shard finish": "write shards, finish",
            "shard close": "write shards, close",
        }.get(name)

    return label


def child_extract(payload: dict) -> dict:
    """`run_extract` exactly as `specreplay extract` runs it, its stages recorded with their peaks."""
    from pipeline.common import timing
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.run import run_extract

    config = ExtractConfig(
        model=payload["model"],
        prompts=payload["prompts"],
        out=payload["out"],
        dtype="bf16",
        layer_ids=payload["layer_ids"],
        top_k=payload["top_k"],
        quiet=True,
        overwrite=True,
        device="cpu",
    )
    memory = PhaseMemory(extract_phases(payload["lengths"]))
    start = time.perf_counter()
    with timing.recording(memory):
        manifest = run_extract(config)
    wall = time.perf_counter() - start
    return {
        **memory.finish(),
        "run_s": wall,
        "memory_budget": config.memory_bytes,
        "totals": manifest["totals"],
        "target_head_bytes": manifest["target_head"]["bytes"],
        "shard_bytes_by_sample": shard_bytes_by_sample(manifest),
    }


def map_weights(model) -> None:
    """Touch every page of every parameter, so the weights are resident before any phase (a
    lazily mapped safetensors file would otherwise fault them in during the first forward)."""
    for param in model.parameters():
        flat = param.detach().reshape(-1)
        flat[:: max(1, 4096 // flat.element_size())].sum()


def child_forward(payload: dict) -> dict:
    """Extract's forward (+ features) alone: the target loaded as extract loads it, its weights
    mapped, then `capture_features` per sequence, longest first, windowed or in one pass."""
    from pipeline.extract.capture import CaptureConfig, capture_features
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.target import load_target

    budget = ExtractConfig(model="", prompts="", out="").memory_bytes
    records = [json.loads(line) for line in Path(payload["prompts"]).read_text().splitlines()]
    memory = PhaseMemory()
    with memory.phase("load target"):
        model = load_target(payload["model"], dtype="bf16", device="cpu")[0]
        map_weights(model)
    config = CaptureConfig(
        layer_ids=payload["layer_ids"],
        feature_dtype=torch.bfloat16,
        head_budget_bytes=budget // 2,  # extract's lm_head share (split_memory_budget)
        windowed=payload["windowed"],
    )
    start = time.perf_counter()
    for record, length in zip(records, payload["lengths"]):
        with memory.phase(f"forward + features, {tag(length)}"):
            stored = capture_features(model, record["input_ids"] + record["response"], config)
        del stored  # as extract does: the next sample must not keep this one alive
    return {**memory.finish(), "run_s": time.perf_counter() - start}


def shard_bytes_by_sample(manifest: dict) -> dict:
    """Compressed bytes of each record batch, by the sample it holds (one sample per batch here)."""
    out = {}
    for entry in manifest["shards"]:
        ids = list(entry["sample_ids"])
        for batch in entry["batches"]:
            rows = batch[2]
            names, ids = ids[:rows], ids[rows:]
            out[",".join(names)] = batch[1]
    return out


def child_score(payload: dict) -> dict:
    """The scorer's own steps in `run_score`'s order (target head read and cast once, the job:
    checkpoint checked and loaded, samples decoded in the background, per sample the context pass
    then anchor chunks), each a phase, except that each sample replays only its last anchors
    (see the module docstring)."""
    from pipeline.common.distributed import Dist, resolve_device
    from pipeline.common.dtypes import resolve_dtype
    from pipeline.shards import ShardSet
    from scoring.config import ScoreConfig
    from scoring.replay.anchors import empty_anchor_tensors, replay_anchors
    from scoring.replay.packing import pack_samples, prepare_target_head, select_feature_columns
    from scoring.score.steps import SAMPLE_TENSORS, prepare_job

    config = ScoreConfig(
        ckpts=[payload["ckpt"]], shards=payload["shards"], out=payload["out"], tree_nodes=[], force=True
    )
    memory = PhaseMemory()
    start = time.perf_counter()
    device = resolve_device(None if config.device == "auto" else config.device, Dist())
    dtype = resolve_dtype(config.dtype, device)
    shardset = ShardSet(config.shards)
    with memory.phase("read target head"):
        stored = shardset.target_head()
    with memory.phase("cast target head"):
        head = prepare_target_head(stored, device, dtype)
        del stored  # run_score keeps only the compute-dtype copy
    with memory.phase("load drafter"):
        job = prepare_job(config.ckpts[0], shardset, config.out, config, Dist())
    proposer, options = job.proposer, job.options
    columns = lambda f: select_feature_columns(f, job.stored_layer_ids, job.info.config.target_layer_ids)  # noqa: E731
    chunks, anchors = {}, 0
    for sample in shardset.samples(tensors=SAMPLE_TENSORS):
        t = tag(sample.response_len)
        result = empty_anchor_tensors(sample, sample.response_len, proposer, options)
        count = result.anchors.numel()
        with memory.phase(f"context keys/values, {t}"):
            packed = pack_samples(proposer, [sample], columns, options, head)
        block = proposer.config.block_size
        chunk = proposer.anchors_per_chunk(block, sample.input_ids.numel(), head.lm_head.shape[0], options)
        last = min(count, chunk + 1)
        chunks[t] = {"anchors_per_chunk": chunk, "anchors": last}
        with memory.phase(f"replay the last {last} anchors, {t}"):
            replay_anchors(proposer, head, packed, [result], [(0, r) for r in range(count - last, count)], options)
        anchors += last
        del sample, packed, result  # as score does: the next sample must not keep this one alive
    wall = time.perf_counter() - start
    return {
        **memory.finish(),
        "run_s": wall,
        "memory_budget": config.memory_bytes,
        "dtype": str(dtype).removeprefix("torch."),
        "anchors_scored": anchors,
        "chunks": chunks,
    }


def child_main(kind: str, payload_json: str, result_path: str) -> int:
    quiet_transformers()
    payload = json.loads(payload_json)
    torch.set_num_threads(int(payload.get("threads") or torch.get_num_threads()))
    result = {"extract": child_extract, "forward": child_forward, "score": child_score}[kind](payload)
    result["threads"] = torch.get_num_threads()
    Path(result_path).write_text(json.dumps(result, indent=1, default=str))
    return 0


# ---------------------------------------------------------------------------------------------
# the section


def write_long_prompts(path: Path, lengths: list[int], vocab: int, seed: int = 0) -> None:
    """One record per length, in the order given: a short prompt and a teacher-forced response."""
    rng = np.random.default_rng(seed)
    lines = []
    for length in lengths:
        prompt = rng.integers(3, 29, PROMPT_TOKENS).tolist()  # ids the stand-in tokenizer decodes
        response = rng.integers(3, vocab, length)
        lines.append(json.dumps({"id": f"long-{length}", "input_ids": prompt, "response": response.tolist()}))
    path.write_text("\n".join(lines) + "\n")


def per_length(phases: dict, lengths: list[int], flat: tuple[str, ...], budgeted: dict[str, int]) -> dict:
    """Per sample length: the highest peak of the phases that must be flat apart from the stored
    tensors (names starting with one of `flat`; None when the product marked no such phase), and
    the working set (peak - RSS at its start) of each phase whose size the memory budget sets
    (`budgeted`: name prefix -> its share, bytes)."""
    out = {}
    for t in lengths:
        mine = {n: p for n, p in phases.items() if n.endswith(tag(t)) or n.endswith(tag(t) + ")")}
        flat_peak = max((p["peak_rss_bytes"] for n, p in mine.items() if n.startswith(flat)), default=None)
        working = {}
        for n, p in mine.items():
            share = next((v for k, v in budgeted.items() if n.startswith(k)), None)
            if share is not None:
                size = p["peak_rss_bytes"] - (p.get("rss_before_bytes") or 0)
                working[n] = {"bytes": size, "budget_share_bytes": share, "within": size <= share}
        out[t] = {
            "peak_rss_bytes": max((p["peak_rss_bytes"] for p in mine.values()), default=None),
            "flat_phases_peak_rss_bytes": flat_peak,
            "budgeted_working_sets": working,
        }
    return out


def flat_verdict(
    peaks: dict[int, int | None], stored_per_token: int, phases: str, factor=FLAT_FACTOR, slack=FLAT_SLACK
) -> dict:
    lengths = sorted(peaks)
    t1, t2 = lengths[0], lengths[-1]
    stored = (t2 - t1) * stored_per_token
    allowed = factor * stored + slack
    growth = None if peaks[t1] is None or peaks[t2] is None else peaks[t2] - peaks[t1]
    return {
        "phases": phases,
        "from_tokens": t1,
        "to_tokens": t2,
        "peak_rss_bytes": {str(t): peaks[t] for t in lengths},
        "rss_growth_bytes": growth,
        "stored_growth_bytes": stored,
        "growth_over_stored": growth / stored if stored and growth is not None else None,
        "allowed_bytes": allowed,
        "flat_apart_from_stored": None if growth is None else growth <= allowed,
    }


def within_budget(by_length: dict) -> bool:
    return all(w["within"] for v in by_length.values() for w in v["budgeted_working_sets"].values())


def highest(phases: dict) -> dict:
    name, phase = max(phases.items(), key=lambda kv: kv[1]["peak_rss_bytes"])
    return {"phase": name, "peak_rss_bytes": phase["peak_rss_bytes"]}


def minus(total, *parts):
    return None if total is None or None in parts else total - sum(parts)


def phase_table(phases: dict) -> dict:
    return {
        name: {
            "seconds": round(p["seconds"], 2),
            "peak_rss_bytes": p["peak_rss_bytes"],
            "rss_before_bytes": p.get("rss_before_bytes"),
            "rss_after_bytes": p.get("rss_after_bytes"),
        }
        for name, p in phases.items()
    }


def summarize_extract(ex: dict, result: dict, lengths: list[int], per_token: int) -> dict:
    target = result["target"]
    weights = target["params"] * 2
    budget = ex["memory_budget"]
    by_length = per_length(
        ex["phases"], lengths, ("forward + features",), {"lm_head + top-k": budget // 2, "write shards": budget // 2}
    )
    lengths_out = {}
    for t in sorted(lengths):
        stored = (t + PROMPT_TOKENS) * per_token
        lengths_out[str(t)] = {
            **by_length[t],
            "stored_tensors_bytes": stored,
            "forward_rest_bytes": minus(
                by_length[t]["flat_phases_peak_rss_bytes"], ex["baseline_rss_bytes"], weights, stored
            ),
            "shard_bytes": ex["shard_bytes_by_sample"].get(f"long-{t}"),
        }
    return {
        "peak_rss_bytes": max(ex["peak_rss_bytes"], ex.get("parent_polled_peak_rss_bytes") or 0),
        "highest": highest(ex["phases"]),
        "wall_s": ex["run_s"],
        "wall_s_incl_startup": ex["wall_s_incl_startup"],
        "shard_bytes": ex["totals"]["bytes"],
        "target_head_bytes": ex["target_head_bytes"],
        "tokens": ex["totals"]["tokens"],
        "memory_budget": budget,
        "weights_bytes": weights,
        "baseline_rss_bytes": ex["baseline_rss_bytes"],
        "embed_lm_head_bytes": (target["embed_params"] + target["lm_head_params"]) * 2,
        "layers_bytes": target["layer_params"] * 2,
        "per_length": lengths_out,
        "flat": flat_verdict(
            {t: v["flat_phases_peak_rss_bytes"] for t, v in by_length.items()}, per_token, "the forward (+ features)"
        ),
        "budgeted_within": within_budget(by_length),
        "phases": phase_table(ex["phases"]),
        "hwm_reset_works": ex["hwm_reset_works"],
    }


def summarize_forward(fw: dict, lengths: list[int], per_token: int, side: str) -> dict:
    """One side of the forward-alone comparison: its phase peaks and their growth."""
    by_length = per_length(fw["phases"], lengths, ("forward + features",), {})
    peaks = {t: v["flat_phases_peak_rss_bytes"] for t, v in by_length.items()}
    return {
        "wall_s": fw["run_s"],
        "peak_rss_bytes": {str(t): peaks[t] for t in sorted(lengths)},
        "growth": flat_verdict(peaks, per_token, f"the forward (+ features), {side}", FORWARD_FACTOR, 0),
        "phases": phase_table(fw["phases"]),
    }


def summarize_score(sc: dict, result: dict, lengths: list[int], per_token: int) -> dict:
    target = result["target"]
    compute_item = 4 if sc["dtype"] == "float32" else 2
    lm_head = target["lm_head_params"] * compute_item
    embed = target["embed_params"] * min(2, compute_item)  # kept in the narrower dtype
    drafter = result["drafter"]["params"] * compute_item
    by_length = per_length(sc["phases"], lengths, ("context keys/values",), {"replay the last": sc["memory_budget"]})
    lengths_out = {}
    for t in sorted(lengths):
        stored = (t + PROMPT_TOKENS) * per_token
        gap = sc["phases"].get(f"other (before context keys/values, {tag(t)})", {})
        lengths_out[str(t)] = {
            **by_length[t],
            "stored_tensors_bytes": stored,
            "context_rest_bytes": minus(
                by_length[t]["flat_phases_peak_rss_bytes"], sc["baseline_rss_bytes"], lm_head + embed + drafter, stored
            ),
            "before_context_peak_rss_bytes": gap.get("peak_rss_bytes"),
            **sc["chunks"].get(tag(t), {}),
        }
    return {
        "peak_rss_bytes": max(sc["peak_rss_bytes"], sc.get("parent_polled_peak_rss_bytes") or 0),
        "highest": highest(sc["phases"]),
        "wall_s": sc["run_s"],
        "wall_s_incl_startup": sc["wall_s_incl_startup"],
        "dtype": sc["dtype"],
        "anchors_scored": sc["anchors_scored"],
        "memory_budget": sc["memory_budget"],
        "baseline_rss_bytes": sc["baseline_rss_bytes"],
        "lm_head_bytes": lm_head,
        "embed_bytes": embed,
        "drafter_bytes": drafter,
        "per_length": lengths_out,
        "flat": flat_verdict(
            {t: v["flat_phases_peak_rss_bytes"] for t, v in by_length.items()},
            per_token,
            "the context keys/values pass (sample resident)",
        ),
        "budgeted_within": within_budget(by_length),
        "phases": phase_table(sc["phases"]),
        "hwm_reset_works": sc["hwm_reset_works"],
    }


def run(ctx) -> tuple[dict, Rows]:
    """Extract, then score, long responses at 27B shapes (quick: "mid" shapes), each stage in one
    fresh process holding both lengths (the longer first)."""
    from pipeline.outdir.storage import stored_bytes_per_token, tensor_dtypes

    work = Path(ctx.work) / "memory"
    work.mkdir(parents=True, exist_ok=True)
    parts = chosen_parts(getattr(ctx.args, "memory_parts", None))
    shape_name = "mid" if ctx.args.quick else "27b"
    shape = SHAPES[shape_name]
    target_shape = shape["target"]
    lengths = list(shape["lengths"])
    threads = torch.get_num_threads()
    result: dict = {
        "shapes": shape_name,
        "lengths": sorted(lengths),
        "layer_ids": LAYER_IDS,
        "prompt_tokens": PROMPT_TOKENS,
        "top_k": TOP_K,
        "threads": threads,
        "score_anchors": "per sample, its last anchors: one full anchor chunk + 1",
        "parts": sorted(parts),
        "peak_limit_bytes": PEAK_LIMIT,
        "machine_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    }
    free = shutil.disk_usage(work).free
    if free < DISK_NEEDED[shape_name]:
        result["skipped"] = (
            f"needs {DISK_NEEDED[shape_name] / GiB:.0f} GiB free disk under {work}, has {free / GiB:.1f} GiB"
        )
        log(f"memory: skipped: {result['skipped']}")
        shutil.rmtree(work, ignore_errors=True)
        return result, rows(result)
    try:
        log(
            f"memory: writing the stand-in target ({shape_name} shapes: hidden {target_shape['hidden_size']}, vocab "
            f"{target_shape['vocab_size']}, {target_shape['num_hidden_layers']} layers, random bf16) and drafter ..."
        )
        start = time.perf_counter()
        result["target"] = build_target(work / "target", target_shape)
        result["drafter"] = build_drafter(work / "drafter", target_shape, shape["drafter"], LAYER_IDS)
        result["build_s"] = time.perf_counter() - start
        log(
            f"memory:   target {result['target']['params'] / 1e9:.2f}B params "
            f"({result['target']['file_bytes'] / GiB:.1f} GiB), drafter {result['drafter']['params'] / 1e6:.0f}M "
            f"params, {result['build_s']:.0f} s"
        )
        # raw bytes one token's stored tensors take (bf16 features, top-k, flags), as extract counts them
        per_token = stored_bytes_per_token(
            tensor_dtypes("bfloat16"), len(LAYER_IDS), target_shape["hidden_size"], TOP_K
        )
        result["stored_bytes_per_token_raw"] = per_token
        prompts = work / "prompts.jsonl"
        write_long_prompts(prompts, lengths, target_shape["vocab_size"])
        shards_dir = work / "shards"
        if "extract" in parts:
            result["extract"] = extract_part(work, prompts, shards_dir, threads, lengths, result, per_token, shape_name)
        result["forward"] = {}
        for part_name in ("forward-before", "forward-after"):
            if part_name in parts:
                side = PARTS[part_name]
                result["forward"][side] = forward_part(work, prompts, threads, lengths, per_token, side, shape_name)
        if "score" in parts:
            result["score"] = score_part(work, shards_dir, threads, result, lengths, per_token, shape_name)
        peaks = [result[p]["peak_rss_bytes"] for p in ("extract", "score") if p in result]
        if peaks:
            result["peak_rss_bytes"] = max(peaks)
            result["under_peak_limit"] = result["peak_rss_bytes"] <= PEAK_LIMIT
    except ChildFailed as error:  # e.g. killed before the machine ran out of memory: a result, not a crash
        result["error"] = str(error)
        log(f"memory: {error}")
    finally:
        shutil.rmtree(work, ignore_errors=True)  # ~8 GiB of stand-in weights and 5 GiB of target head
    return result, rows(result)


def extract_part(work, prompts, shards_dir, threads, lengths, result, per_token, shape_name) -> dict:
    """`specreplay extract` of both samples in one fresh process, summarized."""
    log(f"memory: specreplay extract, bf16, teacher-forced responses of {lengths} tokens (one fresh process) ...")
    payload = {
        "model": str(work / "target"),
        "prompts": str(prompts),
        "out": str(shards_dir),
        "layer_ids": LAYER_IDS,
        "top_k": TOP_K,
        "threads": threads,
        "lengths": lengths,
    }
    ex = run_child("extract", payload, work, CHILD_TIMEOUT_S[shape_name])
    summary = summarize_extract(ex, result, lengths, per_token)
    log(
        f"memory:   peak RSS {fmt_mib(summary['peak_rss_bytes'])} ({summary['highest']['phase']}), "
        f"{ex['run_s']:.0f} s, shards {ex['totals']['bytes'] / MiB:.0f} MiB"
    )
    return summary


def forward_part(work, prompts, threads, lengths, per_token, side, shape_name) -> dict:
    """Extract's forward alone, one side (FORWARD_SIDES), in one fresh process, summarized."""
    log(f"memory: extract's forward alone, {side} (one fresh process) ...")
    payload = {
        "model": str(work / "target"),
        "prompts": str(prompts),
        "layer_ids": LAYER_IDS,
        "threads": threads,
        "lengths": lengths,
        "windowed": FORWARD_SIDES[side],
    }
    fw = run_child("forward", payload, work, CHILD_TIMEOUT_S[shape_name])
    log(f"memory:   {fw['run_s']:.0f} s")
    return summarize_forward(fw, lengths, per_token, side)


def score_part(work, shards_dir, threads, result, lengths, per_token, shape_name) -> dict:
    """The scorer over the last anchor chunk of each sample, in one fresh process, summarized."""
    log("memory: scoring, the last anchor chunk of each sample (one fresh process) ...")
    payload = {
        "ckpt": str(work / "drafter"),
        "shards": str(shards_dir),
        "out": str(work / "results"),
        "threads": threads,
    }
    sc = run_child("score", payload, work, CHILD_TIMEOUT_S[shape_name])
    summary = summarize_score(sc, result, lengths, per_token)
    log(
        f"memory:   peak RSS {fmt_mib(summary['peak_rss_bytes'])} ({summary['highest']['phase']}), "
        f"{sc['run_s']:.0f} s ({sc['dtype']})"
    )
    return summary


def rows(big: dict) -> Rows:
    out = Rows()
    if "skipped" in big or "error" in big:
        out.add(
            f"memory at {big.get('shapes')} shapes",
            "skipped: " + big["skipped"] if "skipped" in big else "FAILED: " + big["error"].splitlines()[0],
            met=False if "error" in big else None,
        )
    if "target" not in big:
        return out
    t, cfg = big["target"], big["target"]["config"]
    out.add(
        f"memory at {big['shapes']} shapes: target {t['params'] / 1e9:.2f}B params (hidden {cfg['hidden_size']}, "
        f"vocab {cfg['vocab_size']}, {cfg['num_hidden_layers']} layers, bf16), "
        f"{big['drafter']['params'] / 1e6:.0f}M drafter, one process per stage; parts run: {', '.join(big['parts'])}"
    )
    if "extract" in big:
        extract_rows(out, big["extract"])
    if "score" in big:
        score_rows(out, big["score"])
    growth_rows(out, big)
    for side in ("extract", "score"):
        if side not in big:
            continue
        v = big[side]["flat"]
        ratio = "-" if v["growth_over_stored"] is None else f"{v['growth_over_stored']:.2f}x"
        out.add(
            f"  {side}: growth {v['from_tokens']} -> {v['to_tokens']} tokens of {v['phases']} vs stored tensors",
            f"{fmt_mib(v['rss_growth_bytes'])} vs {fmt_mib(v['stored_growth_bytes'])} ({ratio})",
            f"<= {FLAT_FACTOR}x + {FLAT_SLACK // MiB} MiB",
            v["flat_apart_from_stored"],
        )
    return out


def extract_rows(out: Rows, ex: dict) -> None:
    out.add(
        "  extract (bf16): peak RSS",
        f"{fmt_mib(ex['peak_rss_bytes'])} in '{ex['highest']['phase']}' ({ex['wall_s']:.0f} s)",
        f"<= {PEAK_LIMIT / GiB:.0f} GiB",
        ex["peak_rss_bytes"] <= PEAK_LIMIT,
    )
    out.add(
        "    weights (embedding + lm_head / layers), target head file",
        f"{fmt_mib(ex['weights_bytes'])} ({fmt_mib(ex['embed_lm_head_bytes'])} / {fmt_mib(ex['layers_bytes'])}), "
        f"{fmt_mib(ex['target_head_bytes'])}",
    )
    for length, p in ex["per_length"].items():
        out.add(
            f"    {length} tokens, forward: peak = start-up + weights + stored + rest",
            f"{fmt_mib(p['flat_phases_peak_rss_bytes'])} = {fmt_mib(ex['baseline_rss_bytes'])} + "
            f"{fmt_mib(ex['weights_bytes'])} + {fmt_mib(p['stored_tensors_bytes'])} + "
            f"{fmt_mib(p['forward_rest_bytes'])}; shard {fmt_mib(p['shard_bytes'])}",
        )
        budget_rows(out, p, ex["memory_budget"])


def score_rows(out: Rows, sc: dict) -> None:
    out.add(
        f"  score ({sc['dtype']}, last anchor chunk per sample): peak RSS",
        f"{fmt_mib(sc['peak_rss_bytes'])} in '{sc['highest']['phase']}' ({sc['wall_s']:.0f} s)",
        f"<= {PEAK_LIMIT / GiB:.0f} GiB",
        sc["peak_rss_bytes"] <= PEAK_LIMIT,
    )
    out.add(
        "    lm_head + embedding + drafter",
        f"{fmt_mib(sc['lm_head_bytes'])} + {fmt_mib(sc['embed_bytes'])} + {fmt_mib(sc['drafter_bytes'])}",
    )
    fixed = sc["lm_head_bytes"] + sc["embed_bytes"] + sc["drafter_bytes"]
    for length, p in sc["per_length"].items():
        out.add(
            f"    {length} tokens, before its context pass (shard decoding in the background): peak",
            fmt_mib(p["before_context_peak_rss_bytes"]),
        )
        out.add(
            f"    {length} tokens, context pass: peak = start-up + head + drafter + stored + rest",
            f"{fmt_mib(p['flat_phases_peak_rss_bytes'])} = {fmt_mib(sc['baseline_rss_bytes'])} + "
            f"{fmt_mib(fixed)} + "
            f"{fmt_mib(p['stored_tensors_bytes'])} + {fmt_mib(p['context_rest_bytes'])}",
        )
        budget_rows(
            out,
            p,
            sc["memory_budget"],
            f" ({p.get('anchors', '-')} anchors, {p.get('anchors_per_chunk', '-')} per chunk)",
        )


def growth_rows(out: Rows, big: dict) -> None:
    """Extract's forward alone, before (one pass) and after (windows), as many sides as ran:
    peaks and their growth; the verdict is the after side's."""
    ran = {side: big.get("forward", {}).get(side) for side in FORWARD_SIDES}
    ran = {side: v for side, v in ran.items() if v is not None}
    if not ran:
        return
    names = " / ".join(side.split(" ")[0] for side in ran)
    out.add(f"  extract's forward (+ features) alone, one process per side: peak RSS {names}")
    for length in next(iter(ran.values()))["peak_rss_bytes"]:
        out.add(
            f"    {length} tokens",
            " / ".join(fmt_mib(v["peak_rss_bytes"][length]) for v in ran.values())
            + " ("
            + " / ".join(f"{v['wall_s']:.0f}" for v in ran.values())
            + " s both lengths)",
        )
    ratio = lambda v: "-" if v["growth_over_stored"] is None else f"{v['growth_over_stored']:.2f}x"  # noqa: E731
    growth = [v["growth"] for v in ran.values()]
    after = ran.get("after (windows)")
    out.add(
        f"  extract peak growth {growth[0]['from_tokens']} -> {growth[0]['to_tokens']} vs stored tensors' growth "
        f"({fmt_mib(growth[0]['stored_growth_bytes'])}), forward alone: {names}",
        " / ".join(f"{fmt_mib(g['rss_growth_bytes'])} ({ratio(g)})" for g in growth),
        f"<= {FORWARD_FACTOR}x",
        after["growth"]["flat_apart_from_stored"] if after else None,
    )


def budget_rows(out: Rows, length_figures: dict, budget: int, note: str = "") -> None:
    for name, w in length_figures["budgeted_working_sets"].items():
        out.add(
            f"      {name}: working set",
            f"{fmt_mib(w['bytes'])}{note}",
            f"<= {fmt_mib(w['budget_share_bytes'])} (of the {fmt_mib(budget)} memory budget)",
            w["within"],
        )


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        sys.exit(child_main(*sys.argv[2:5]))
    sys.exit("usage: python -m bench.sections.memory --child extract|score PAYLOAD_JSON RESULT_PATH")
