"""Section `reader`: GB/s of decoded features through the real reader,
`ShardSet.samples(tensors=["features"])` (memory-mapped file, xxh3_64 per chunk, Arrow IPC
record batch, the features' zstd frame, planes back to a tensor), consumer doing nothing, page
cache warm, min of 3; against the same chunks written by the product's writer without
compression (`ShardWriter(zstd_level=None)`) and read the same way. Arrow's thread pool at 1
thread (the per-core figure: all of the reader's work runs on the calling thread) and at its
default with the background prefetch thread; then where the time goes, stage by stage."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.common import GB, Phase, Rows, best_of, log
from pipeline.common.dtypes import STORAGE_DTYPES

TARGET_GB_S = 1.0  # issue 4: shard decode at least 1 GB/s per core


def uncompressed_copy(shard_dir: str, dest: Path, chunk_tokens: int | None = None) -> str:
    """The same samples written again by the product's writer without compression, as a shard
    set the real reader opens: the same chunks (or chunks of `chunk_tokens`) and byte layout."""
    from pipeline import shards

    shardset = shards.ShardSet(shard_dir)
    chunk_tokens = chunk_tokens or shardset.manifest.get("run", {}).get("chunk_tokens", shards.DEFAULT_CHUNK_TOKENS)
    writer = shards.ShardWriter(str(dest), 0, shardset.tensor_dtypes, zstd_level=None, chunk_tokens=chunk_tokens)
    for sample in shardset.samples(prefetch=0):
        writer.write(sample)
    shards.write_manifest(str(dest), dict(shardset.manifest, shards=writer.close()))
    return str(dest)


def chunk_frames(shard_dir: str, tensor: str = "features") -> list[tuple[bytes, list[int]]]:
    """(frame bytes, [tokens, width]) of `tensor` in every chunk as it sits in the shard files,
    read with Arrow directly (the bench measures the format, not the reader)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from pipeline import shards

    shardset = shards.ShardSet(shard_dir)
    fs, root = shards.open_fs(shard_dir)
    out = []
    for entry in shardset.entries:
        reader = ipc.open_file(pa.BufferReader(shards.read_bytes(fs, shards.join(root, entry["file"]))))
        for index in range(reader.num_record_batches):
            batch = reader.get_batch(index)
            shapes = batch.column(f"{tensor}_shape").to_pylist()
            out.append(
                (shards.chunk_frame(batch.column(tensor)).to_pybytes(), [sum(x[0] for x in shapes), *shapes[0][1:]])
            )
    return out


def reader_breakdown(shard_dir: str, repeats: int = 3) -> dict:
    """Single thread, in GB/s of decoded features: xxh3_64 of each chunk's bytes, Arrow IPC record
    batch read (no Arrow compression: metadata and offsets), the features' zstd frame
    (pa.Codec), byte planes back to a tensor (`pipeline.shards.decode_tensor`). The reader does
    these in one call per chunk, so they are taken apart here on the file's own blocks."""
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import xxhash

    from pipeline import shards

    shardset = shards.ShardSet(shard_dir)
    fs, root = shards.open_fs(shard_dir)
    dtype = STORAGE_DTYPES[shardset.tensor_dtypes["features"]]
    blocks = []
    for entry in shardset.entries:
        data = shards.read_bytes(fs, shards.join(root, entry["file"]))
        schema = ipc.read_schema(ipc.read_message(pa.py_buffer(data[8 : 8 + entry["schema_block"][1]])))
        blocks += [(schema, pa.py_buffer(data[b[0] : b[0] + b[1]])) for b in entry["batches"]]
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
        crc = best_of(lambda: [xxhash.xxh3_64_intdigest(d) for _, d in blocks], repeats)
        arrow = best_of(arrow_read, repeats)
        zstd = best_of(decompress, repeats)
        planes = best_of(lambda: [shards.decode_tensor(b, dtype, s) for b, s in buffers], repeats)
    finally:
        pa.set_cpu_count(default_threads)
    gbs = lambda seconds: feature_bytes / seconds / GB  # noqa: E731
    return {
        "checksum_xxh3_gb_s": gbs(crc),
        "arrow_ipc_read_gb_s": gbs(arrow),
        "zstd_frame_gb_s": gbs(zstd),
        "planes_to_tensor_gb_s": gbs(planes),
        "sum_of_stages_gb_s": gbs(crc + arrow + zstd + planes),
    }


