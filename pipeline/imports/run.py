"""`specreplay import`: captures made elsewhere -> ordinary checksummed shards (the shard format
is extract's, unchanged), resumable: the output directory and manifest are stage 1's one
builder's (pipeline/outdir/), the import describes itself to it (`import_source`).

A run is extract's four steps (pipeline/extract/run.py), with a capture in place of a model:
  1. plan, read-only: the target's facts, final norm and lm_head from its checkpoint (never the
     model, checkpoint.py); every capture file listed from its header (reader.py) and checked:
     its layers against what is asked, a final hidden state to compute the top-k from, hidden
     size, tokens, no all-zero states at its first and last position. A bad capture is one error
     naming its file, and nothing is written. Then OUT is checked (another import's settings are
     refused, listing what differs);
  2. OUT is prepared: the target head (embedding, lm_head) and tokenizer stored once, the manifest
     written with complete=false;
  3. the samples are streamed one at a time: loaded, checked whole (all-zero hidden vectors stop
     the import naming the file; NaN/Inf ones are left out and recorded, as extract does), their
     top-k computed and written to shards that land atomically;
  4. the manifest is finished (complete=true, totals).
Rerunning the same command resumes: samples in finished shards are skipped by id.

Imported samples are teacher-forced along their captured tokens: finish reason "given", not
greedy, as extract marks a given response (`score` then reports their walks as not exact). None
of the three formats records that a response was the target's own greedy output.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import shards
from pipeline.common.dtypes import FP8, STORAGE_NAMES
from pipeline.common.errors import UserError, stop_behind
from pipeline.common.layer_ids import check_layer_ids
from pipeline.extract.capture import nonfinite_values
from pipeline.extract.progress import SilentProgress
from pipeline.imports.checkpoint import TargetHead, load_head
from pipeline.imports.config import FORMATS, ImportConfig
from pipeline.imports.features import compute_dtype, sample_tensors
from pipeline.imports.layers import POST, default_layers, describe_held, missing_layers, servable, sources_of
from pipeline.imports.reader import CaptureFormat, Entry, refuse_zeros
from pipeline.outdir.builder import Source, finish_manifest, new_manifest, run_facts, settings_identity
from pipeline.outdir.directory import finished_before, kept_on_stop, output_lock, prepare_out, resume_writer
from pipeline.outdir.storage import Storage, parse_feature_dtype, plan_storage

# ---------------------------------------------------------------------------------------------
# step 1: the capture, listed and checked


def open_capture(config: ImportConfig, num_layers: int) -> CaptureFormat:
    """The capture in its format (vllm.py, speculators.py, specforge.py)."""
    common = {"capture_config": config.capture_config, "captured_layer_ids": config.captured_layer_ids}
    if config.format == "vllm":
        from pipeline.imports.vllm import VllmCapture

        return VllmCapture(config.source, num_layers, prompt_lens=config.prompt_lens, **common)
    if config.format == "speculators":
        from pipeline.imports.speculators import SpeculatorsCapture

        return SpeculatorsCapture(config.source, num_layers, hidden_states=config.hidden_states, **common)
    if config.format == "specforge":
        from pipeline.imports.specforge import SpecForgeCapture

        return SpecForgeCapture(config.source, num_layers, **common)
    raise UserError(f"--format {config.format!r} is not one of {', '.join(FORMATS)}")


def held_sources(entry: Entry, capture: CaptureFormat, num_layers: int) -> tuple[list, set]:
    """(the source key of each block column, every source the file holds) (layers.py)."""
    keys = sources_of(entry.stated, capture.convention, num_layers, entry.path)
    return keys, set(keys) | ({POST} if entry.final else set())


def check_entry(entry: Entry, capture: CaptureFormat, head: TargetHead, wanted: list[int] | None) -> list[int]:
    """The stored ids this file serves (`wanted`, or its own default); UserError naming it when
    it cannot: another hidden size, no final hidden state, a wanted layer it does not hold."""
    info = head.info
    if entry.hidden != info.hidden_size:
        raise UserError(
            f"{entry.path}: captured hidden size {entry.hidden} (over {len(entry.stated)} layers), the target's is "
            f"{info.hidden_size}: the layers do not match what was captured, or it was captured from another target"
        )
    _, held = held_sources(entry, capture, info.num_layers)
    have = servable(held, info.num_layers)
    if POST not in have:
        raise UserError(
            f"{entry.path}: no final hidden state (it holds {describe_held(held, info.num_layers)}), so the target's "
            f"next-token distribution cannot be computed; capture the final layer too "
            f"({'id ' + str(info.num_layers) if capture.convention == 'before' else 'a strategy that stores it, e.g. eagle3 or dspark'})"
        )
    layer_ids = wanted if wanted is not None else default_layers(held, info.num_layers)
    missing = missing_layers(layer_ids, held, info.num_layers, head.ties_norm)
    if missing or not layer_ids:
        raise UserError(
            f"{entry.path}: the layers do not match what was asked: layer ids {missing or '(none)'} are not in the "
            f"capture, which holds {describe_held(held, info.num_layers)} (ids in this project's numbering, "
            f"docs/layer-numbering.md); pass --layer-ids from those"
        )
    return layer_ids


def list_capture(capture: CaptureFormat, limit: int | None, progress=None) -> list[Entry]:
    """Every sample's Entry (the first `limit`), each file's header read and checked."""
    files = capture.files()
    files = files[:limit] if limit is not None else files
    bar = progress(len(files), "check", unit="file") if progress is not None else SilentProgress()
    entries, seen = [], {}
    for file in files:
        entry = capture.entry(file)
        if entry.sample_id in seen:
            raise UserError(f"{entry.path}: sample id {entry.sample_id!r} again (also {seen[entry.sample_id]})")
        seen[entry.sample_id] = entry.path
        entries.append(entry)
        bar.update(1)
    bar.close()  # not on an error: that is the one line printed then
    return entries


# ---------------------------------------------------------------------------------------------
# the plan: what is stored, and the identity a resume compares


@dataclass
class ImportPlan:
    entries: list[Entry]
    capture_dtype: torch.dtype
    storage: Storage  # what the shards hold, and the lm_head window and shard chunk sizes
    source: Source  # what this import tells the manifest builder about itself

    @property
    def settings(self) -> dict:
        """The identity compared on resume (pipeline/outdir/builder.py)."""
        return settings_identity(self.source, self.storage)


def capture_dtype(entries: list[Entry]) -> torch.dtype:
    kinds = {entry.dtype for entry in entries}
    if len(kinds) != 1:
        first = {e.dtype: e.path for e in entries}
        raise UserError(f"the capture mixes dtypes: {', '.join(f'{d} ({p})' for d, p in first.items())}")
    return kinds.pop()


def samples_hash(entries: list[Entry]) -> str:
    """sha256 of (id, positions, prompt length) of every sample: the capture a resume must find."""
    facts = [[e.sample_id, e.tokens, e.prompt_len, e.kept] for e in entries]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()


def import_source(config: ImportConfig, capture: CaptureFormat, head: TargetHead, entries: list[Entry]) -> Source:
    """The import as the manifest builder takes it: the target read from its checkpoint, the
    capture's samples as the prompt set, nothing generated (responses teacher-forced, "given")."""
    prompts = {"name": config.source, "hash": samples_hash(entries), "count": len(entries), "rendered_hash": None}
    return Source(
        target=head.info,
        fingerprint_key="checkpoint_fingerprint",
        fingerprint=head.fingerprint,
        prompts=prompts,
        imported=capture.identity(),
    )


