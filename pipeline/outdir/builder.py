"""The one builder of a stage 1 manifest: each source (extract, served responses, import)
describes itself as a `Source`, its shards as a `Storage` (storage.py), and gets the settings
identity, the run facts, the new manifest and the finished one from here, key for key the same.

Manifest layout (manifest.json):
    format_version, complete
    settings   the identity compared on resume: format_version, target (architecture,
               num_layers, hidden_size, vocab_size, config_hash, dtype, stop/pad/bos ids,
               chat_template_hash, and weights_fingerprint of a loaded target or
               checkpoint_fingerprint of an imported one's files), layer_ids, feature_dtype,
               top_k, max_new_tokens (0: imported), enable_thinking, decoding ("greedy" |
               "sampled"), prompts (hash, count, rendered_hash); only when they apply:
               sampling (temperature, top_p, top_k, seed, num_samples), neighbour_layers
               (requested), beyond_positions, responses (the serving engine), imported (the capture)
    target     the full TargetInfo (name and path included; not part of the identity, so a
               moved model directory still resumes) and its fingerprint
    tensors    {tensor name: dtype name} as stored in the shards
    prompts    {name, hash, count, rendered_hash}
    layer_uses who asked for which layers (extract; inspect shows it per layer)
    target_head, tokenizer ({dir, files: {name: bytes}}), shards (entries sorted by file name),
    totals, run (informational)
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline import shards
from pipeline.common.versions import specreplay_version
from pipeline.outdir.entries import check_entries, totals
from pipeline.outdir.storage import Storage

# The target facts a resume compares (settings.target); its name and path are not among them.
TARGET_IDENTITY = (
    "architecture",
    "num_layers",
    "hidden_size",
    "vocab_size",
    "config_hash",
    "dtype",
    "stop_token_ids",
    "pad_token_id",
    "bos_token_id",
    "chat_template_hash",
)


@dataclass(frozen=True)
class Source:
    """What one source of samples says about itself; the rest of a manifest is the same for all.
    The optional facts are left out of the identity unless set, so an identity without them is
    what it always was."""

    target: object  # a TargetInfo (pipeline/extract/target.py): TARGET_IDENTITY's attributes, to_json()
    fingerprint_key: str  # "weights_fingerprint" (the loaded weights) | "checkpoint_fingerprint" (import)
    fingerprint: str
    prompts: dict  # {name, hash, count, rendered_hash}
    max_new_tokens: int = 0  # 0: nothing generated (import takes each response's own length)
    enable_thinking: bool | None = None
    sampling: dict | None = None  # settings["sampling"]; None: greedy or teacher-forced
    layer_uses: list[dict] | None = None  # who asked for which layers; None: not recorded (import)
    requested_layer_ids: list[int] | None = None  # --neighbour-layers: the ids asked for, before neighbours
    beyond_positions: bool = False  # --beyond-positions: samples may pass the trained positions
    responses: dict | None = None  # --responses-from: the engine that made the responses
    imported: dict | None = None  # import: the capture read


def settings_identity(source: Source, storage: Storage) -> dict:
    """What must not change between a run and its resume (compared key by key on resume)."""
    target = {key: getattr(source.target, key) for key in TARGET_IDENTITY}
    target[source.fingerprint_key] = source.fingerprint
    identity = {
        "format_version": shards.FORMAT_VERSION,
        "target": target,
        "layer_ids": list(storage.layer_ids),
        "feature_dtype": storage.feature_dtype,
        "top_k": storage.top_k,
        "max_new_tokens": int(source.max_new_tokens),
        "enable_thinking": source.enable_thinking,
        "decoding": "greedy" if source.sampling is None else "sampled",
        "prompts": {key: source.prompts[key] for key in ("hash", "count", "rendered_hash")},
    }
    requested = source.requested_layer_ids
    optional = {
        "sampling": source.sampling,
        "neighbour_layers": None if requested is None else {"requested": list(requested)},
        "beyond_positions": True if source.beyond_positions else None,
        "responses": source.responses,
        "imported": source.imported,
    }
    identity.update((key, value) for key, value in optional.items() if value is not None)
    return identity


def run_facts(
    world_size: int, device: str, shard_bytes: int, zstd_level: int, memory_bytes: int, batch_size: int | None = None
) -> dict:
    """Informational facts of a run (versions, world size, device, sizes); not compared on resume.
    `batch_size`: prompts per generate call, for the sources that generate."""
    import torch
    import transformers

    facts = {
        "specreplay": specreplay_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "world_size": world_size,
        "device": device,
    }
    if batch_size is not None:
        facts["batch_size"] = batch_size
    facts.update(shard_bytes=shard_bytes, zstd_level=zstd_level, memory_bytes=memory_bytes)
    return facts


def new_manifest(source: Source, storage: Storage, run: dict) -> dict:
    """The manifest of a run before any shard is merged into it (complete=false)."""
    manifest = {
        "format_version": shards.FORMAT_VERSION,
        "complete": False,
        "settings": settings_identity(source, storage),
        "target": {**source.target.to_json(), source.fingerprint_key: source.fingerprint},
        "tensors": storage.tensors,
        "prompts": source.prompts,
        "run": {**run, "chunk_tokens": storage.chunk_tokens, "head_window_bytes": storage.head_window_bytes},
    }
    if source.layer_uses is not None:
        manifest["layer_uses"] = source.layer_uses
    return manifest


def finish_manifest(out: str, manifest: dict, storage: Storage, sample_ids) -> None:
    """Merge every finished shard (all ranks, all runs) into the manifest and mark it complete;
    every one of `sample_ids` must be in a shard (written, or excluded for non-finite values)."""
    entries = shards.finished_shard_entries(out)  # sorted by file name
    missing = set(sample_ids) - check_entries(entries)
    if missing:
        raise shards.ShardError(
            f"{out}: {len(missing)} samples were not written (e.g. {sorted(missing)[:3]}); "
            f"run the same command again to resume"
        )
    manifest.update(complete=True, shards=entries, totals=totals(entries, storage.raw_bytes_per_token))
    shards.write_manifest(out, manifest)