def reader_throughput(shard_dir: str, work: Path, repeats: int = 3) -> dict:
    import pyarrow as pa

    from pipeline import shards

    shardset = shards.ShardSet(shard_dir)
    plain = shards.ShardSet(uncompressed_copy(shard_dir, work / "uncompressed"))
    feature_bytes = sum(
        s.features.numel() * s.features.element_size() for s in shardset.samples(["features"], prefetch=0)
    )

    def read(which, prefetch):
        for _ in which.samples(tensors=["features"], prefetch=prefetch):
            pass

    out = {
        "feature_bytes": feature_bytes,
        "compressed_file_bytes": shardset.manifest["totals"]["bytes"],
        "uncompressed_file_bytes": sum(e["bytes"] for e in plain.entries),
    }
    default_threads = pa.cpu_count()
    try:
        for label, threads in (("1thread", 1), (f"{default_threads}threads", default_threads)):
            pa.set_cpu_count(threads)
            read(shardset, 0)  # warm the page cache
            compressed = best_of(lambda: read(shardset, 0), repeats)
            background = best_of(lambda: read(shardset, 2), repeats)
            read(plain, 0)
            uncompressed = best_of(lambda: read(plain, 0), repeats)
            out[label] = {
                "zstd_shards_gb_s": feature_bytes / compressed / GB,
                "zstd_shards_background_thread_gb_s": feature_bytes / background / GB,
                "uncompressed_gb_s": feature_bytes / uncompressed / GB,
                "zstd_vs_uncompressed": uncompressed / compressed,
            }
    finally:
        pa.set_cpu_count(default_threads)
    out["per_core_gb_s"] = out["1thread"]["zstd_shards_gb_s"]
    out["stages_1thread"] = reader_breakdown(shard_dir, repeats)
    return out


def run(ctx) -> tuple[dict, Rows]:
    log("reader: ShardSet.samples vs the same chunks uncompressed ...")
    with Phase() as phase:
        rd = reader_throughput(ctx.figures["extract"]["run"]["out"], ctx.work)
    rd["others_cpu"] = phase.others_cpu
    rows = Rows()
    one = rd["1thread"]
    rows.add("shard reader (ShardSet.samples, features)", others=rd["others_cpu"])
    rows.add(
        "  zstd shards, 1 thread",
        f"{one['zstd_shards_gb_s']:.2f} GB/s",
        f">= {TARGET_GB_S:g} GB/s/core",
        rd["per_core_gb_s"] >= TARGET_GB_S,
        sides=[rd["others_cpu"]],
    )
    rows.add("  same chunks uncompressed, 1 thread", f"{one['uncompressed_gb_s']:.2f} GB/s")
    rows.add("  zstd / uncompressed throughput", f"{one['zstd_shards_gb_s'] / one['uncompressed_gb_s']:.2f}")
    b = rd["stages_1thread"]
    rows.add(
        "  stages: xxh3 / arrow read / zstd frame / planes to tensor",
        f"{b['checksum_xxh3_gb_s']:.1f} / {b['arrow_ipc_read_gb_s']:.0f} / {b['zstd_frame_gb_s']:.2f} / "
        f"{b['planes_to_tensor_gb_s']:.2f} GB/s",
    )
    for key in [k for k in rd if k.endswith("threads")]:
        rows.add(
            f"  zstd shards, arrow {key}, background thread",
            f"{rd[key]['zstd_shards_background_thread_gb_s']:.2f} GB/s",
        )
    return rd, rows