def plan_import(config: ImportConfig, capture: CaptureFormat, entries: list[Entry], head: TargetHead) -> ImportPlan:
    info = head.info
    if config.layer_ids is not None:
        check_layer_ids(config.layer_ids, info.num_layers)
    if config.top_k > info.vocab_size:
        raise UserError(f"--top-k {config.top_k} exceeds the target's vocabulary ({info.vocab_size})")
    chosen = {tuple(check_entry(entry, capture, head, config.layer_ids)) for entry in entries}
    if len(chosen) != 1:
        raise UserError(f"the capture's files hold different layers {sorted(chosen)}; pass --layer-ids they share")
    layer_ids = list(chosen.pop())
    dtype = capture_dtype(entries)
    native = FP8 if dtype == torch.float8_e4m3fn else STORAGE_NAMES[dtype]
    feature_dtype = parse_feature_dtype(config.feature_dtype, native)
    storage = plan_storage(layer_ids, feature_dtype, config.top_k, info.hidden_size, config.memory_bytes)
    return ImportPlan(entries, dtype, storage, import_source(config, capture, head, entries))


# ---------------------------------------------------------------------------------------------
# steps 2-4: OUT prepared, samples streamed, manifest finished


def to_sample(entry: Entry, capture, head: TargetHead, plan: ImportPlan, config: ImportConfig, dataset: str):
    """(Sample to write, None) or (None, excluded record) for one capture file."""
    captured = capture.load(entry)
    ids = captured.input_ids
    if int(ids.min()) < 0 or int(ids.max()) >= head.info.vocab_size:
        raise UserError(f"{entry.path}: token ids outside the target's vocabulary (0..{head.info.vocab_size - 1})")
    refuse_zeros(entry.path, captured.block, [f"captured layer {s}" for s in entry.stated])
    keys, _ = held_sources(entry, capture, head.num_layers)
    storage = plan.storage
    tensors = sample_tensors(
        captured,
        keys,
        storage.layer_ids,
        head,
        storage.feature_dtype,
        entry.prompt_len,
        config.top_k,
        storage.head_window_bytes,
    )
    bad = nonfinite_values(tensors, storage.layer_ids, entry.prompt_len)
    if bad is not None:
        return None, {"sample_id": entry.sample_id, "dataset": dataset, **bad}
    prompt_text = head.tokenizer.decode(ids[: entry.prompt_len].tolist())
    sample = shards.Sample(entry.sample_id, dataset, prompt_text, ids, entry.prompt_len, "given", False, tensors)
    return sample, None


