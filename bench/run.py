"""`make bench`: the figures of issues 2, 3 and 4, each measured side by side in one run.

    .venv/bin/python bench/run.py            # full  (16 prompts, 128 new tokens; ~6 min on 2 quiet cores)
    .venv/bin/python bench/run.py --quick    # small (4 prompts, 48 new tokens;  ~1.5 min)
    make bench ARGS="--prompts 8 --max-new-tokens 64"

Prints one table and writes every number (with the environment, the load average and the CPU
other processes used during each phase, so noisy runs are visible) to
bench/results/bench-<date>-<time>.json. What each figure means and how it is
measured: bench/README.md. Timings are wall clock on a shared machine: every comparison is
measured in the same process, alternating the two sides, and reported as a ratio of minima.

Sections
  extract   SmolLM2-135M (model "smollm2") in bf16: `specreplay extract` (run_extract, target
            preloaded) vs the bare model work (batched greedy generate + one full forward per
            sample returning hidden states, nothing stored), alternated; stored bytes per token;
            feature codecs (zstandard directly) on the real features; shard reader throughput.
  score     SmolLM2 in fp32 (the CPU default, exact): fit a one-layer drafter, then offline
            `specreplay score` (run_score) vs the reference online loop `dflash_generate` on
            the same prompts and checkpoint; walk parity; FLOP ratio; anchors/s; peak RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "bench") not in sys.path:  # bench/common.py, also when imported as bench.scale
    sys.path.insert(0, str(ROOT / "bench"))
if str(ROOT) not in sys.path:  # `python bench/run.py` puts bench/ first, not the repo root
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import Timers, current_rss, finish_run, loadavg, log, peak_rss, reset_peak, start_run  # noqa: E402  (bench/common.py)
CONTENDED_CORES = 0.2  # others' CPU above this during a measured phase makes its verdict suspect
GB = 1e9
MiB = 1 << 20

TARGETS = {
    "extract_overhead_ratio": 1.05,  # issue 2/4: at most 5% over the bare model work
    "feature_bytes_vs_raw_bf16": 0.67,  # issue 2/4: features at most 0.67 of raw bf16, losslessly
    "shard_decode_gb_s_per_core": 1.0,  # issue 4: shard decode at least 1 GB/s per core
    "score_speedup_vs_work_ratio": 1.0,  # issue 3/4: measured speed-up >= FLOP ratio
}


# ---------------------------------------------------------------------------------------------
# small helpers


class OthersCpu:
    """Background sampler of the CPU that OTHER processes use (in cores), once a second:
    system-wide busy CPU time (psutil.cpu_times, idle and iowait excluded) minus this process's
    own. The machine is shared; this says how contended each measured phase was."""

    def __init__(self, interval: float = 1.0):
        import threading

        import psutil

        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (perf_counter at the end of the interval, cores)
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _busy(self) -> tuple[float, float, float]:
        import psutil

        total = psutil.cpu_times()
        busy = sum(getattr(total, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))
        own = self._process.cpu_times()  # waited-for children (the CLI subprocess) count as ours
        return time.perf_counter(), busy, own.user + own.system + own.children_user + own.children_system

    def _run(self):
        last = self.first = self._busy()
        while not self._stop.wait(self.interval):
            now = self._busy()
            wall = now[0] - last[0]
            if wall > 0:
                self.samples.append((now[0], max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / wall)))
            last = now

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> float | None:
        """Stops sampling; returns the cores other processes used over the whole run."""
        self._stop.set()
        first, now = getattr(self, "first", None), self._busy()
        if first is None or now[0] <= first[0]:
            return None
        return round(max(0.0, ((now[1] - first[1]) - (now[2] - first[2])) / (now[0] - first[0])), 2)

    def mean(self, start: float, end: float) -> float | None:
        """Mean cores used by others over [start, end] (the samples whose interval overlaps it)."""
        picked = [cores for t, cores in self.samples if start <= t <= end + self.interval]
        return round(sum(picked) / len(picked), 2) if picked else None


OTHERS: OthersCpu | None = None


def others_cpu(start: float, end: float) -> float | None:
    return OTHERS.mean(start, end) if OTHERS is not None else None


class Phase:
    """Wall time, peak RSS and others' CPU use of a block: `with Phase() as p: ...; p.seconds`."""

    def __enter__(self):
        self.peak_reset = reset_peak()
        self.rss_before = current_rss() or 0
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        end = time.perf_counter()
        self.seconds = end - self.start
        self.peak_rss = peak_rss() if self.peak_reset else None
        self.others_cpu = others_cpu(self.start, end)
        return False


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / MiB:.0f} MiB"


def rss_text(phase: dict) -> str:
    peak, before = phase.get("peak_rss_bytes"), phase.get("rss_before_bytes")
    if peak is None:
        return "-"
    return f"{fmt_bytes(peak)} (+{fmt_bytes(max(0, peak - before))})"


# ---------------------------------------------------------------------------------------------
# extract: specreplay extract vs the bare model work


def batches(items, size):
    for start in range(0, len(items), size):
        yield items[start:start + size]


@torch.inference_mode()
def bare_model_work(model, info, items, layer_ids, max_new_tokens, batch_size) -> dict:
    """What any extractor must compute: batched greedy generate (the same left-padded
    `model.generate` call), then one full-sequence forward per sample with hidden states out.
    Nothing is stored. The forward is timed twice: as the plain transformers forward
    (`model(ids, output_hidden_states=True)`, logits at every position: the same lm_head rows
    extract computes, see capture.head_windows) and with `logits_to_keep=R+1` (only the rows a
    next-token distribution needs), so both baselines are reported."""
    from pipeline.generate import generate_batch

    gen = fwd_full = fwd_min = 0.0
    tokens, responses = 0, []
    for batch in batches(items, batch_size):
        start = time.perf_counter()
        out = generate_batch(model, [i.prompt_ids for i in batch], max_new_tokens, info.stop_token_ids,
                             info.pad_token_id)
        gen += time.perf_counter() - start
        for item, response in zip(batch, out):
            ids = torch.tensor([item.prompt_ids + response.token_ids])
            start = time.perf_counter()
            result = model(input_ids=ids, output_hidden_states=True, use_cache=False)
            features = [result.hidden_states[i + 1] for i in layer_ids]  # selected, not kept
            fwd_full += time.perf_counter() - start
            del result, features
            start = time.perf_counter()
            result = model(input_ids=ids, output_hidden_states=True, use_cache=False,
                           logits_to_keep=len(response.token_ids) + 1)
            features = [result.hidden_states[i + 1] for i in layer_ids]
            fwd_min += time.perf_counter() - start
            del result, features
            tokens += ids.shape[1]
            responses.append(response.token_ids)
    return {"generate_s": gen, "forward_full_logits_s": fwd_full, "forward_response_logits_s": fwd_min,
            "total_s": gen + fwd_full, "total_min_logits_s": gen + fwd_min, "tokens": tokens,
            "responses": responses}


def instrumented_extract(config, timers: Timers):
    """run_extract with the loaded target reused and its stages timed (wrappers, ~us per call)."""
    import pipeline.capture as capture
    import pipeline.extract as extract
    import pipeline.generate as generate
    import pipeline.shards as shards

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(generate, "generate_responses", timers.wrap("generate", generate.generate_responses)))
        stack.enter_context(patched(capture, "capture_sample", timers.wrap("capture (forward + top-k)", capture.capture_sample)))
        stack.enter_context(patched(capture, "next_token_distribution",
                                    timers.wrap("  of which lm_head + log_softmax + top-k", capture.next_token_distribution)))
        stack.enter_context(patched(shards.ShardWriter, "write", timers.wrap("shard write (planes + zstd + arrow)", shards.ShardWriter.write)))
        stack.enter_context(patched(shards.ShardWriter, "finish_shard", timers.wrap("shard finish (crc32, rename)", shards.ShardWriter.finish_shard)))
        stack.enter_context(patched(extract, "weights_fingerprint", timers.wrap("weights fingerprint", extract.weights_fingerprint)))
        stack.enter_context(patched(extract, "stored_target_head", timers.wrap("store target head", extract.stored_target_head)))
        return extract.run_extract(config)


