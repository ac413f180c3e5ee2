"""Section `codecs`: compressed size and single-thread zstd decode speed of the real extracted
bf16 features under several byte layouts, at zstd levels 1 and 3: plain zstd per sample, and
format v2's channel-major byte planes as the product's writer lays them out (written
uncompressed, then compressed here) with one sample per chunk, 1024-token chunks, the shipped
chunk size and everything in one chunk; for the shipped layout also planes back to a tensor
(`decode_tensor`, checked bit for bit). This is why shards use 4096-token chunks at level 1.
Format v1 and the entropy bounds are research (`--research`, bench/sections/research.py)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench.common import GB, MiB, Phase, Rows, best_of, log
from bench.sections.reader import chunk_frames, uncompressed_copy


def features_of(shard_dir: str) -> list[torch.Tensor]:
    from pipeline.shards import ShardSet

    return [s.features.contiguous() for s in ShardSet(shard_dir).samples(tensors=["features"], prefetch=0)]


def writer_planes(shard_dir: str, dest: Path, chunk_tokens: int) -> list[tuple[bytes, list[int]]]:
    """Byte planes of the features as the product's writer lays them out with chunks of
    `chunk_tokens` (written uncompressed, so a chunk's frame is its planes): (planes, shape)."""
    return chunk_frames(uncompressed_copy(shard_dir, dest, chunk_tokens))


def measure_layout(buffers: list[bytes], raw_total: int, level: int, repeats: int) -> tuple[dict, list[bytes]]:
    """Size and speed of zstd at `level` over `buffers` (one frame each); returns the frames too."""
    import zstandard

    compressor = zstandard.ZstdCompressor(level=level)
    decompressor = zstandard.ZstdDecompressor()
    start = time.perf_counter()
    frames = [compressor.compress(b) for b in buffers]
    compress_s = time.perf_counter() - start
    size = sum(len(f) for f in frames)
    decode_s = best_of(lambda: [decompressor.decompress(f) for f in frames], repeats)
    return {
        "bytes": size,
        "ratio": raw_total / size,
        "fraction_of_raw": size / raw_total,
        "compress_gb_s": raw_total / compress_s / GB,
        "zstd_decode_gb_s": raw_total / decode_s / GB,
        "zstd_decode_s": decode_s,
    }, frames


def codec_comparison(shard_dir: str, work: Path, repeats: int = 3) -> dict:
    import zstandard

    from pipeline.shards import DEFAULT_CHUNK_TOKENS, decode_tensor

    features = features_of(shard_dir)
    dtype = features[0].dtype
    raw_total = sum(f.numel() * f.element_size() for f in features)
    tokens = sum(f.shape[0] for f in features)
    shipped = f"v2_chunks_{DEFAULT_CHUNK_TOKENS}"
    out = {
        "dtype": str(dtype).replace("torch.", ""),
        "tensors": len(features),
        "raw_bytes": raw_total,
        "tokens": tokens,
        "shipped_layout": shipped,
    }
    # chunk_tokens 1: every sample a chunk of its own; `tokens`: everything in one chunk
    chunkings = {
        "channel_planes_per_sample": 1,
        "v2_chunks_1024": 1024,
        shipped: DEFAULT_CHUNK_TOKENS,
        "v2_one_chunk_all": tokens,
    }
    planes = {name: writer_planes(shard_dir, work / f"planes-{name}", size) for name, size in chunkings.items()}
    layouts = {
        "interleaved": [f.view(torch.uint8).numpy().tobytes() for f in features],
        **{name: [p for p, _ in chunks] for name, chunks in planes.items()},
    }
    decompressor = zstandard.ZstdDecompressor()
    for layout, buffers in layouts.items():
        for level in (1, 3):
            entry, frames = measure_layout(buffers, raw_total, level, repeats)
            if layout == shipped:  # + the re-interleave back to tensors (what the reader does)
                decoded = [decompressor.decompress(f) for f in frames]
                shapes = [shape for _, shape in planes[shipped]]
                planes_s = best_of(
                    lambda decoded=decoded, shapes=shapes: [
                        decode_tensor(d, dtype, s) for d, s in zip(decoded, shapes)
                    ],
                    repeats,
                )
                entry["planes_to_tensor_gb_s"] = raw_total / planes_s / GB
                entry["decode_gb_s"] = raw_total / (entry["zstd_decode_s"] + planes_s) / GB
                again = torch.cat([decode_tensor(d, dtype, s) for d, s in zip(decoded, shapes)])
                assert torch.equal(again.contiguous().view(torch.uint8), torch.cat(features).view(torch.uint8)), (
                    "byte planes are not lossless"
                )
            out[f"{layout}_zstd{level}"] = entry
    return out


LABELS = (
    ("interleaved", "plain zstd, per sample"),
    ("channel_planes_per_sample", "channel-major byte planes, per sample"),
    ("v2_chunks_1024", "channel-major planes, 1024-token chunks"),
    (None, "format v2 (shipped): channel-major planes, {chunk}-token chunks"),
    ("v2_one_chunk_all", "channel-major planes, all samples in one chunk"),
)


def layout_row(rows: Rows, co: dict, layout: str, label: str, shipped: str) -> None:
    for level in (1, 3):
        e = co[f"{layout}_zstd{level}"]
        mark = " <- shards" if layout == shipped and level == 1 else ""
        rows.add(
            f"  {label}, zstd-{level}{mark}",
            f"{e['fraction_of_raw']:.3f} ({e['ratio']:.3f}x), {e['zstd_decode_gb_s']:.2f} GB/s",
        )


def run(ctx) -> tuple[dict, Rows]:
    log("codecs: plain zstd vs byte planes + zstd on the real features ...")
    with Phase() as phase:
        co = codec_comparison(ctx.figures["extract"]["run"]["out"], ctx.work)
    co["others_cpu"] = phase.others_cpu
    rows = Rows()
    rows.add(
        f"feature codecs ({co['dtype']}, {co['raw_bytes'] / MiB:.0f} MiB real features, {co['tokens']} tokens, "
        f"1 thread): fraction of raw, zstd decode",
        others=co["others_cpu"],
    )
    shipped = co["shipped_layout"]
    for layout, label in LABELS:
        layout_row(rows, co, layout or shipped, label.format(chunk=shipped.split("_")[-1]), shipped)
    e = co[f"{shipped}_zstd1"]
    rows.add(
        "  shipped decode: zstd + planes to tensor",
        f"{e['decode_gb_s']:.2f} GB/s (planes to tensor alone {e['planes_to_tensor_gb_s']:.1f} GB/s)",
    )
    return co, rows
