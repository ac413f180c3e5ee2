"""The writer: samples buffered into chunks, each chunk one record batch of byte-plane frames;
a shard lands atomically (checksummed, its sidecar entry written, then renamed into place)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.fs as pafs
import torch
from pyarrow import ipc

from pipeline.common import timing
from pipeline.common.dtypes import STORAGE_NAMES
from pipeline.common.sizes import DEFAULT_SHARD_BYTES, DEFAULT_ZSTD_LEVEL
from pipeline.common.space import writing
from pipeline.shards.encodings import compress_frame, encode_tensor, frame_codec, frame_column
from pipeline.shards.files import (
    BLOCK_HASH,
    block_hash,
    file_crc32,
    join,
    open_fs,
    write_json_atomic,
)
from pipeline.shards.schema import DEFAULT_CHUNK_TOKENS, SHARD_DIR, Sample, shard_schema
from pipeline.shards.stops import stops_held


def chunk_record_batch(
    samples: list[Sample], tensor_names: list[str], schema: pa.Schema, codec: pa.Codec | None = None
) -> pa.RecordBatch:
    """One record batch for consecutive samples: a row each, each tensor's planes once (row 0),
    compressed as one frame by `codec` when given."""
    columns = [
        pa.array([s.sample_id for s in samples], pa.string()),
        pa.array([s.dataset for s in samples], pa.string()),
        pa.array([s.prompt_text for s in samples], pa.string()),
        pa.array([s.prompt_len for s in samples], pa.int32()),
        pa.array([s.finish_reason for s in samples], pa.string()),
        pa.array([s.greedy for s in samples], pa.bool_()),
        pa.array([s.input_ids.to(torch.int32).numpy() for s in samples], pa.list_(pa.int32())),
    ]
    for name in tensor_names:
        parts = [s.tensors[name] for s in samples]
        trailing = {tuple(p.shape[1:]) for p in parts}
        if len(trailing) != 1 or any(p.dim() == 0 for p in parts):
            raise ValueError(
                f"tensor {name!r}: every sample needs the same shape after the first axis, got "
                f"{[list(p.shape) for p in parts]}"
            )
        chunk = parts[0] if len(parts) == 1 else torch.cat(parts)
        columns.append(frame_column(compress_frame(encode_tensor(chunk), codec), len(samples)))
        columns.append(pa.array([list(p.shape) for p in parts], pa.list_(pa.int64())))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def empty_stats() -> dict:
    """Per-shard counts kept in the shard's entry, so totals never require re-reading shards."""
    return {
        "response_tokens": 0,
        "finish_reasons": {},
        "argmax_mismatches": 0,
        "greedy_samples": 0,
        "greedy_response_tokens": 0,
        "greedy_argmax_mismatches": 0,
    }


def add_sample_stats(stats: dict, sample: Sample) -> None:
    mismatches = int(sample.tensors["argmax_mismatch"].sum()) if "argmax_mismatch" in sample.tensors else 0
    stats["response_tokens"] += sample.response_len
    stats["finish_reasons"][sample.finish_reason] = stats["finish_reasons"].get(sample.finish_reason, 0) + 1
    stats["argmax_mismatches"] += mismatches
    if "sample_logprob" in sample.tensors and sample.finish_reason != "given":  # sampled responses only
        # Drawn tokens the full forward's sampling distribution gives probability 0 (-inf): the
        # cached decoding that drew them and the full forward disagree at a top-k/top-p boundary.
        # (A given response's -inf is its text, not numerics.) Keys absent from greedy entries.
        zeros = int(torch.isneginf(sample.tensors["sample_logprob"]).sum())
        stats["sampled_response_tokens"] = stats.get("sampled_response_tokens", 0) + sample.response_len
        stats["zero_prob_tokens"] = stats.get("zero_prob_tokens", 0) + zeros
    if sample.greedy:
        stats["greedy_samples"] += 1
        stats["greedy_response_tokens"] += sample.response_len
        stats["greedy_argmax_mismatches"] += mismatches
        if mismatches:  # which greedy samples are not exact walks; key absent when all are
            stats.setdefault("mismatched_samples", {})[sample.sample_id] = mismatches