def bench_extract(args, work: Path, dtype: str, prompts: int, reps: int, with_bare: bool = True) -> dict:
    import pipeline.target as target_mod
    from pipeline.extract import ExtractConfig, prepare_items
    from pipeline.layer_ids import build_target_layer_ids
    from pipeline.prompts import load_prompts

    start = time.perf_counter()
    loaded = target_mod.load_target("smollm2", dtype=dtype)
    load_s = time.perf_counter() - start
    model, tokenizer, info = loaded
    records = load_prompts(args.prompt_set, limit=prompts)
    items = prepare_items(records, tokenizer, None)
    layer_ids = build_target_layer_ids(info.num_layers, 5)
    out = work / f"shards-{dtype}"
    config = ExtractConfig(model="smollm2", prompts=args.prompt_set, limit=prompts, out=str(out),
                           max_new_tokens=args.max_new_tokens, dtype=dtype, overwrite=True, quiet=True,
                           batch_size=args.batch_size)
    log(f"extract/{dtype}: SmolLM2-135M loaded in {load_s:.1f}s; {len(items)} prompts, "
        f"max_new_tokens {args.max_new_tokens}, batch {args.batch_size}, layer ids {layer_ids}")

    runs = {"bare": [], "extract": []}
    breakdowns, bare_responses = [], None
    with patched(target_mod, "load_target", lambda *a, **k: loaded):
        for rep in range(reps):
            if with_bare:
                log(f"extract/{dtype}: rep {rep + 1}/{reps} bare generate + forward ...")
                t = time.perf_counter()
                bare = bare_model_work(model, info, items, layer_ids, args.max_new_tokens, args.batch_size)
                bare["others_cpu"] = others_cpu(t, time.perf_counter())
                bare_responses = bare.pop("responses")
                runs["bare"].append(bare)
                log(f"extract/{dtype}:   bare {bare['total_s']:.1f}s (generate {bare['generate_s']:.1f}s, "
                    f"forward {bare['forward_full_logits_s']:.1f}s; with response-only logits "
                    f"{bare['forward_response_logits_s']:.1f}s; other processes: {bare['others_cpu']} cores)")
            log(f"extract/{dtype}: rep {rep + 1}/{reps} specreplay extract ...")
            timers = Timers()
            t = time.perf_counter()
            manifest = instrumented_extract(config, timers)
            wall = time.perf_counter() - t
            runs["extract"].append(wall)
            breakdowns.append({"wall_s": wall, "others_cpu": others_cpu(t, t + wall),
                               **{k: round(v, 3) for k, v in timers.seconds.items()}})
            log(f"extract/{dtype}:   extract {wall:.1f}s (other processes: {breakdowns[-1]['others_cpu']} cores)")

    from pipeline.shards import ShardSet

    stored = [s.input_ids[s.prompt_len:].tolist() for s in ShardSet(str(out)).samples(tensors=[])]
    result = {
        "dtype": dtype, "prompts": len(items), "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size, "layer_ids": layer_ids, "model_load_s": load_s,
        "tokens": manifest["totals"]["tokens"], "response_tokens": manifest["totals"]["response_tokens"],
        "argmax_mismatches": manifest["totals"]["argmax_mismatches"],
        "extract_runs_s": runs["extract"], "extract_min_s": min(runs["extract"]),
        "extract_runs_others_cpu": [b["others_cpu"] for b in breakdowns],
        "extract_breakdown_of_min": min(breakdowns, key=lambda b: b["wall_s"]),
        "out": str(out),
    }
    if with_bare:
        best = min(runs["bare"], key=lambda r: r["total_s"])
        result.update({
            "bare_runs": runs["bare"], "bare_min_s": best["total_s"],
            "bare_min_response_logits_s": min(r["total_min_logits_s"] for r in runs["bare"]),
            "overhead_ratio": min(runs["extract"]) / best["total_s"],
            "overhead_ratio_vs_response_logits": min(runs["extract"]) / min(r["total_min_logits_s"] for r in runs["bare"]),
            "responses_equal_bare": stored == bare_responses,
            "extract_incl_model_load_s": min(runs["extract"]) + load_s,
        })
    del model, loaded
    return result


# ---------------------------------------------------------------------------------------------
# storage: bytes per token


def shard_chunks(shard_dir: str):
    """(entry, record batch) of every chunk, read with Arrow directly (the bench measures the format)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from pipeline import shards

    shardset = shards.ShardSet(shard_dir)
    fs, root = shards.open_fs(shard_dir)
    for entry in shardset.entries:
        reader = ipc.open_file(pa.BufferReader(shards.read_bytes(fs, shards.join(root, entry["file"]))))
        for index in range(reader.num_record_batches):
            yield entry, reader.get_batch(index)


def stored_bytes(shard_dir: str) -> dict:
    """Bytes per token of what extract stored: each tensor's zstd frames as they sit in the
    shards (row 0 of every chunk); their sum is compared with the shard files' real size.
    fp8 features count their scales."""
    from pipeline.shards import ShardSet, chunk_frame

    shardset = ShardSet(shard_dir)
    manifest = shardset.manifest
    level = manifest.get("run", {}).get("zstd_level", 1)
    sizes: dict[str, int] = {}
    chunks = 0
    for _, batch in shard_chunks(shard_dir):
        chunks += 1
        for name in shardset.tensor_dtypes:
            sizes[name] = sizes.get(name, 0) + chunk_frame(batch.column(name)).size
    totals = manifest["totals"]
    tokens, rows = totals["tokens"], totals["response_tokens"] + totals["samples"]
    settings = manifest["settings"]
    n_layers, hidden = len(settings["layer_ids"]), settings["target"]["hidden_size"]
    vocab, k = settings["target"]["vocab_size"], settings["top_k"]
    feature_dtype_bytes = torch.empty((), dtype=getattr(torch, settings["feature_dtype"])).element_size()
    raw_bf16 = n_layers * hidden * 2
    features = sizes["features"] + sizes.get("features_scale", 0)
    topk = sizes["topk_ids"] + sizes["topk_logprobs"]
    total_file_bytes = totals["bytes"]
    return {
        "feature_dtype": settings["feature_dtype"], "zstd_level": level, "tokens": tokens, "topk_rows": rows,
        "chunks": chunks, "chunk_tokens_mean": tokens / max(1, chunks),
        "features_bytes_per_token": features / tokens,
        "raw_bf16_features_bytes_per_token": raw_bf16,
        "features_vs_raw_bf16": features / tokens / raw_bf16,
        "features_vs_raw_same_dtype": features / (tokens * n_layers * hidden * feature_dtype_bytes),
        "raw_feature_dtype_bytes_per_token": n_layers * hidden * feature_dtype_bytes,
        "topk_bytes_per_row": topk / rows, "topk_k": k,
        "raw_topk_bytes_per_row": k * (4 + 4),
        "topk_vs_raw_topk": topk / rows / (k * 8),
        "topk_vs_full_bf16_logits": topk / rows / (vocab * 2),
        "shard_bytes_per_token": total_file_bytes / tokens,
        "shard_bytes_total": total_file_bytes,
        "sum_of_tensor_frames_vs_files": sum(sizes.values()) / total_file_bytes,
    }


# ---------------------------------------------------------------------------------------------
# feature codecs: plain zstd vs byte planes + zstd (the zstandard package directly)


def _best_of(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _row_major_planes(tensor: torch.Tensor) -> bytes:
    """Format v1's encoding (one sample, row-major byte planes), kept here for comparison."""
    flat = tensor.contiguous().view(-1)
    return flat.view(torch.uint8).view(-1, flat.element_size()).t().contiguous().numpy().tobytes()


