"""The shard format round trip (pipeline/shards/writer.py, reader.py, manifest.py): writer/reader,
rollover, checksums, chunks, leftovers, manifests. Byte planes: test_encodings.py; the target head:
test_target_head.py."""

from __future__ import annotations

import zlib

import pytest
import torch

from pipeline import shards
from pipeline.common import timing
from pipeline.shards import Sample, ShardError, ShardSet, ShardWriter
from tests.helpers.shards import same_bits

# what make_sample's features and top-k are: one layer of 48, top-4 of a 1000-token vocabulary
SETTINGS = {"target": {"num_layers": 2, "hidden_size": 48, "vocab_size": 1000}, "layer_ids": [0], "top_k": 4}
DTYPES = {"features": "bfloat16", "topk_ids": "int32", "topk_logprobs": "float32", "argmax_mismatch": "uint8"}


def make_sample(index: int, n_tokens: int = 20, prompt_len: int = 8, hidden: int = 48, k: int = 4) -> Sample:
    generator = torch.Generator().manual_seed(index)
    r = n_tokens - prompt_len
    return Sample(
        sample_id=f"s{index:03d}",
        dataset="unit",
        prompt_text=f"prompt {index} ✓",  # non-ASCII on purpose
        input_ids=torch.randint(0, 1000, (n_tokens,), generator=generator),
        prompt_len=prompt_len,
        finish_reason="eos" if index % 2 else "length",
        greedy=index % 3 != 0,
        tensors={
            "features": torch.randn(n_tokens, hidden, generator=generator).to(torch.bfloat16),
            "topk_ids": torch.randint(0, 1000, (r + 1, k), generator=generator, dtype=torch.int32),
            "topk_logprobs": -torch.rand(r + 1, k, generator=generator),
            "argmax_mismatch": (torch.rand(r, generator=generator) < 0.2).to(torch.uint8),
        },
    )


def write_set(
    out, samples, shard_bytes=shards.DEFAULT_SHARD_BYTES, chunk_tokens=shards.DEFAULT_CHUNK_TOKENS, dtypes=DTYPES
) -> list[dict]:
    writer = ShardWriter(str(out), 0, dtypes, shard_bytes=shard_bytes, chunk_tokens=chunk_tokens)
    for sample in samples:
        writer.write(sample)
    entries = writer.close()
    shards.write_manifest(
        str(out),
        {
            "format_version": shards.FORMAT_VERSION,
            "complete": True,
            "settings": SETTINGS,
            "tensors": dtypes,
            "shards": entries,
        },
    )
    return entries


def test_writer_reader_round_trip(tmp_path):
    samples = [make_sample(i, n_tokens=10 + i, prompt_len=4 + i % 3) for i in range(5)]
    entries = write_set(tmp_path, samples)
    assert len(entries) == 1 and entries[0]["rows"] == 5
    assert entries[0]["tokens"] == sum(s.input_ids.numel() for s in samples)
    assert entries[0]["response_tokens"] == sum(s.response_len for s in samples)
    assert entries[0]["argmax_mismatches"] == sum(int(s.argmax_mismatch.sum()) for s in samples)
    assert entries[0]["finish_reasons"] == {"length": 3, "eos": 2}
    assert entries[0]["greedy_samples"] == sum(s.greedy for s in samples)
    back = list(ShardSet(str(tmp_path)).samples())
    assert [s.sample_id for s in back] == [s.sample_id for s in samples]
    for got, want in zip(back, samples):
        assert (got.dataset, got.prompt_text, got.prompt_len, got.finish_reason, got.greedy) == (
            want.dataset,
            want.prompt_text,
            want.prompt_len,
            want.finish_reason,
            want.greedy,
        )
        assert torch.equal(got.input_ids, want.input_ids)
        for name in DTYPES:
            assert same_bits(got.tensors[name], want.tensors[name]), name
    only = next(ShardSet(str(tmp_path)).samples(tensors=["features"], prefetch=0))
    assert set(only.tensors) == {"features"}


def test_writer_refuses_wrong_dtype(tmp_path):
    sample = make_sample(0)
    sample.tensors["features"] = sample.features.float()
    with pytest.raises(ValueError, match="features"):
        ShardWriter(str(tmp_path), 0, DTYPES).write(sample)


