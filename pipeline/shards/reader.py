"""The reader: a shard's chunks checksummed, then decoded one at a time into Samples whose
tensors are views into their chunk; ShardSet walks a finished extract directory, decoding in a
background thread ahead of the consumer."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import torch
from pyarrow import ipc

from pipeline.common import timing
from pipeline.common.dtypes import STORAGE_DTYPES
from pipeline.shards.encodings import chunk_frame, decode_tensor, decompress_frame, dequantize_fp8, frame_codec
from pipeline.shards.files import block_hash, exists, join, open_fs
from pipeline.shards.manifest import MANIFEST_FIX, check_manifest, read_manifest
from pipeline.shards.schema import CODEC_KEY, MANIFEST_NAME, SCALAR_FIELDS, SHARD_DIR, Sample, ShardError
from pipeline.shards.target_head import load_target_head


def _checked_block(file, path: str, block: list[int], what: str) -> pa.Buffer:
    offset, length, expected = block[0], block[1], block[-1]
    file.seek(offset)
    data = file.read_buffer(length)
    got = block_hash(data)
    if data.size != length or got != expected:
        raise ShardError(
            f"{path}: checksum mismatch in {what} (bytes {offset}..{offset + length}: xxh3_64 {got:#018x}, "
            f"the manifest says {expected:#018x}): the shard is damaged or comes from another extract; {_REWRITE}"
        )
    return data


def _chunk_tensors(
    batch: pa.RecordBatch, tensor_dtypes: dict[str, str], names: list[str], codec: pa.Codec | None
) -> dict[str, list[torch.Tensor]]:
    """Each tensor of a chunk decoded once, split into its rows (views); fp8 features dequantized."""
    tensors: dict[str, list[torch.Tensor]] = {}
    for name in names:
        shapes = batch.column(name + "_shape").to_pylist()
        lengths = [shape[0] for shape in shapes]
        dtype = STORAGE_DTYPES[tensor_dtypes[name]]
        shape = [sum(lengths), *shapes[0][1:]]
        size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        planes = decompress_frame(chunk_frame(batch.column(name)), codec, size, name)
        tensors[name] = list(torch.split(decode_tensor(planes, dtype, shape), lengths))
    if "features_scale" in tensors and "features" in tensors:  # fp8 features: hand out float32
        tensors["features"] = [dequantize_fp8(q, s) for q, s in zip(tensors["features"], tensors.pop("features_scale"))]
    return tensors


def _decode_chunk(
    batch: pa.RecordBatch, tensor_dtypes: dict[str, str], names: list[str], rows: list[int], codec: pa.Codec | None
) -> Iterator[Sample]:
    """The samples at `rows` of one chunk; each tensor decoded once for the chunk, rows are views."""
    column = {
        name: batch.column(name).to_pylist()
        for name in ("sample_id", "dataset", "prompt_text", "prompt_len", "finish_reason", "greedy")
    }
    ids = batch.column("input_ids")
    offsets = ids.offsets.to_numpy()
    all_ids = torch.from_numpy(ids.values.to_numpy(zero_copy_only=False).astype(np.int64))
    tensors = _chunk_tensors(batch, tensor_dtypes, names, codec)
    for row in rows:
        yield Sample(
            sample_id=column["sample_id"][row],
            dataset=column["dataset"][row],
            prompt_text=column["prompt_text"][row],
            input_ids=all_ids[offsets[row] : offsets[row + 1]],
            prompt_len=column["prompt_len"][row],
            finish_reason=column["finish_reason"][row],
            greedy=column["greedy"][row],
            tensors={name: parts[row] for name, parts in tensors.items()},
        )


# What Arrow, zstd and the decoding raise on bytes that are not what the sidecar describes.
_DECODE_ERRORS = (pa.ArrowException, OSError, ValueError, KeyError, IndexError, TypeError, RuntimeError)
_REWRITE = (
    "restore the extract's own files, or delete the shard and its .json sidecar and run the same extract "
    "command again: it rewrites just those samples"
)


def _unlisted(fs, root: str, uri: str) -> str:
    """', and shards/x.arrow is there, which it does not list (renamed?)' when such files exist."""
    listed = {entry["file"] for entry in read_manifest(uri).get("shards", [])}
    present = fs.get_file_info(pafs.FileSelector(join(root, SHARD_DIR), allow_not_found=True))
    extra = sorted(f"{SHARD_DIR}/{i.base_name}" for i in present if i.base_name.endswith(".arrow"))
    extra = [name for name in extra if name not in listed]
    return f", and {', '.join(extra)} is there, which it does not list (renamed?)" if extra else ""


def read_shard(  # 55 lines: the read path's checks (checksum, schema, rows) kept in the order they run
    uri: str, entry: dict, tensor_dtypes: dict[str, str], tensors: list[str] | None = None, rows=None
) -> Iterator[Sample]:
    """Yield the samples of one shard (only the row indices in `rows`, if given). Chunks holding
    none of them are not read; every chunk read is checksummed before Arrow decodes it. Bytes
    that do not decode as the entry says (a shard replaced with its sidecar) are a ShardError
    naming the file, never a traceback."""
    fs, root = open_fs(uri)
    path = join(root, entry["file"])
    if not exists(fs, path):
        raise ShardError(
            f"{path}: listed in {join(root, MANIFEST_NAME)} but missing{_unlisted(fs, root, uri)}; {_REWRITE}"
        )
    names = [n for n in (tensors if tensors is not None else tensor_dtypes) if n in tensor_dtypes]
    if "features" in names and "features_scale" in tensor_dtypes and "features_scale" not in names:
        names.append("features_scale")  # fp8 features are dequantized with their scales
    wanted = None if rows is None else set(rows)
    # Local shards are memory-mapped: a chunk's bytes are hashed and decompressed in place, no copy.
    local = isinstance(fs, pafs.LocalFileSystem)
    try:
        file = pa.memory_map(path) if local else fs.open_input_file(path)
    except (pa.ArrowException, OSError) as error:
        raise ShardError(f"{path}: cannot be opened ({error})") from error
    with file:
        if file.size() != entry["bytes"]:
            raise ShardError(
                f"{path}: {file.size()} bytes, but {join(root, MANIFEST_NAME)} lists {entry['bytes']}: the shard "
                f"and the manifest come from different extracts, or the shard was truncated; {_REWRITE}"
            )
        schema_bytes = _checked_block(file, path, entry["schema_block"], "the schema")
        try:
            schema = ipc.read_schema(ipc.read_message(schema_bytes))
            codec = frame_codec((schema.metadata or {}).get(CODEC_KEY, b"zstd").decode())
            columns = [f.name for f in SCALAR_FIELDS] + names + [n + "_shape" for n in names]
            missing = [n for n in columns if n not in schema.names]
            if missing:
                raise ValueError(f"no column {missing[0]!r}")
        except _DECODE_ERRORS as error:
            raise ShardError(f"{path}: its schema does not decode ({error}); {_REWRITE}") from error
        first = 0
        for number, block in enumerate(entry["batches"]):
            count = block[2]
            chunk_rows = list(range(count)) if wanted is None else [r for r in range(count) if first + r in wanted]
            first += count
            if not chunk_rows:
                continue
            data = _checked_block(file, path, block, f"record batch {number}")
            try:  # decoded whole before the first sample is handed out: the rows are views into it
                batch = ipc.read_record_batch(ipc.read_message(data), schema)
                if batch.num_rows != count:
                    raise ValueError(f"{batch.num_rows} rows, the entry says {count}")
                samples = list(_decode_chunk(batch, tensor_dtypes, names, chunk_rows, codec))
            except _DECODE_ERRORS as error:
                raise ShardError(f"{path}: record batch {number} does not decode ({error}); {_REWRITE}") from error
            yield from samples


# what every finished extract or import stores (pipeline/outdir/storage.py tensor_dtypes), and
# features unless it stored no feature layers (extract --layer-ids none)
REQUIRED_TENSORS = ("topk_ids", "topk_logprobs")


class ShardSet:
    """A finished extract directory: manifest, shards and the stored target head."""

    def __init__(self, uri: str):
        self.uri = uri
        self.manifest = read_manifest(uri)
        if not self.manifest.get("complete", False):
            raise ShardError(
                f"{join(open_fs(uri)[1], MANIFEST_NAME)}: the extract that writes here has not finished ('complete' is "
                f"not true); run the same `specreplay extract` "
                f"command again to resume it"
            )
        check_manifest(self.manifest, uri)
        self.tensor_dtypes: dict[str, str] = self.manifest.get("tensors") or {}

    @property
    def stores_features(self) -> bool:
        """False only for an extract that stored no feature layers (`--layer-ids none`)."""
        return (self.manifest.get("settings") or {}).get("layer_ids") != []

    def _check_tensors(self, asked: list[str] | None) -> None:
        """The schema lets a running extract's manifest lack `tensors`; samples need them all. Features
        asked of shards that hold none are refused naming the extract that stores them."""
        required = [*REQUIRED_TENSORS, *(["features"] if self.stores_features else [])]
        missing = [name for name in required if name not in self.tensor_dtypes]
        if missing:
            raise self._missing(f"tensors.{missing[0]}" if self.tensor_dtypes else "tensors")
        if not self.stores_features and asked is not None and "features" in asked:
            raise ShardError(
                f"{self.uri}: these shards hold no features (extracted with --layer-ids none: tokens and top-k "
                f"only), and features were asked for; extract with feature layers to store them "
                f"(`specreplay extract --layer-ids 1,9,17`, or --draft-config DRAFTER)"
            )

    def _missing(self, key: str) -> ShardError:
        path = join(open_fs(self.uri)[1], MANIFEST_NAME)
        return ShardError(f"{path} is damaged (it has no {key!r}); {MANIFEST_FIX}")

    @property
    def settings(self) -> dict:
        if "settings" not in self.manifest:
            raise self._missing("settings")
        return self.manifest["settings"]

    @property
    def entries(self) -> list[dict]:
        if "shards" not in self.manifest:
            raise self._missing("shards")
        return self.manifest["shards"]

    @property
    def num_samples(self) -> int:
        return sum(entry["rows"] for entry in self.entries)

    def samples(
        self, tensors: list[str] | None = None, prefetch: int = 2, keep=None, pin_memory: bool = False
    ) -> Iterator[Sample]:
        """Samples in manifest order. `keep(index)` (index over the whole set) selects which
        to decode, e.g. one torchrun rank's share; chunks holding none of them are not read.
        Decoding runs in a background thread `prefetch` samples ahead, so the consumer's
        compute never waits on zstd (both release the GIL). `pin_memory` (CUDA only) copies
        each sample's tensors into page-locked memory in that thread, so the consumer's
        `.to("cuda", non_blocking=True)` overlaps with compute."""
        self._check_tensors(tensors)

        def produce():
            base = 0
            for entry in self.entries:
                rows = None if keep is None else [i for i in range(entry["rows"]) if keep(base + i)]
                base += entry["rows"]
                if rows != []:
                    for sample in read_shard(self.uri, entry, self.tensor_dtypes, tensors, rows=rows):
                        if pin_memory:
                            sample.tensors = {k: v.contiguous().pin_memory() for k, v in sample.tensors.items()}
                        yield sample

        if prefetch <= 0:
            yield from produce()
            return
        yield from _background(produce(), prefetch)

    def target_head(self) -> dict[str, torch.Tensor]:
        """{'embed_tokens': [V, H], 'lm_head': [V, H]} as stored by extract (lm_head may be the
        same tensor). Streamed into the tensors, so the file never sits in memory beside them."""
        with timing.stage("read target head"):
            return load_target_head(self.uri, self.manifest.get("target_head", {}))


_DONE = object()


def _background(iterator: Iterator, depth: int) -> Iterator:
    """Run `iterator` in a daemon thread, `depth` items ahead; exceptions re-raise here. A consumer
    that leaves early (an error, a stop signal, a break) ends the thread before it goes on: a
    decoding thread still running at interpreter exit can abort the process (measured: a watcher
    stopped by SIGTERM died of "PyGILState_Release" instead of exiting 143)."""
    items: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def hand_over(item) -> bool:
        """Put `item` in the queue unless the consumer has left (False)."""
        while not stop.is_set():
            try:
                items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run():
        try:
            for item in iterator:
                if not hand_over(item):
                    return
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            hand_over(error)
            return
        hand_over(_DONE)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        while True:
            item = items.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()