def codec_comparison(shard_dir: str, repeats: int = 3) -> dict:
    """On the real extracted feature tensors: compressed size and single-thread decode speed of
    plain zstd (interleaved bytes, one sample per frame), format v1 (row-major byte planes, one
    sample per frame), and format v2 as shipped (channel-major byte planes of chunks of
    consecutive samples, pipeline.shards.encode_tensor / decode_tensor) at several chunk sizes."""
    import zstandard

    from pipeline.shards import DEFAULT_CHUNK_TOKENS, ShardSet, decode_tensor, encode_tensor

    features = [s.features.contiguous() for s in ShardSet(shard_dir).samples(tensors=["features"], prefetch=0)]
    dtype = features[0].dtype
    raw_total = sum(f.numel() * f.element_size() for f in features)
    everything = torch.cat(features)
    out = {"dtype": str(dtype).replace("torch.", ""), "tensors": len(features), "raw_bytes": raw_total,
           "tokens": everything.shape[0]}
    if features[0].element_size() == 2:  # order-0 entropy of the 16-bit values
        words = everything.view(torch.int16).numpy().view(np.uint16)
        counts = np.bincount(words.ravel()).astype(np.float64)
        p = counts[counts > 0] / words.size
        bits = float(-(p * np.log2(p)).sum())
        out["order0_entropy_bits"] = bits
        out["order0_entropy_ratio"] = 16 / bits
        # Per channel, sign / exponent / mantissa fields each with their own order-0 code: a
        # (slightly optimistic) bound for a channel-aware entropy coder.
        fields = ((words >> 15), (words >> 7) & 0xFF, words & 0x7F)
        channel_bits = 0.0
        for field in fields:
            for column in range(words.shape[1]):
                counts = np.bincount(field[:, column]).astype(np.float64)
                p = counts[counts > 0] / words.shape[0]
                channel_bits += float(-(p * np.log2(p)).sum())
        out["per_channel_field_entropy_bits"] = channel_bits / words.shape[1]
        out["per_channel_field_entropy_ratio"] = 16 / out["per_channel_field_entropy_bits"]

    def token_chunks(size):  # what the writer does: whole samples until `size` tokens
        chunk, count = [], 0
        for f in features:
            chunk.append(f)
            count += f.shape[0]
            if count >= size:
                yield torch.cat(chunk)
                chunk, count = [], 0
        if chunk:
            yield torch.cat(chunk)

    layouts = {
        "interleaved": [f.view(torch.uint8).numpy().tobytes() for f in features],
        "v1_row_planes_per_sample": [_row_major_planes(f) for f in features],
        "channel_planes_per_sample": [encode_tensor(f).to_pybytes() for f in features],
        "v2_chunks_1024": [encode_tensor(c).to_pybytes() for c in token_chunks(1024)],
        f"v2_chunks_{DEFAULT_CHUNK_TOKENS}": [encode_tensor(c).to_pybytes() for c in token_chunks(DEFAULT_CHUNK_TOKENS)],
        "v2_one_chunk_all": [encode_tensor(everything).to_pybytes()],
    }
    shipped = f"v2_chunks_{DEFAULT_CHUNK_TOKENS}"
    out["shipped_layout"] = shipped
    chunk_shapes = [[c.shape[0], c.shape[1]] for c in token_chunks(DEFAULT_CHUNK_TOKENS)]
    del everything
    decompressor = zstandard.ZstdDecompressor()
    for layout, buffers in layouts.items():
        for level in (1, 3):
            compressor = zstandard.ZstdCompressor(level=level)
            start = time.perf_counter()
            frames = [compressor.compress(b) for b in buffers]
            compress_s = time.perf_counter() - start
            size = sum(len(f) for f in frames)
            decode_s = _best_of(lambda: [decompressor.decompress(f) for f in frames], repeats)
            entry = {"bytes": size, "ratio": raw_total / size, "fraction_of_raw": size / raw_total,
                     "compress_gb_s": raw_total / compress_s / GB, "zstd_decode_gb_s": raw_total / decode_s / GB}
            if layout == shipped:  # + the re-interleave back to tensors (what the reader does)
                decoded = [decompressor.decompress(f) for f in frames]
                planes_s = _best_of(lambda: [decode_tensor(d, dtype, s) for d, s in zip(decoded, chunk_shapes)], repeats)
                entry["planes_to_tensor_gb_s"] = raw_total / planes_s / GB
                entry["decode_gb_s"] = raw_total / (decode_s + planes_s) / GB
                again = torch.cat([decode_tensor(d, dtype, s) for d, s in zip(decoded, chunk_shapes)])
                assert torch.equal(again.contiguous().view(torch.uint8), torch.cat(features).view(torch.uint8)), \
                    "byte planes are not lossless"
            out[f"{layout}_zstd{level}"] = entry
    out["planes_gain_level1"] = out["v1_row_planes_per_sample_zstd1"]["ratio"] / out["interleaved_zstd1"]["ratio"]
    out["v2_gain_over_v1"] = out[f"{shipped}_zstd1"]["ratio"] / out["v1_row_planes_per_sample_zstd3"]["ratio"]
    return out


# ---------------------------------------------------------------------------------------------
# shard reader throughput vs the same bytes uncompressed


def uncompressed_copy(shard_dir: str, dest: Path) -> str:
    """The same samples, chunks and byte layout written without compression (ShardWriter with
    zstd_level=None), as a shard set the real reader opens."""
    from pipeline import shards

    shardset = shards.ShardSet(shard_dir)
    writer = shards.ShardWriter(str(dest), 0, shardset.tensor_dtypes, zstd_level=None,
                                chunk_tokens=shardset.manifest.get("run", {}).get("chunk_tokens", shards.DEFAULT_CHUNK_TOKENS))
    for sample in shardset.samples(prefetch=0):
        writer.write(sample)
    manifest = dict(shardset.manifest, shards=writer.close())
    shards.write_manifest(str(dest), manifest)
    return str(dest)