def chunk_tokens_for(memory_bytes: int, bytes_per_token: int) -> int:
    """Tokens per chunk so that one chunk, held raw, as planes and compressed (~3x its raw
    size while it is written or read), stays within `memory_bytes`; at most DEFAULT_CHUNK_TOKENS."""
    return max(1, min(DEFAULT_CHUNK_TOKENS, memory_bytes // (3 * max(1, bytes_per_token))))


def block_checksums(fs: pafs.FileSystem, path: str, batch_ends: list[int], batch_rows: list[int]) -> dict:
    """Checksums of a written IPC file: crc32 of the whole file (`file_crc32`); byte range and
    xxh3_64 of its schema message and of every record batch (rows included). The schema message
    starts after the 8-byte file magic; batch i spans from the end of batch i-1 (or of the
    schema) to its end."""
    crc, size = file_crc32(fs, path)
    with fs.open_input_file(path) as file:
        file.seek(8)
        ipc.read_message(file)
        starts = [file.tell()] + batch_ends[:-1]

        def hashed(offset: int, end: int) -> int:
            file.seek(offset)
            return block_hash(file.read(end - offset))

        schema_block = [8, starts[0] - 8, hashed(8, starts[0])]
        batches = [
            [start, end - start, rows, hashed(start, end)] for start, end, rows in zip(starts, batch_ends, batch_rows)
        ]
    return {"bytes": size, "crc32": crc, "block_hash": BLOCK_HASH, "schema_block": schema_block, "batches": batches}


class ShardWriter:
    """Appends samples to size-bounded shards of one rank; every shard lands atomically.

    Samples are buffered until a chunk holds `chunk_tokens` tokens (or would fill the shard),
    then written as one record batch; an interrupted run redoes the buffered samples. A shard is
    written as `.arrow.tmp`, closed, checksummed, its `.json` entry written, and only then
    renamed to `.arrow`. A crash at any point leaves either a finished shard or a temporary file
    that the next run deletes; finished samples are never rewritten.
    """

    def __init__(
        self,
        out_uri: str,
        rank: int,
        tensor_dtypes: dict[str, str],
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        zstd_level: int | None = DEFAULT_ZSTD_LEVEL,  # None: uncompressed (a benchmark baseline)
        first_index: int = 0,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ):
        self.fs, self.root = open_fs(out_uri)
        self.fs.create_dir(join(self.root, SHARD_DIR), recursive=True)
        self.rank = rank
        self.tensor_dtypes = dict(tensor_dtypes)
        self.tensor_names = list(tensor_dtypes)
        codec_name = "none" if zstd_level is None else "zstd"
        self.codec = frame_codec(codec_name, zstd_level)
        self.schema = shard_schema(self.tensor_names, codec_name)
        self.shard_bytes = shard_bytes
        self.chunk_tokens = chunk_tokens
        self.next_index = first_index
        self.entries: list[dict] = []
        self._excluded: list[dict] = []  # samples left out (non-finite values), for the next shard's entry
        self._pending: list[Sample] = []
        self._pending_tokens = self._pending_bytes = 0
        self._stream = None
        self._writer = None

    def _open(self) -> None:
        self._name = f"r{self.rank:03d}-{self.next_index:05d}"
        self._tmp = join(self.root, SHARD_DIR, self._name + ".arrow.tmp")
        with writing(self._tmp, self._pending_bytes):
            self._stream = self.fs.open_output_stream(self._tmp)
            self._writer = ipc.new_file(self._stream, self.schema)  # our frames, no Arrow buffer compression
        self._ids: list[str] = []
        self._datasets: list[str] = []  # beside sample_ids: selecting samples by dataset reads no shard
        self._tokens = 0
        self._batch_ends: list[int] = []
        self._batch_rows: list[int] = []
        self._stats = empty_stats()
        self.next_index += 1

    def write(self, sample: Sample) -> None:
        with timing.stage("shard write", tokens=sample.response_len), stops_held():
            for name, dtype in self.tensor_dtypes.items():
                got = sample.tensors[name].dtype
                if STORAGE_NAMES.get(got) != dtype:
                    raise ValueError(
                        f"tensor {name!r} of sample {sample.sample_id} is {got}, shard schema says {dtype}"
                    )
            tokens = int(sample.input_ids.numel())
            if self._pending and self._pending_tokens + tokens > self.chunk_tokens:
                self._write_chunk()  # a long sample does not make the buffered chunk overshoot
            self._pending.append(sample)
            self._pending_tokens += tokens
            self._pending_bytes += sum(t.numel() * t.element_size() for t in sample.tensors.values())
            written = self._stream.tell() if self._stream is not None else 0
            # A chunk ends at chunk_tokens, or earlier when it would fill the shard (raw bytes
            # overestimate the compressed size, so small --shard-bytes still roll over on time).
            if self._pending_tokens >= self.chunk_tokens or written + self._pending_bytes >= self.shard_bytes:
                self._write_chunk()

    def exclude(self, record: dict) -> None:
        """Record a sample that is not written (e.g. non-finite values: {"sample_id", "dataset",
        "what", "position", "count", "length"}, see pipeline/extract/capture.py nonfinite_values). It goes into the `excluded` list of the next shard entry to land,
        so resume counts it as done exactly when that shard is finished, like a written sample."""
        self._excluded.append(record)

    def _write_chunk(self) -> None:
        if not self._pending:
            return
        if self._writer is None:
            self._open()
        batch = chunk_record_batch(self._pending, self.tensor_names, self.schema, self.codec)
        with writing(self._tmp, batch.nbytes):
            self._writer.write_batch(batch)
        self._batch_ends.append(self._stream.tell())
        self._batch_rows.append(len(self._pending))
        for sample in self._pending:
            self._ids.append(sample.sample_id)
            self._datasets.append(sample.dataset)
            self._tokens += int(sample.input_ids.numel())
            add_sample_stats(self._stats, sample)
        self._pending, self._pending_tokens, self._pending_bytes = [], 0, 0
        if self._stream.tell() >= self.shard_bytes:
            self.finish_shard()

    def finish_shard(self) -> dict | None:
        """Write what is buffered and land the current shard (no-op when nothing is open)."""
        with stops_held():
            return self._finish_shard()

    def _finish_shard(self) -> dict | None:
        if self._pending:
            self._write_chunk()  # may land the shard itself when it reaches shard_bytes
        if self._writer is None and self._excluded:
            self._open()  # only excluded samples since the last shard: an empty shard carries them
        if self._writer is None:
            return None
        with timing.stage("shard finish"):
            return self._land()

    def _land(self) -> dict:
        """Close the open shard, checksum it, write its sidecar entry, then rename it into place."""
        with writing(self._tmp):
            self._writer.close()  # the Arrow footer
            self._stream.close()
        self._writer = self._stream = None
        entry = {
            "file": f"{SHARD_DIR}/{self._name}.arrow",
            "rank": self.rank,
            "rows": len(self._ids),
            "tokens": self._tokens,
            **block_checksums(self.fs, self._tmp, self._batch_ends, self._batch_rows),
            "sample_ids": self._ids,
            "datasets": self._datasets,
            **self._stats,
        }
        if self._excluded:  # absent when nothing was excluded, so such entries are what they always were
            entry["excluded"], self._excluded = self._excluded, []
        write_json_atomic(self.fs, join(self.root, SHARD_DIR, self._name + ".json"), entry)
        self.fs.move(self._tmp, join(self.root, SHARD_DIR, self._name + ".arrow"))
        self.entries.append(entry)
        return entry

    def close(self) -> list[dict]:
        """Land what is buffered or open; the entries of every shard this writer landed."""
        with timing.stage("shard close"):
            self.finish_shard()
        return self.entries


def excluded_records(entries: list[dict]) -> list[dict]:
    """Every sample the shard entries record as excluded (never written), in entry order."""
    return [record for entry in entries for record in entry.get("excluded", [])]


def _where(record: dict) -> str:
    """'layer 3 features at position 17', '... at position 17 and 4 more', 'logits at every position (40)'."""
    if record.get("not_run"):  # a later turn whose earlier answer was excluded (pipeline/extract/turns.py)
        return f"not run, {record['what']} was excluded"
    count, length = record.get("count", 1), record.get("length")
    if count > 1 and count == length:
        return f"{record['what']} at every position ({length})"
    more = f" and {count - 1} more" if count > 1 else ""
    return f"{record['what']} at position {record['position']}{more}"


def describe_excluded(records: list[dict], listed: int = 5) -> str:
    """'2 samples excluded: non-finite values (q3: layer 3 features at position 17; q5: logits at
    every position (40))' for the console; the first `listed` samples by name, then how many more."""
    if not records:
        return ""
    where = [f"{r['sample_id']}: {_where(r)}" for r in records[:listed]]
    if len(records) > listed:
        where.append(f"{len(records) - listed} more")
    noun = "sample" if len(records) == 1 else "samples"
    return f"{len(records)} {noun} excluded: non-finite values ({'; '.join(where)})"