def test_size_based_rollover(tmp_path):
    samples = [make_sample(i, n_tokens=64) for i in range(9)]
    one = len(bytes(shards.encode_tensor(samples[0].features)))
    entries = write_set(tmp_path, samples, shard_bytes=2 * one, chunk_tokens=64)
    assert len(entries) > 2 and sum(e["rows"] for e in entries) == 9
    assert [e["file"] for e in entries] == sorted(e["file"] for e in entries)
    assert all(e["bytes"] >= 2 * one for e in entries[:-1])  # rolled over only once the size was reached
    assert [s.sample_id for s in ShardSet(str(tmp_path)).samples()] == [s.sample_id for s in samples]
    assert shards.finished_shard_entries(str(tmp_path)) == entries


def test_flipped_byte_names_the_shard(tmp_path):
    entries = write_set(tmp_path, [make_sample(i) for i in range(3)])
    path = tmp_path / entries[0]["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"r000-00000\.arrow: checksum mismatch in record batch 0"):
        list(ShardSet(str(tmp_path)).samples())


def test_flipped_byte_fails_only_the_chunk_holding_it(tmp_path):
    """Per-chunk checksums: the chunks before the corrupt one decode; the corrupt one raises before
    any of its samples is handed out; a byte flipped in the footer is caught by the file crc."""
    samples = [make_sample(i, n_tokens=20) for i in range(4)]
    entries = write_set(tmp_path, samples, chunk_tokens=40)  # two samples per chunk
    assert [b[2] for b in entries[0]["batches"]] == [2, 2]
    path = tmp_path / entries[0]["file"]
    offset, length = entries[0]["batches"][1][:2]
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0x10
    path.write_bytes(bytes(data))
    got = []
    with pytest.raises(ShardError, match="checksum mismatch in record batch 1"):
        for sample in ShardSet(str(tmp_path)).samples(prefetch=0):
            got.append(sample.sample_id)
    assert got == ["s000", "s001"]
    data[offset + length // 2] ^= 0x10
    data[-10] ^= 0x01  # footer: not needed to read, so only the whole-file check sees it
    path.write_bytes(bytes(data))
    assert len(list(ShardSet(str(tmp_path)).samples())) == 4
    assert shards.file_crc32(*shards.open_fs(str(path)))[0] != entries[0]["crc32"]


def test_chunks_hold_several_samples_and_rows_are_views(tmp_path):
    samples = [make_sample(i, n_tokens=10 + 3 * i, prompt_len=4) for i in range(7)]
    entries = write_set(tmp_path, samples, chunk_tokens=30)
    rows = [b[2] for b in entries[0]["batches"]]
    assert sum(rows) == 7 and max(rows) > 1 and len(rows) > 1
    back = list(ShardSet(str(tmp_path)).samples())
    for got, want in zip(back, samples):
        assert same_bits(got.features, want.features)
        assert same_bits(got.argmax_mismatch, want.argmax_mismatch)
    assert not back[1].features.is_contiguous()  # stride 1 along tokens: a view into the chunk


def test_a_sample_longer_than_a_chunk_is_a_chunk_by_itself(tmp_path):
    samples = [
        make_sample(0, n_tokens=12),
        make_sample(1, n_tokens=90),
        make_sample(2, n_tokens=5, prompt_len=2),
        make_sample(3, n_tokens=6, prompt_len=2),
    ]
    entries = write_set(tmp_path, samples, chunk_tokens=16)
    # the buffered short sample is written before the long one arrives (no chunk overshoots
    # chunk_tokens unless one sample alone does); the last two share a chunk
    assert [b[2] for b in entries[0]["batches"]] == [1, 1, 2]
    assert [s.response_len for s in ShardSet(str(tmp_path)).samples()] == [s.response_len for s in samples]


def test_keep_reads_only_chunks_holding_kept_rows(tmp_path):
    samples = [make_sample(i, n_tokens=20) for i in range(6)]
    entries = write_set(tmp_path, samples, chunk_tokens=40)
    path = tmp_path / entries[0]["file"]
    offset, length = entries[0]["batches"][0][:2]
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0x10  # chunk 0 (rows 0, 1) is corrupt but never needed
    path.write_bytes(bytes(data))
    got = [s.sample_id for s in ShardSet(str(tmp_path)).samples(keep=lambda index: index in (3, 4))]
    assert got == ["s003", "s004"]


def test_fp8_features_round_trip_within_fp8_precision(tmp_path):
    dtypes = {**DTYPES, "features": "float8_e4m3fn", "features_scale": "float32"}
    samples, originals = [], []
    for i in range(3):
        sample = make_sample(i)
        layers = sample.features.float().view(sample.features.shape[0], 2, -1)
        layers[:, 1] *= 100.0  # a second layer 100x larger: per-layer scales keep layer 0 precise
        originals.append(layers.reshape(sample.features.shape[0], -1))
        quantized = [shards.quantize_fp8(layers[:, j]) for j in range(2)]
        sample.tensors["features"] = torch.cat([q for q, _ in quantized], dim=-1)
        sample.tensors["features_scale"] = torch.cat([s for _, s in quantized], dim=-1)
        samples.append(sample)
    write_set(tmp_path, samples, dtypes=dtypes)
    back = list(ShardSet(str(tmp_path)).samples(tensors=["features"]))
    for got, want in zip(back, originals):
        assert got.features.dtype == torch.float32 and set(got.tensors) == {"features"}
        per_layer = (got.features - want).abs().view(want.shape[0], 2, -1).amax(-1)
        bound = want.abs().view(want.shape[0], 2, -1).amax(-1) / 16  # e4m3: 3 mantissa bits
        assert bool((per_layer <= bound).all()) and bool((per_layer > 0).any())


def test_file_crc32_streams_in_chunks(tmp_path):
    """`inspect` checks shard files and the target head with file_crc32: chunked reads, same crc."""
    path = tmp_path / "blob"
    data = bytes(range(256)) * 41
    path.write_bytes(data)
    fs, name = shards.open_fs(str(path))
    assert shards.file_crc32(fs, name, chunk_bytes=1000) == shards.file_crc32(fs, name) == (zlib.crc32(data), len(data))


def test_writer_and_target_head_mark_their_stages(tmp_path):
    samples = [make_sample(i) for i in range(3)]
    with timing.recording() as times:
        write_set(tmp_path, samples, shard_bytes=1)  # every sample lands its own shard
    assert times.calls["shard write"] == 3 and times.calls["shard close"] == 1
    assert times.calls["shard finish"] == 3
    shards.save_target_head(str(tmp_path), torch.randn(10, 4), torch.randn(10, 4))
    with timing.recording() as times:
        ShardSet(str(tmp_path)).target_head()
    assert times.calls == {"read target head": 1}


def test_chunk_tokens_follow_the_memory_budget():
    assert shards.chunk_tokens_for(2 << 30, 5760) == shards.DEFAULT_CHUNK_TOKENS
    wide = 5 * 5120 * 2  # a 27B target's five bf16 feature layers per token
    assert shards.chunk_tokens_for(256 << 20, wide) == (256 << 20) // (3 * wide)
    assert shards.chunk_tokens_for(1, wide) == 1


def test_remove_unfinished_keeps_finished_shards(tmp_path):
    entries = write_set(tmp_path, [make_sample(0)], shard_bytes=1)
    shard_dir = tmp_path / shards.SHARD_DIR
    (shard_dir / "r000-00001.arrow.tmp").write_bytes(b"half a shard")
    (shard_dir / "r001-00000.json").write_text("{}")  # sidecar whose rename never happened
    removed = shards.remove_unfinished(str(tmp_path))
    assert removed == ["r000-00001.arrow.tmp", "r001-00000.json"]
    assert sorted(p.name for p in shard_dir.iterdir()) == ["r000-00000.arrow", "r000-00000.json"]
    assert shards.finished_shard_entries(str(tmp_path)) == entries


def test_incomplete_and_foreign_manifests_are_refused(tmp_path):
    with pytest.raises(ShardError, match="no manifest"):
        ShardSet(str(tmp_path))
    shards.write_manifest(str(tmp_path), {"format_version": shards.FORMAT_VERSION, "complete": False})
    with pytest.raises(ShardError, match="has not finished"):
        ShardSet(str(tmp_path))
    shards.write_manifest(str(tmp_path), {"format_version": 999, "complete": True})
    with pytest.raises(ShardError, match="field 'format_version' is 999"):
        ShardSet(str(tmp_path))


def test_a_consumer_leaving_early_ends_the_decoding_thread(tmp_path):
    """Breaking off after one sample (or an exception, or a stop signal) leaves no decoding thread
    running: one alive at interpreter exit can abort the process."""
    import threading

    write_set(tmp_path, [make_sample(i, n_tokens=64) for i in range(9)], chunk_tokens=64)
    before = {t.ident for t in threading.enumerate()}
    samples = ShardSet(str(tmp_path)).samples(prefetch=1)
    assert next(samples).sample_id == "s000"
    decoding = [t for t in threading.enumerate() if t.ident not in before]
    assert len(decoding) == 1 and decoding[0].is_alive()  # blocked handing over the next samples
    samples.close()
    assert not decoding[0].is_alive()