def reader_breakdown(shard_dir: str, repeats: int = 3) -> dict:
    """Where the reader's time goes, stage by stage, single thread, all in GB/s of decoded
    features: xxh3_64 of each chunk's bytes, Arrow IPC record batch read (no Arrow compression:
    metadata and offsets), the features' zstd frame (pa.Codec), byte planes back to a tensor
    (numpy shift-or, pipeline.shards.decode_tensor)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from pipeline import shards

    shardset = shards.ShardSet(shard_dir)
    fs, root = shards.open_fs(shard_dir)
    dtype = shards.TENSOR_DTYPES[shardset.tensor_dtypes["features"]]
    blocks = []
    for entry in shardset.entries:
        data = shards.read_bytes(fs, shards.join(root, entry["file"]))
        schema = ipc.read_schema(ipc.read_message(pa.py_buffer(data[8:8 + entry["schema_block"][1]])))
        blocks += [(schema, pa.py_buffer(data[b[0]:b[0] + b[1]])) for b in entry["batches"]]
    default_threads = pa.cpu_count()
    pa.set_cpu_count(1)
    try:
        def arrow_read():
            found = []
            for schema, data in blocks:
                batch = ipc.read_record_batch(ipc.read_message(data), schema)
                shapes = batch.column("features_shape").to_pylist()
                found.append((shards.chunk_frame(batch.column("features")), [sum(x[0] for x in shapes), shapes[0][1]]))
            return found

        codec = pa.Codec("zstd")
        itemsize = torch.empty((), dtype=dtype).element_size()
        frames = arrow_read()
        decompress = lambda: [codec.decompress(f, decompressed_size=s[0] * s[1] * itemsize) for f, s in frames]  # noqa: E731
        buffers = [(b, s) for b, (_, s) in zip(decompress(), frames)]
        feature_bytes = sum(b.size for b, _ in buffers)
        import xxhash

        crc = _best_of(lambda: [xxhash.xxh3_64_intdigest(d) for _, d in blocks], repeats)
        arrow = _best_of(arrow_read, repeats)
        zstd = _best_of(decompress, repeats)
        planes = _best_of(lambda: [shards.decode_tensor(b, dtype, s) for b, s in buffers], repeats)
    finally:
        pa.set_cpu_count(default_threads)
    gbs = lambda seconds: feature_bytes / seconds / GB  # noqa: E731
    return {"checksum_xxh3_gb_s": gbs(crc), "arrow_ipc_read_gb_s": gbs(arrow), "zstd_frame_gb_s": gbs(zstd),
            "planes_to_tensor_gb_s": gbs(planes), "sum_of_stages_gb_s": gbs(crc + arrow + zstd + planes)}


def reader_throughput(shard_dir: str, work: Path, repeats: int = 3) -> dict:
    """GB/s of decoded features through the real reader: ShardSet.samples (per-chunk checksum,
    Arrow zstd, planes back to tensors) vs the same reader on an uncompressed copy. Measured with
    Arrow's thread pool at 1 thread (per core) and at its default, the consumer doing nothing."""
    import pyarrow as pa

    from pipeline import shards

    shardset = shards.ShardSet(shard_dir)
    plain = shards.ShardSet(uncompressed_copy(shard_dir, work / "uncompressed"))
    feature_bytes = sum(s.features.numel() * s.features.element_size() for s in shardset.samples(["features"], prefetch=0))

    def read(which, prefetch):
        for _ in which.samples(tensors=["features"], prefetch=prefetch):
            pass

    out = {"feature_bytes": feature_bytes,
           "compressed_file_bytes": shardset.manifest["totals"]["bytes"],
           "uncompressed_file_bytes": sum(e["bytes"] for e in plain.entries)}
    default_threads = pa.cpu_count()
    try:
        for label, threads in (("1thread", 1), (f"{default_threads}threads", default_threads)):
            pa.set_cpu_count(threads)
            read(shardset, 0)  # warm the page cache
            compressed = _best_of(lambda: read(shardset, 0), repeats)
            background = _best_of(lambda: read(shardset, 2), repeats)
            read(plain, 0)
            uncompressed = _best_of(lambda: read(plain, 0), repeats)
            out[label] = {
                "zstd_shards_gb_s": feature_bytes / compressed / GB,
                "zstd_shards_background_thread_gb_s": feature_bytes / background / GB,
                "uncompressed_gb_s": feature_bytes / uncompressed / GB,
                "zstd_vs_uncompressed": uncompressed / compressed,  # throughput ratio zstd / uncompressed
            }
    finally:
        pa.set_cpu_count(default_threads)
    out["per_core_gb_s"] = out["1thread"]["zstd_shards_gb_s"]
    out["stages_1thread"] = reader_breakdown(shard_dir, repeats)
    return out


# ---------------------------------------------------------------------------------------------
# score: offline replay vs the reference online loop


def count_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def flop_model(target, drafter_cfg, head_shape) -> dict:
    """Parameter counts the FLOP formulas use (see bench/README.md)."""
    from pipeline.target import decoder_layers, text_config

    vocab, hidden = head_shape
    layers = decoder_layers(target)
    tcfg = text_config(target)
    target_layers = count_params(layers)
    target_norm = count_params(target.model.norm) if hasattr(target, "model") and hasattr(target.model, "norm") else 0
    t_heads, t_head_dim = tcfg.num_attention_heads, getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
    d = drafter_cfg
    q = d.hidden_size * d.num_attention_heads * d.head_dim
    kv = d.hidden_size * d.num_key_value_heads * d.head_dim
    layer = 2 * q + 2 * kv + 3 * d.hidden_size * d.intermediate_size  # q, o, k, v, mlp (norms ignored)
    return {
        "target_layer_params": target_layers + target_norm,
        "target_layers": len(layers),
        "target_attn_width": t_heads * t_head_dim,
        "lm_head_params": vocab * hidden,
        "drafter_layer_params": layer * d.num_hidden_layers,
        "drafter_layers": d.num_hidden_layers,
        "drafter_attn_width": d.num_attention_heads * d.head_dim,
        "drafter_ctx_params": (len(d.target_layer_ids) * d.hidden_size * d.hidden_size) + 2 * kv * d.num_hidden_layers,
    }


def online_flops(m: dict, prompt_len: int, steps: list[tuple[int, int]]) -> float:
    """Floating-point work of one dflash_generate run: prefill + per step (target verify over the
    block incl. its lm_head on every block row, drafter layers over the block, drafter lm_head on
    block rows 1.., new context through fc/k/v). steps = [(start, verify_size)]. Attention
    (QK^T and PV, 4 * width * keys per query per layer) included."""
    flops = 2.0 * m["target_layer_params"] * prompt_len + 2.0 * m["lm_head_params"]  # prefill, logits_to_keep=1
    flops += 4.0 * m["target_layers"] * m["target_attn_width"] * prompt_len * (prompt_len + 1) / 2
    ctx_done = 0
    for start, size in steps:
        flops += 2.0 * (m["target_layer_params"] + m["lm_head_params"]) * size
        flops += 4.0 * m["target_layers"] * m["target_attn_width"] * size * (start + size)
        if size > 1:
            flops += 2.0 * m["drafter_ctx_params"] * (start - ctx_done)  # context added since last step
            ctx_done = start
            flops += 2.0 * m["drafter_layer_params"] * size + 2.0 * m["lm_head_params"] * (size - 1)
            flops += 4.0 * m["drafter_layers"] * m["drafter_attn_width"] * size * (start + size)
    return flops


def offline_flops(m: dict, ctx_len: int, anchors: np.ndarray, block_lens: np.ndarray) -> float:
    """Floating-point work the replay needs for one sample: context K/V once, then per anchor
    the drafter layers over its block and the lm_head on block rows 1.. ((B-1) x V x H)."""
    flops = 2.0 * m["drafter_ctx_params"] * ctx_len
    b = block_lens.astype(np.float64)
    flops += float((2.0 * m["drafter_layer_params"] * b + 2.0 * m["lm_head_params"] * (b - 1)).sum())
    flops += float((4.0 * m["drafter_layers"] * m["drafter_attn_width"] * b * (anchors + b)).sum())
    return flops


def score_cli_peak_rss(ckpt: str, shard_dir: str, out: str) -> dict:
    """`specreplay score` (default DDTree budgets) in a fresh process: its peak RSS and wall
    time including interpreter start-up. The peak is the child's VmHWM, polled every 20 ms
    (getrusage's ru_maxrss of a forked child would include this process's RSS at fork time)."""
    import subprocess

    cmd = [sys.executable, "-m", "pipeline.cli", "score", "--ckpt", ckpt, "--shards", shard_dir, "--out", out,
           "--quiet", "--force"]
    start = time.perf_counter()
    peak = 0
    with subprocess.Popen(cmd, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as child:
        status, cmdline = f"/proc/{child.pid}/status", f"/proc/{child.pid}/cmdline"
        while child.poll() is None:
            try:
                with open(cmdline, "rb") as f:  # before exec the forked child still shares our pages
                    if b"pipeline.cli" not in f.read():
                        time.sleep(0.005)
                        continue
                with open(status) as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            peak = max(peak, int(line.split()[1]) * 1024)
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        stderr = child.stderr.read()
    wall = time.perf_counter() - start
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-2000:]}")
    return {"wall_s_incl_startup": wall, "peak_rss_bytes": peak or None,
            "command": "specreplay score --ckpt CKPT --shards SHARDS --out OUT --quiet --force"}


def walk_lists(walk_path: str) -> dict[str, list[int]]:
    import polars as pl

    walk = pl.read_parquet(walk_path, glob=False).filter(pl.col("method") == "chain").sort("sample_id", "step")
    return {sid: g["produced"].to_list() for (sid,), g in walk.group_by("sample_id", maintain_order=True)}