def write_samples(config, capture, head, plan: ImportPlan, dataset: str, progress=None) -> None:
    """Every sample not in a finished shard, loaded one at a time, into this run's shards."""
    ids = {entry.sample_id for entry in plan.entries}
    writer, done = resume_writer(config.out, 0, plan.storage, ids, config.shard_bytes, config.zstd_level)
    pending = [entry for entry in plan.entries if entry.sample_id not in done]
    total = sum(entry.kept for entry in pending)
    bar = progress(total, "import", unit="tok") if progress is not None else SilentProgress()
    try:
        for number, entry in enumerate(pending, 1):
            sample, excluded = to_sample(entry, capture, head, plan, config, dataset)
            if sample is not None:
                writer.write(sample)
            else:
                writer.exclude(excluded)
            bar.update(entry.kept, samples=f"{number}/{len(pending)}")
        writer.close()
    except (KeyboardInterrupt, Exception) as error:  # Ctrl-C, SIGTERM raised as one, or their echo
        stop = error if isinstance(error, KeyboardInterrupt) else stop_behind(error)
        if stop is None:
            raise
        raise kept_on_stop(writer, len(done), len(plan.entries), config.out, stop) from None
    finally:
        bar.close()


def run_import(config: ImportConfig, progress=None) -> dict:
    """Run (or resume) an import; returns the final manifest. See the module docstring.
    `progress`: as extract's, a bar factory (specreplay/progress.py), called for the files to check
    and then for the tokens to import; None: nothing is shown."""
    validate_numbers(config)
    check_device(config.device)
    head = load_head(config.model)
    capture = open_capture(config, head.num_layers)
    entries = list_capture(capture, config.limit, progress)
    plan = plan_import(config, capture, entries, head)
    head.to(compute_dtype(plan.capture_dtype), config.device)
    dataset = config.dataset or Path(config.source.rstrip("/")).name or config.format
    with output_lock(config.out, "import") or contextlib.nullcontext():
        finished = finished_before(config.out, plan.settings, config.overwrite)
        if finished is not None:
            return finished  # already done with these settings: touch nothing
        run = run_facts(1, config.device, config.shard_bytes, config.zstd_level, config.memory_bytes)
        manifest = new_manifest(plan.source, plan.storage, run)
        stored_head = lambda: (head.embed_tokens, head.lm_head, None)  # noqa: E731 - read from the checkpoint
        prepare_out(config.out, manifest, plan.storage, config.overwrite, stored_head, head.tokenizer)
        write_samples(config, capture, head, plan, dataset, progress)
        finish_manifest(config.out, manifest, plan.storage, [entry.sample_id for entry in plan.entries])
    return manifest


def validate_numbers(config: ImportConfig) -> None:
    for name, value in (("--top-k", config.top_k), ("--shard-bytes", config.shard_bytes)):
        if value < 1:
            raise UserError(f"{name} must be >= 1, got {value}")
    if config.memory_bytes < 1:
        raise UserError(f"--memory-budget must be >= 1, got {config.memory_bytes}")
    if config.limit is not None and config.limit < 1:
        raise UserError(f"--limit must be >= 1, got {config.limit}; leave it out to import every sample")
    if config.format not in FORMATS:
        raise UserError(f"--format {config.format!r} is not one of {', '.join(FORMATS)}")


def check_device(device: str) -> None:
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise UserError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device here; use --device cpu")
