"""The shard format: the one place that knows how extracted samples are laid out in bytes.

Both stages import this package (extract writes, score reads); nothing else touches Arrow.

Layout of an extract directory (any URI pyarrow.fs opens: a local path, s3://, gs://):

    manifest.json            settings identity + every finished shard (merged index)
    target_head.safetensors  the target's input embedding and lm_head, stored once
    shards/rR-NNNNN.arrow    Arrow IPC file, one record batch per chunk, tensors as zstd frames
    shards/rR-NNNNN.json     that shard's entry (rows, tokens, bytes, crc32 of the file, and the
                             byte range + xxh3_64 of its schema message and of every record batch;
                             counts: response tokens, finish reasons, argmax mismatches, and
                             per greedy sample that has any, how many); written
                             before the .arrow is renamed into place, so a shard counts as
                             finished exactly when both exist

Format version 3: format 2's shard files, plus a `checksum` in manifest.json and in every sidecar
(files.py). Format 2 extracts (no JSON checksums) are still read. A record batch is a *chunk*: consecutive whole samples (one row each) holding
about `chunk_tokens` tokens together (a longer sample is a chunk by itself). Each tensor of a
chunk is stored once for the whole chunk: the rows' tensors concatenated along their first
(token) axis, [N, *trailing], then stored losslessly as channel-major byte planes — the bytes
viewed as [N, *trailing, itemsize] with every axis reversed, [itemsize, *reversed(trailing), N],
so all high bytes of channel 0 over the chunk's N tokens come first, then channel 1, ... and the
low bytes last, compressed as one zstd frame. Only row 0 of a chunk carries the frame (`<tensor>`,
large_binary; null in the other rows); every row carries its own shape (`<tensor>_shape`), which
locates it in the chunk. The IPC file itself is written without Arrow's buffer compression (the
scalar columns are a few bytes a token): decoding our own frames with pa.Codec is faster than
Arrow's compressed-IPC read path on the same bytes. The schema metadata says which codec the
frames use (`specreplay.codec`: zstd, or none for an uncompressed copy).

Why this layout (`make bench`, bench/README.md "Feature codecs"): a channel's sign/exponent byte
repeats over tokens, so zstd finds long matches in a channel's run; runs spanning several samples
compress better than one sample's planes, and zstd level 1 is both smaller and faster to decode
than level 3 on these runs. Decoding re-interleaves the planes with a vectorised shift-or and
returns each row as a *view* into its chunk (stride 1 along tokens, i.e. transposed in memory);
matmuls take such views directly, `.contiguous()` gives row-major when a consumer needs it.

Checksums: each record batch's bytes are checked (xxh3_64 from the sidecar) before Arrow sees
them, so the reader touches only the chunks it needs, never decodes a corrupt one, and holds one
chunk in memory at a time; `inspect` also checks the whole file's crc32 (streamed, `file_crc32`).
xxh3 on the read path because zlib's crc32 is several times slower, a large share of decoding.
The JSON files carry `"checksum": "xxh3_64:<hex>"` of their canonical JSON (sorted keys, no
whitespace), so a flipped digit of a row count or letter of a sample id is an error naming the
file, not another extract; shard entries are also checked for consistency (row counts, byte ranges
back to back), all a format 2 file gets. The target head is checked against the manifest's size
and crc32, its header against the file before anything is allocated. Whatever the damage, reading
ends in a ShardError naming the file and what to do, or reads exactly what was written
(tools/fuzz_inputs.py, `make fuzz`).

Row schema (one row = one prompt + response):
    sample_id, dataset, prompt_text: string   prompt_len: int32   finish_reason: string
    greedy: bool (False when the response was given, i.e. teacher-forced)
    input_ids: list<int32>                    prompt + response tokens, N of them
    <tensor>: large_binary (the chunk's planes, row 0)   <tensor>_shape: list<int64>
Tensors: features [N, n_layers*H] (absent when the extract stored no feature layers,
`--layer-ids none`: the manifest's settings.layer_ids is then []); topk_ids [R+1, k] and topk_logprobs [R+1, k] where row i is
the target's distribution for the token at position prompt_len + i (R = N - prompt_len);
argmax_mismatch [R] (uint8, 1 where the stored token is not the full-forward argmax). With fp8 features (lossy, opt-in) features
are float8_e4m3fn and features_scale [N, n_layers] float32 holds each token's per-layer scale;
the reader hands out the dequantized float32 features.

Modules: schema (Sample, Arrow schema, names, ShardError), encodings (dtype names, byte planes,
zstd frames, fp8), files (pyarrow.fs helpers, checksums), writer, reader, manifest, target_head.
"""

from __future__ import annotations

from pipeline.common.sizes import DEFAULT_SHARD_BYTES, DEFAULT_ZSTD_LEVEL
from pipeline.shards.encodings import FP8_MAX, chunk_frame, decode_tensor, dequantize_fp8, encode_tensor, quantize_fp8
from pipeline.shards.files import (
    exists,
    file_crc32,
    join,
    json_checksum,
    open_fs,
    read_bytes,
    read_json,
    write_bytes_atomic,
    write_json_atomic,
)
from pipeline.shards.manifest import (
    check_entry,
    check_manifest,
    finished_shard_entries,
    read_manifest,
    remove_unfinished,
    write_manifest,
)
from pipeline.shards.reader import ShardSet, read_shard
from pipeline.shards.schema import (
    CODEC_KEY,
    DEFAULT_CHUNK_TOKENS,
    FORMAT_VERSION,
    MANIFEST_NAME,
    READABLE_FORMAT_VERSIONS,
    RESPONSES_DIR,
    SCALAR_FIELDS,
    SHARD_DIR,
    TARGET_HEAD_NAME,
    TOKENIZER_DIR,
    Sample,
    ShardError,
    shard_schema,
)
from pipeline.shards.target_head import (
    read_safetensors_stream,
    save_target_head,
    write_safetensors_stream,
)
from pipeline.shards.writer import (
    ShardWriter,
    add_sample_stats,
    block_checksums,
    chunk_record_batch,
    chunk_tokens_for,
    empty_stats,
)

__all__ = [
    "CODEC_KEY",
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_SHARD_BYTES",
    "DEFAULT_ZSTD_LEVEL",
    "FORMAT_VERSION",
    "FP8_MAX",
    "MANIFEST_NAME",
    "READABLE_FORMAT_VERSIONS",
    "RESPONSES_DIR",
    "SCALAR_FIELDS",
    "SHARD_DIR",
    "TARGET_HEAD_NAME",
    "TOKENIZER_DIR",
    "Sample",
    "ShardError",
    "ShardSet",
    "ShardWriter",
    "add_sample_stats",
    "block_checksums",
    "check_entry",
    "check_manifest",
    "chunk_frame",
    "chunk_record_batch",
    "chunk_tokens_for",
    "decode_tensor",
    "dequantize_fp8",
    "empty_stats",
    "encode_tensor",
    "exists",
    "file_crc32",
    "finished_shard_entries",
    "join",
    "json_checksum",
    "open_fs",
    "quantize_fp8",
    "read_bytes",
    "read_json",
    "read_manifest",
    "read_safetensors_stream",
    "read_shard",
    "remove_unfinished",
    "save_target_head",
    "shard_schema",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_manifest",
    "write_safetensors_stream",
]