def bench_score(args, work: Path, shard_dir: str) -> dict:
    import polars as pl

    import dflash.model as reference
    from pipeline.shards import ShardSet
    from pipeline.target import load_target
    from scoring.drafter import parse_drafter_config
    from scoring.fit import FitOptions, fit_drafter, new_drafter_config, save_drafter
    from scoring.score import DEFAULT_BUDGETS, ScoreConfig, run_score

    reference._cuda_time = time.perf_counter  # its stats timer calls torch.cuda.synchronize

    shardset = ShardSet(shard_dir)
    settings = shardset.settings
    head = shardset.target_head()
    samples = list(shardset.samples(tensors=["features"], prefetch=0))
    # One drafter layer over all five stored feature layers (a 1-layer formula default would ask
    # for layer 15, which the default extract does not store).
    raw = new_drafter_config(settings["target"], num_layers=1, block_size=args.block_size,
                             layer_ids=list(settings["layer_ids"]))
    log(f"score: fitting a 1-layer drafter, block {args.block_size}, {args.fit_steps} steps x "
        f"{args.fit_anchors} anchors on {len(samples)} samples ...")
    losses = []

    def progress(step, loss):
        losses.append(loss)
        if step % max(1, args.fit_steps // 4) == 0:
            log(f"score:   fit step {step}/{args.fit_steps} loss {loss:.3f}")

    with Phase() as fit_phase:
        drafter, _ = fit_drafter(samples, head, settings["layer_ids"], raw, None,
                                 FitOptions(steps=args.fit_steps, lr=args.fit_lr, anchors_per_step=args.fit_anchors),
                                 progress)
        ckpt = save_drafter(drafter, str(work / "drafter"))
    del drafter, samples

    result = {"block_size": args.block_size, "drafter_layers": 1, "drafter_layer_ids": list(settings["layer_ids"]),
              "fit": {"steps": args.fit_steps, "anchors_per_step": args.fit_anchors, "lr": args.fit_lr,
                      "seconds": fit_phase.seconds, "final_loss": losses[-1] if losses else None,
                      "others_cpu": fit_phase.others_cpu},
              "checkpoint": ckpt, "threads": torch.get_num_threads()}

    def offline(budgets, label, anchor_set="all", shards=shard_dir):
        out = work / f"results-{label}"
        log(f"score: offline specreplay score ({label}, budgets {list(budgets) or 'none'}, anchors {anchor_set}) ...")
        with Phase() as phase:
            records = run_score(ScoreConfig(ckpts=[ckpt], shards=shards, out=str(out), anchors=anchor_set,
                                            ddtree_budgets=list(budgets), quiet=True, force=True))
        anchors = records[0]["anchors"]
        log(f"score:   {phase.seconds:.1f}s, {anchors} anchors, {anchors / phase.seconds:.0f} anchors/s "
            f"(other processes: {phase.others_cpu} cores)")
        return out, {"wall_s": phase.seconds, "anchors": anchors, "anchors_per_s": anchors / phase.seconds,
                     "others_cpu": phase.others_cpu,
                     "peak_rss_bytes": phase.peak_rss, "rss_before_bytes": phase.rss_before,
                     "budgets": list(budgets), "anchor_set": anchor_set}

    # Each side is warmed on one sample first (imports, first-call allocations). Order: offline
    # chain, online, offline chain + DDTree, offline chain again (min of the two). The target is
    # loaded only around the online loop, so the offline peak RSS does not include it.
    log("score: warm-up offline (1 sample) ...")
    run_score(ScoreConfig(ckpts=[ckpt], shards=shard_dir, out=str(work / "results-warmup"), ddtree_budgets=[4],
                          quiet=True, force=True, limit=1))
    chain_dir, result["offline_chain"] = offline((), "chain")

    log("score: warm-up online (1 prompt, 16 new tokens) ...")
    target, _, info = load_target("smollm2", dtype="fp32")
    draft = reference.DFlashDraftModel.from_pretrained(ckpt, dtype=torch.float32).eval()
    first = next(iter(shardset.samples(tensors=[], prefetch=0)))
    reference.dflash_generate(draft, target, first.input_ids[: first.prompt_len][None], 16,
                              list(settings["target"]["stop_token_ids"]), return_stats=True)
    log("score: reference online loop dflash_generate (same prompts, same checkpoint) ...")
    stop_ids = list(settings["target"]["stop_token_ids"])
    max_new = int(settings["max_new_tokens"])
    online, mismatched_tokens = {}, []
    steps_by_sample = {}
    with Phase() as online_phase:
        for sample in shardset.samples(tensors=[], prefetch=0):
            prompt = sample.input_ids[: sample.prompt_len][None]
            stats = reference.dflash_generate(draft, target, prompt, max_new, stop_ids, return_stats=True)
            online[sample.sample_id] = list(stats.acceptance_lengths)
            if stats.output_ids[0].tolist() != sample.input_ids.tolist():
                mismatched_tokens.append(sample.sample_id)
            start, steps = sample.prompt_len, []
            for produced in stats.acceptance_lengths:
                steps.append((start, min(args.block_size, sample.prompt_len + max_new - start)))
                start += produced
            steps_by_sample[sample.sample_id] = (sample.prompt_len, steps)
    online_tokens = sum(sum(v) for v in online.values())
    online_steps = sum(len(v) for v in online.values())
    log(f"score:   {online_phase.seconds:.1f}s, {online_steps} steps, {online_tokens} tokens "
        f"(other processes: {online_phase.others_cpu} cores)")
    result["online"] = {"wall_s": online_phase.seconds, "steps": online_steps, "tokens": online_tokens,
                        "tokens_per_s": online_tokens / online_phase.seconds,
                        "peak_rss_bytes": online_phase.peak_rss, "rss_before_bytes": online_phase.rss_before,
                        "others_cpu": online_phase.others_cpu,
                        "tau": float(np.mean([np.mean(v) for v in online.values() if v]))}
    model = flop_model(target, parse_drafter_config(json.loads(Path(ckpt, "config.json").read_text())),
                       tuple(head["lm_head"].shape))
    del target, draft
    import gc

    gc.collect()

    budgets = tuple(args.ddtree_budgets or DEFAULT_BUDGETS)
    full_dir, result["offline_ddtree"] = offline(budgets, "chain+ddtree")
    _, again = offline((), "chain-rep2")
    # Walk-only mode: only the anchors the simulated walks visit (issue 4 item 2).
    walk_chain_dir, result["offline_walk_chain"] = offline((), "walk-chain", "walk")
    walk_full_dir, result["offline_walk_ddtree"] = offline(budgets, "walk-chain+ddtree", "walk")
    log("score: `specreplay score` in a fresh process, for its peak RSS ...")
    result["cli_subprocess"] = score_cli_peak_rss(ckpt, shard_dir, str(work / "results-cli"))
    log(f"score:   peak RSS {fmt_bytes(result['cli_subprocess']['peak_rss_bytes'])}, "
        f"{result['cli_subprocess']['wall_s_incl_startup']:.1f}s including start-up")
    result["offline_chain"]["runs_s"] = [result["offline_chain"]["wall_s"], again["wall_s"]]
    if again["wall_s"] < result["offline_chain"]["wall_s"]:
        again["runs_s"] = result["offline_chain"]["runs_s"]
        result["offline_chain"] = again

    # parity: the walk's produced lists equal the online acceptance_lengths, for every prompt
    walks = {label: walk_lists(str(d / "walk.parquet"))
             for label, d in (("chain", chain_dir), ("ddtree", full_dir), ("walk", walk_chain_dir),
                              ("walk_ddtree", walk_full_dir))}
    equal = {label: sum(w.get(sid, []) == lengths for sid, lengths in online.items()) for label, w in walks.items()}
    every_method = [pl.read_parquet(str(d / "walk.parquet"), glob=False).select("sample_id", "method", "step", "produced")
                    .sort("sample_id", "method", "step") for d in (full_dir, walk_full_dir)]
    result["parity"] = {"prompts": len(online), "walk_equal_chain_only_run": equal["chain"],
                        "walk_equal_chain_ddtree_run": equal["ddtree"],
                        "walk_equal_walk_only_run": equal["walk"],
                        "walk_equal_walk_only_ddtree_run": equal["walk_ddtree"],
                        "walk_only_equals_all_anchor_every_method": every_method[0].equals(every_method[1]),
                        "output_tokens_differ": mismatched_tokens,
                        "all_equal": len(set(equal.values())) == 1 and equal["chain"] == len(online)}
    summary = pl.read_parquet(str(full_dir / "summary.parquet"), glob=False).filter(pl.col("dataset") == "(all)")
    result["tau"] = {row["method"]: row["tau"] for row in summary.iter_rows(named=True)}

    # floating-point work, per sample then summed
    anchors = pl.read_parquet(str(chain_dir / "anchors.parquet"), glob=False)
    # Offline work per run from the anchors it replayed (walk mode: the visited ones); DDTree
    # runs are counted with the chain's per-anchor work, a lower bound on theirs.
    anchor_sets = {"offline_chain": anchors, "offline_ddtree": anchors,
                   "offline_walk_chain": pl.read_parquet(str(walk_chain_dir / "anchors.parquet"), glob=False),
                   "offline_walk_ddtree": pl.read_parquet(str(walk_full_dir / "anchors.parquet"), glob=False)}
    on = 0.0
    offline_work = {key: 0.0 for key in anchor_sets}
    for sample in shardset.samples(tensors=[], prefetch=0):
        prompt_len, steps = steps_by_sample[sample.sample_id]
        on += online_flops(model, prompt_len, steps)
        for key, table_ in anchor_sets.items():
            rows = table_.filter(pl.col("sample_id") == sample.sample_id)
            offline_work[key] += offline_flops(model, sample.input_ids.numel() - 2, rows["anchor"].to_numpy(),
                                               rows["block_len"].to_numpy())
    off = offline_work["offline_chain"]
    result["flops"] = {"model": model, "online": on, "offline": off, "work_ratio": on / off,
                       "offline_by_run": offline_work}
    result["walk_only_vs_all_anchor"] = {
        "chain_wall_ratio": result["offline_chain"]["wall_s"] / result["offline_walk_chain"]["wall_s"],
        "ddtree_wall_ratio": result["offline_ddtree"]["wall_s"] / result["offline_walk_ddtree"]["wall_s"],
        "chain_anchor_ratio": result["offline_chain"]["anchors"] / result["offline_walk_chain"]["anchors"],
        "ddtree_anchor_ratio": result["offline_ddtree"]["anchors"] / result["offline_walk_ddtree"]["anchors"]}
    for key in ("offline_chain", "offline_ddtree", "offline_walk_chain", "offline_walk_ddtree"):
        work_ = offline_work[key]
        speedup = online_phase.seconds / result[key]["wall_s"]
        result[key]["speedup_vs_online"] = speedup
        result[key]["work_ratio"] = on / work_
        result[key]["speedup_over_work_ratio"] = speedup / (on / work_)
        result[key]["gflop_s"] = work_ / result[key]["wall_s"] / 1e9
    result["online"]["gflop_s"] = on / online_phase.seconds / 1e9
    result["chain_walks"] = walks["ddtree"]
    return result


def bench_fp8(args, work: Path, ckpt: str, lossless: dict) -> dict:
    """Opt-in lossy features (issue 4 item 4): the score prompts extracted again from the fp32
    target with `--feature-dtype fp8` (e4m3, one scale per token and layer), stored bytes against
    raw bf16, and the same checkpoint scored on them: tau per method against the lossless run."""
    import polars as pl

    from pipeline.extract import ExtractConfig, run_extract
    from scoring.score import DEFAULT_BUDGETS, ScoreConfig, run_score

    out = work / "shards-fp8"
    log("fp8: extract with --feature-dtype fp8 (fp32 target, score prompts) ...")
    with Phase() as phase:
        run_extract(ExtractConfig(model="smollm2", prompts=args.prompt_set, limit=args.score_prompts, out=str(out),
                                  max_new_tokens=args.max_new_tokens, dtype="fp32", feature_dtype="fp8",
                                  overwrite=True, quiet=True, batch_size=args.batch_size))
    result = {"extract_s": phase.seconds, "storage": stored_bytes(str(out))}
    log(f"fp8:   features {result['storage']['features_vs_raw_bf16']:.3f} of raw bf16; scoring ...")
    budgets = list(args.ddtree_budgets or DEFAULT_BUDGETS)
    results_dir = work / "results-fp8"
    run_score(ScoreConfig(ckpts=[ckpt], shards=str(out), out=str(results_dir), ddtree_budgets=budgets,
                          quiet=True, force=True))
    summary = pl.read_parquet(str(results_dir / "summary.parquet"), glob=False).filter(pl.col("dataset") == "(all)")
    tau = {row["method"]: row["tau"] for row in summary.iter_rows(named=True)}
    result["tau"] = tau
    result["tau_lossless"] = lossless["tau"]
    result["tau_change"] = {m: tau[m] - lossless["tau"][m] for m in tau if lossless["tau"].get(m) is not None}
    fp8_walk = walk_lists(str(results_dir / "walk.parquet"))
    lossless_walk = lossless["chain_walks"]
    result["chain_walks_identical"] = sum(fp8_walk.get(k) == v for k, v in lossless_walk.items())
    result["samples"] = len(lossless_walk)
    return result


def profile_offline(work: Path, shard_dir: str, ckpt: str, samples: int = 2, top: int = 12) -> list[str]:
    """torch.profiler over a chain-only offline score of a few samples: aten ops by own CPU time
    with their input shapes (where the time goes when the speed-up target is missed)."""
    from torch.profiler import ProfilerActivity, profile

    from scoring.score import ScoreConfig, run_score

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run_score(ScoreConfig(ckpts=[ckpt], shards=shard_dir, out=str(work / "results-profile"), ddtree_budgets=[],
                              quiet=True, force=True, limit=samples))
    table_text = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=24, max_shapes_column_width=60)
    return [line for line in table_text.splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# report


def table(results: dict) -> str:
    rows: list[tuple[str, ...]] = []
    flagged = []

    def add(name, value, target="", met=None, others=None, sides=()):
        if isinstance(others, (list, tuple)):
            others = "/".join("-" if o is None else f"{o:.1f}" for o in others)
        elif others is not None:
            others = f"{others:.1f}"
        verdict = "" if met is None else ("yes" if met else "NO")
        if verdict and any(o is not None and o > CONTENDED_CORES for o in sides):
            verdict += "*"
            flagged.append(name.strip())
        rows.append((name, value, target, verdict, others or ""))

    ex = results.get("extract_bf16")
    if ex:
        add(f"extract bf16: {ex['prompts']} prompts, {ex['tokens']} tokens ({ex['response_tokens']} generated)", "", "")
        add("  bare generate + forward (min)", f"{ex['bare_min_s']:.1f} s (runs " +
            ", ".join(f"{r['total_s']:.1f}" for r in ex["bare_runs"]) + ")",
            others=[r.get("others_cpu") for r in ex["bare_runs"]])
        add("  specreplay extract, target preloaded (min)", f"{ex['extract_min_s']:.1f} s (runs " +
            ", ".join(f"{r:.1f}" for r in ex["extract_runs_s"]) + ")", others=ex["extract_runs_others_cpu"])
        add("  extract overhead (extract / bare)", f"{ex['overhead_ratio']:.3f}x", "<= 1.05",
            ex["overhead_ratio"] <= TARGETS["extract_overhead_ratio"],
            sides=[r.get("others_cpu") for r in ex["bare_runs"]] + list(ex["extract_runs_others_cpu"]))
        b = ex["extract_breakdown_of_min"]
        own = b["wall_s"] - b["generate"] - min(r["forward_full_logits_s"] for r in ex["bare_runs"])
        add("  pipeline's own time (extract - its generate - bare forward) / bare",
            f"{own:.2f} s = {own / ex['bare_min_s']:.3f} (generate: extract {b['generate']:.2f} s, "
            f"bare {min(r['generate_s'] for r in ex['bare_runs']):.2f} s)")
        add("  ... vs bare with response-only logits", f"{ex['overhead_ratio_vs_response_logits']:.3f}x")
        add("  extract incl. model load", f"{ex['extract_incl_model_load_s']:.1f} s")
        add("  stored responses == bare generate", str(ex["responses_equal_bare"]))
    st = results.get("storage_bf16")
    if st:
        add("  features bytes/token vs raw bf16 (lossless)",
            f"{st['features_bytes_per_token']:.0f}/{st['raw_bf16_features_bytes_per_token']} = {st['features_vs_raw_bf16']:.3f}",
            "<= 0.67", st["features_vs_raw_bf16"] <= TARGETS["feature_bytes_vs_raw_bf16"])
        add(f"  top-{st['topk_k']} ids+logprobs bytes/row vs raw",
            f"{st['topk_bytes_per_row']:.0f}/{st['raw_topk_bytes_per_row']} = {st['topk_vs_raw_topk']:.3f}")
        add("  top-k vs full-vocab bf16 logits", f"{st['topk_vs_full_bf16_logits']:.5f}")
        add("  whole shard bytes/token", f"{st['shard_bytes_per_token']:.0f}")
    st32 = results.get("storage_fp32")
    if st32:
        add("  fp32 (CPU default) features vs raw fp32 / raw bf16",
            f"{st32['features_vs_raw_same_dtype']:.3f} / {st32['features_vs_raw_bf16']:.3f}")
    ex32 = results.get("extract_fp32")
    if ex32 and "overhead_ratio" in ex32:
        add("  fp32 extract overhead (extract / bare)", f"{ex32['overhead_ratio']:.3f}x")
    co = results.get("codecs")
    if co:
        add(f"feature codecs ({co['dtype']}, {co['raw_bytes'] / MiB:.0f} MiB real features, {co['tokens']} tokens, "
            f"1 thread): fraction of raw, zstd decode", "", others=co.get("others_cpu"))
        shipped = co["shipped_layout"]
        for layout, label in (("interleaved", "plain zstd, per sample"),
                              ("v1_row_planes_per_sample", "format v1: row-major byte planes, per sample"),
                              ("channel_planes_per_sample", "channel-major byte planes, per sample"),
                              ("v2_chunks_1024", "channel-major planes, 1024-token chunks"),
                              (shipped, f"format v2 (shipped): channel-major planes, {shipped.split('_')[-1]}-token chunks"),
                              ("v2_one_chunk_all", "channel-major planes, all samples in one chunk")):
            for level in (1, 3):
                e = co[f"{layout}_zstd{level}"]
                mark = " <- shards" if layout == shipped and level == 1 else ""
                add(f"  {label}, zstd-{level}{mark}", f"{e['fraction_of_raw']:.3f} ({e['ratio']:.3f}x), "
                    f"{e['zstd_decode_gb_s']:.2f} GB/s")
        e = co[f"{shipped}_zstd1"]
        add("  shipped decode: zstd + planes to tensor", f"{e['decode_gb_s']:.2f} GB/s "
            f"(planes to tensor alone {e['planes_to_tensor_gb_s']:.1f} GB/s)")
        if "order0_entropy_ratio" in co:
            add("  order-0 entropy of the 16-bit values", f"{co['order0_entropy_bits']:.2f} bits = "
                f"{1 / co['order0_entropy_ratio']:.3f} of raw")
            add("  per-channel sign/exponent/mantissa entropy", f"{co['per_channel_field_entropy_bits']:.2f} bits = "
                f"{1 / co['per_channel_field_entropy_ratio']:.3f} of raw")
    rd = results.get("reader")
    if rd:
        one = rd["1thread"]
        add("shard reader (ShardSet.samples, features)", "", others=rd.get("others_cpu"))
        add("  zstd shards, 1 thread", f"{one['zstd_shards_gb_s']:.2f} GB/s", ">= 1 GB/s/core",
            rd["per_core_gb_s"] >= TARGETS["shard_decode_gb_s_per_core"], sides=[rd.get("others_cpu")])
        add("  same chunks uncompressed, 1 thread", f"{one['uncompressed_gb_s']:.2f} GB/s")
        add("  zstd / uncompressed throughput", f"{one['zstd_shards_gb_s'] / one['uncompressed_gb_s']:.2f}")
        b = rd["stages_1thread"]
        add("  stages: xxh3 / arrow read / zstd frame / planes to tensor",
            f"{b['checksum_xxh3_gb_s']:.1f} / {b['arrow_ipc_read_gb_s']:.0f} / {b['zstd_frame_gb_s']:.2f} / "
            f"{b['planes_to_tensor_gb_s']:.2f} GB/s")
        other = [k for k in rd if k.endswith("threads")]
        for k in other:
            add(f"  zstd shards, arrow {k}, background thread", f"{rd[k]['zstd_shards_background_thread_gb_s']:.2f} GB/s")
    sc = results.get("score")
    if sc:
        add(f"score fp32: {sc['parity']['prompts']} prompts, 1-layer drafter, block {sc['block_size']}, "
            f"fit {sc['fit']['steps']} steps ({sc['fit']['seconds']:.0f} s)", "", others=sc["fit"].get("others_cpu"))
        on = sc["online"]
        add("  online dflash_generate", f"{on['wall_s']:.1f} s, {on['steps']} steps, tau {on['tau']:.2f}",
            others=on.get("others_cpu"))
        for key, label in (("offline_chain", "offline score, chain only"),
                           ("offline_ddtree", "offline score, chain + DDTree"),
                           ("offline_walk_chain", "offline score --anchors walk, chain only"),
                           ("offline_walk_ddtree", "offline score --anchors walk, chain + DDTree")):
            o = sc[key]
            add(f"  {label}", f"{o['wall_s']:.1f} s, {o['anchors']} anchors, {o['anchors_per_s']:.0f} anchors/s",
                others=o.get("others_cpu"))
            add("    peak RSS (process; + over phase start)", rss_text(o))
        add("  online peak RSS (process; + over phase start)", rss_text(on))
        cli = sc.get("cli_subprocess")
        if cli:
            add("  `specreplay score` in a fresh process: peak RSS", f"{fmt_bytes(cli['peak_rss_bytes'])} "
                f"({cli['wall_s_incl_startup']:.1f} s incl. start-up, default DDTree budgets)")
        ratio = sc["flops"]["work_ratio"]
        add("  FLOP ratio online / offline", f"{ratio:.2f}x "
            f"({sc['flops']['online'] / 1e9:.0f} / {sc['flops']['offline'] / 1e9:.0f} GFLOP)")
        for key, label in (("offline_chain", "chain only"), ("offline_ddtree", "chain + DDTree"),
                           ("offline_walk_chain", "walk-only, chain"), ("offline_walk_ddtree", "walk-only, chain + DDTree")):
            o = sc[key]
            add(f"  measured speed-up, {label}", f"{o['speedup_vs_online']:.2f}x", f">= {o['work_ratio']:.2f}x",
                o["speedup_over_work_ratio"] >= TARGETS["score_speedup_vs_work_ratio"],
                sides=[o.get("others_cpu"), on.get("others_cpu")])
        add("  useful GFLOP/s online / offline chain / walk-only chain",
            f"{on['gflop_s']:.0f} / {sc['offline_chain']['gflop_s']:.0f} / {sc['offline_walk_chain']['gflop_s']:.0f}")
        w = sc["walk_only_vs_all_anchor"]
        add("  all-anchor / walk-only: anchors, wall (chain; +DDTree)",
            f"{w['chain_anchor_ratio']:.2f}x, {w['chain_wall_ratio']:.2f}x; {w['ddtree_anchor_ratio']:.2f}x, "
            f"{w['ddtree_wall_ratio']:.2f}x")
        p = sc["parity"]
        add("  walk produced == online acceptance_lengths",
            f"{p['walk_equal_chain_only_run']}/{p['prompts']} (chain run), {p['walk_equal_chain_ddtree_run']}/{p['prompts']} "
            f"(+DDTree), {p['walk_equal_walk_only_run']}/{p['prompts']} (walk-only), "
            f"{p['walk_equal_walk_only_ddtree_run']}/{p['prompts']} (walk-only +DDTree)", "all", p["all_equal"])
        add("  walk-only == all-anchor walks, every method", str(p["walk_only_equals_all_anchor_every_method"]), "yes",
            p["walk_only_equals_all_anchor_every_method"])
        taus = sc["tau"]
        add("  tau (walk)", ", ".join(f"{k} {v:.2f}" for k, v in taus.items() if v is not None))
    f8 = results.get("fp8")
    if f8:
        st8 = f8["storage"]
        add(f"fp8 features (--feature-dtype fp8, lossy), {f8['samples']} score prompts", "")
        add("  features bytes/token vs raw bf16", f"{st8['features_bytes_per_token']:.0f}/"
            f"{st8['raw_bf16_features_bytes_per_token']} = {st8['features_vs_raw_bf16']:.3f}")
        add("  tau fp8 - tau lossless", ", ".join(f"{k} {v:+.3f}" for k, v in f8["tau_change"].items()))
        add("  chain walks identical to lossless", f"{f8['chain_walks_identical']}/{f8['samples']}")
    if not rows:
        return "(no sections of this table ran)"
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    header = ("figure", "value", "target", "met", "others' CPU")
    widths = [max(w, len(h)) for w, h in zip(widths, header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if flagged:
        lines.append(f"* other processes used more than {CONTENDED_CORES} cores during a side of this comparison "
                     f"(column others' CPU): the verdict is not trustworthy; rerun on a quiet machine. "
                     f"({'; '.join(flagged)})")
    return "\n".join(lines)


def environment() -> dict:
    import transformers

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"date": _dt.date.today().isoformat(), "cpu": cpu, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.is_available(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="specreplay benchmark: prints one table, writes bench/results/bench-<date>.json")
    parser.add_argument("--quick", action="store_true", help="a smaller run (~3 min on 2 cores)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts from the set (default 16; quick 4)")
    parser.add_argument("--score-prompts", type=int, default=None,
                        help="prompts of the score section (the first of the set; default min(8, --prompts))")
    parser.add_argument("--prompt-set", default="default", help="bundled set name or JSONL path (default: default)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 128; quick 48")
    parser.add_argument("--batch-size", type=int, default=8, help="extract/bare generate batch size")
    parser.add_argument("--reps", type=int, default=None, help="bare/extract alternations (default 2)")
    parser.add_argument("--block-size", type=int, default=16, help="drafter block size (default 16)")
    parser.add_argument("--fit-steps", type=int, default=None, help="drafter fit steps (default 400; quick 100)")
    parser.add_argument("--fit-anchors", type=int, default=16, help="anchors per fit step")
    parser.add_argument("--fit-lr", type=float, default=3e-3)
    parser.add_argument("--ddtree-budgets", type=lambda s: [int(x) for x in s.split(",") if x], default=None,
                        help="DDTree budgets of the chain+DDTree score run (default: score's default)")
    parser.add_argument("--skip", default="",
                        help="comma-separated sections to skip: extract,codecs,reader,score,fp32,fp8,big,length")
    parser.add_argument("--profile", action="store_true", help="profile the offline score even when targets are met")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results directory")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (shards, drafter, results)")
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (4 if args.quick else 16)
    args.score_prompts = min(args.score_prompts or 8, args.prompts)
    args.max_new_tokens = args.max_new_tokens or (48 if args.quick else 128)
    args.reps = args.reps or 2
    args.fit_steps = args.fit_steps or (100 if args.quick else 400)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    global OTHERS
    OTHERS = OthersCpu().start()
    out_dir, stamp, work = start_run(args.out, "work")
    results: dict = {"args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()},
                     "env": environment(), "loadavg_start": loadavg(), "targets": TARGETS}
    log(f"bench: {'quick' if args.quick else 'full'} run, {args.prompts} prompts, {args.max_new_tokens} new tokens, "
        f"{torch.get_num_threads()} torch threads, load average {results['loadavg_start']}, work dir {work}")
    try:
        if "extract" not in args.skip:
            results["extract_bf16"] = bench_extract(args, work, "bf16", args.prompts, args.reps)
            results["storage_bf16"] = stored_bytes(results["extract_bf16"]["out"])
            log(f"storage: features {results['storage_bf16']['features_vs_raw_bf16']:.3f} of raw bf16")
            if "codecs" not in args.skip:
                log("codecs: plain zstd vs byte planes + zstd on the real features ...")
                with Phase() as phase:
                    results["codecs"] = codec_comparison(results["extract_bf16"]["out"])
                results["codecs"]["others_cpu"] = phase.others_cpu
            if "reader" not in args.skip:
                log("reader: ShardSet.samples vs the same chunks uncompressed ...")
                with Phase() as phase:
                    results["reader"] = reader_throughput(results["extract_bf16"]["out"], work)
                results["reader"]["others_cpu"] = phase.others_cpu
        if "score" not in args.skip:
            # fp32, the CPU default: exact parity with the fp32 online loop (SPEC §5).
            fp32_reps = 0 if "fp32" in args.skip else 1
            results["extract_fp32"] = bench_extract(args, work, "fp32", args.score_prompts, max(1, fp32_reps),
                                                    with_bare=fp32_reps > 0)
            results["storage_fp32"] = stored_bytes(results["extract_fp32"]["out"])
            results["score"] = bench_score(args, work, results["extract_fp32"]["out"])
            missed = results["score"]["offline_chain"]["speedup_over_work_ratio"] < 1
            if missed or args.profile:
                log("score: torch.profiler over a chain-only offline score of 2 samples ...")
                results["score"]["profile_offline_chain"] = profile_offline(
                    work, results["extract_fp32"]["out"], results["score"]["checkpoint"])
            if "fp8" not in args.skip:
                results["fp8"] = bench_fp8(args, work, results["score"]["checkpoint"], results["score"])
        scale_sections = [name for name in ("big", "length") if name not in args.skip]
        if scale_sections:
            import scale  # bench/scale.py: 27B-shaped memory, cost against response length

            if "length" in scale_sections:
                results["length_scaling"] = scale.bench_length_scaling(work, args.quick)
            if "big" in scale_sections:
                results["big_shapes"] = scale.bench_big_shapes(work, args.quick)
    finally:
        results["others_cpu_whole_run"] = OTHERS.stop()
        path = finish_run(results, out_dir, f"bench-{stamp}", work, args.keep)
    print()
    print(table(results))
    if results.get("big_shapes") or results.get("length_scaling"):
        import scale

        print()
        print(scale.scale_table(results))
    if "profile_offline_chain" in results.get("score", {}):
        print("\noffline score profile (chain only, 2 samples, torch.profiler, aten ops by own CPU time):")
        print("\n".join(results["score"]["profile_offline_chain"]))
    print(f"\nother processes used {results['others_cpu_whole_run']} cores on average during this run "
          f"({os.cpu_count()} CPUs); load average {results['loadavg_start']} -> {results['loadavg_end']}; "
          f"total {results['wall_s']:.0f} s; written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
