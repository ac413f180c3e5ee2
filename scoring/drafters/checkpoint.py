"""Load any DFlash drafter checkpoint, strictly, and check it against the extracted shards.

Accepted layouts:
  - a z-lab directory: config.json + model.safetensors, or sharded safetensors listed by
    model.safetensors.index.json (`weight_map`);
  - a training checkpoint: one .safetensors / .pt / .pth / .bin file holding a state dict
    (a .pt may nest it under "model", "state_dict", "module" or "model_state_dict"), with its
    config.json next to it or passed as `config_path=`; or a directory holding one such file
    plus config.json.

Wrapper prefixes (`module.`, `_orig_mod.`, `model.`, `draft_model.`, `drafter.`) are stripped
from a key only when that turns it into a name the drafter has, so a correct name is never
touched and a foreign tensor keeps the name it was saved under in the error. Every missing,
unexpected or mis-shaped tensor is an error: a drafter scored with a silently dropped weight
would still produce numbers, just wrong ones.

`checkpoint_problem` tells a completely written checkpoint from a partly written one from
file sizes and headers alone (no tensor data), so a truncated file is one clear error, not a
deserializer's traceback.

Everything here runs before any compute; nothing of the target model is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file as load_safetensors_file
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from pipeline.common.errors import UserError
from scoring.drafters.dflash import DFlashDrafter, DrafterConfig, parse_drafter_config

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
WEIGHT_EXTENSIONS = (".safetensors", ".pt", ".pth", ".bin")
# Keys under which training loops nest the model's state dict inside a .pt checkpoint.
NESTING_KEYS = ("model", "state_dict", "module", "model_state_dict")
# Prefixes added by DDP/DeepSpeed (`module.`), torch.compile (`_orig_mod.`) and training wrappers.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.", "draft_model.", "drafter.")
# Training-metadata fields that carry the optimizer step.
STEP_FIELDS = ("step", "global_step", "training_step")
# `step_20000`, `checkpoint-1500`, `step20000`, `global_step500`, `ckpt-000500`, `iter_300`.
STEP_PATTERN = re.compile(r"(?:^|[^a-z])(?:global_step|step|checkpoint|ckpt|iter|iteration)[-_]?(\d+)(?![a-z])", re.I)
MAX_LISTED = 20


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded exactly as its config describes."""


class NonFiniteWeightsError(CheckpointError):
    """A checkpoint holding NaN/Inf weights (or weights the compute dtype cannot hold)."""


class CompatibilityError(UserError):
    """A drafter that does not fit the target whose features the shards hold."""


# ---------------------------------------------------------------------------------------------
# locating files


def _is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_EXTENSIONS) and not name.endswith(".index.json")


def resolve_checkpoint_files(path: str, config_path: str | None = None) -> tuple[list[str], str]:
    """(weight files in load order, config file) for any accepted layout; errors say what to pass."""
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        weights = _weight_files_in_dir(path)
        config = config_path or os.path.join(path, CONFIG_NAME)
    else:
        if not _is_weight_file(path):
            raise CheckpointError(
                f"{path}: not a weight file (expected one of {', '.join(WEIGHT_EXTENSIONS)}) or a checkpoint directory"
            )
        weights = [path]
        config = config_path or os.path.join(os.path.dirname(path), CONFIG_NAME)
    config = os.path.abspath(config)
    if not os.path.isfile(config):
        raise CheckpointError(missing_config_message(path, config, explicit=config_path is not None))
    return weights, config


def missing_config_message(path: str, config: str, explicit: bool) -> str:
    """Which config file is missing, where, and the fix (the CLI takes no config option: the
    config travels with the weights, as z-lab directories and training checkpoints keep it)."""
    if explicit:
        return f"{path}: drafter config {config} does not exist"
    where = path if os.path.isdir(path) else os.path.dirname(path)
    return (
        f"{path}: the drafter config {config} is missing; put the drafter's {CONFIG_NAME} "
        f"(the one it was trained with) in {where}, beside the weights"
    )


def _weight_files_in_dir(path: str) -> list[str]:
    index = os.path.join(path, SAFETENSORS_INDEX_NAME)
    if os.path.isfile(index):
        weight_map = _read_json_file(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(
                f"{index}: no 'weight_map' (tensor name -> file); the index is not a safetensors index"
            )
        files = sorted(set(weight_map.values()))
        absent = [name for name in files if not os.path.isfile(os.path.join(path, name))]
        if absent:
            raise CheckpointError(
                f"{index}: lists shard files that are not in {path}: {absent}; the download is incomplete"
            )
        return [os.path.join(path, name) for name in files]
    single = os.path.join(path, SAFETENSORS_NAME)
    if os.path.isfile(single):
        return [single]
    candidates = sorted(name for name in os.listdir(path) if _is_weight_file(name))
    if len(candidates) == 1:
        return [os.path.join(path, candidates[0])]
    if not candidates:
        raise CheckpointError(
            f"{path}: no weights found (expected {SAFETENSORS_NAME}, {SAFETENSORS_INDEX_NAME}, or one "
            f"{'/'.join(WEIGHT_EXTENSIONS)} file); contents: {sorted(os.listdir(path))[:MAX_LISTED]}"
        )
    raise CheckpointError(
        f"{path}: several weight files and no {SAFETENSORS_INDEX_NAME} to say how they combine: {candidates}; "
        f"pass the one file to load"
    )


def _read_json_file(path: str) -> dict:
    """A JSON object from disk; anything else is a CheckpointError naming the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            obj = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"{path}: not valid JSON ({error}); the file is corrupt or still being written"
        ) from error
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(obj).__name__}")
    return obj


# ---------------------------------------------------------------------------------------------
# integrity: cheap checks that a checkpoint is completely written, before any tensor is read


def checkpoint_problem(path: str, config_path: str | None = None) -> str | None:
    """None when the checkpoint at `path` is complete, else one line saying what is wrong, naming
    the file: config.json missing or unparseable, weights missing (every shard a
    model.safetensors.index.json names), a safetensors header unreadable or the file shorter
    than its header says, an empty .pt/.pth/.bin (or a truncated zip one).

    Reads file sizes, safetensors headers and zip end records only, never tensor data, and
    prints nothing: it is meant to be called on checkpoints still being written."""
    try:
        weight_files, config_file = resolve_checkpoint_files(path, config_path)
        _read_json_file(config_file)
        return next(filter(None, map(weight_file_problem, weight_files)), None)
    except CheckpointError as error:
        return str(error)
    except OSError as error:  # a file removed or rewritten while a writer is still at work
        return f"{error.filename or path}: {error.strerror or error}"


def weight_file_problem(path: str) -> str | None:
    """What makes one weight file unusable, judged from its size and header alone."""
    size = os.path.getsize(path)
    if size == 0:
        return f"{path}: empty (0 bytes); the checkpoint was not completely written"
    if path.endswith(".safetensors"):
        return _safetensors_problem(path, size)
    with open(path, "rb") as handle:
        zipped = handle.read(4) == b"PK\x03\x04"
    # torch.save writes a zip archive; its directory is at the end, so a cut-off file has none.
    if zipped and not zipfile.is_zipfile(path):
        return f"{path}: truncated ({size} bytes, the zip archive torch.save writes has no end record)"
    return None


def _safetensors_problem(path: str, size: int) -> str | None:
    """safetensors = 8-byte little-endian header length, JSON header, then the tensor data; the
    file must be at least as long as the largest data_offsets end says."""
    truncated = f"{path}: truncated ({size} bytes"
    if size < 8:
        return f"{truncated}, shorter than the 8-byte safetensors header length)"
    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        if 8 + header_len > size:
            return f"{truncated}, the safetensors header alone needs {8 + header_len})"
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
        ends = [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"]
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
        return f"{path}: unreadable safetensors header ({type(error).__name__}: {error}); the file is corrupt"
    needed = 8 + header_len + max(ends, default=0)
    if needed > size:
        return f"{truncated}, its safetensors header says {needed}); the checkpoint was not completely written"
    return None


# ---------------------------------------------------------------------------------------------
# reading state dicts


def _unwrap_state_dict(obj, source: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensor dict inside a torch.load result, and the scalars found beside it (step, ...)."""
    metadata: dict = {}
    while isinstance(obj, dict):
        metadata.update({k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, (int, float, str))})
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj, metadata
        nested = [key for key in NESTING_KEYS if isinstance(obj.get(key), dict)]
        if not nested:
            break
        obj = obj[nested[0]]
    keys = sorted(map(str, obj))[:MAX_LISTED] if isinstance(obj, dict) else type(obj).__name__
    raise CheckpointError(
        f"{source}: no state dict found (a dict of tensors, possibly nested under one of {list(NESTING_KEYS)}); "
        f"found {keys}. Save `model.state_dict()` of the drafter"
    )


def read_state_dict(files: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """All tensors of the weight files (CPU, as stored) and any training metadata of a .pt file."""
    state: dict[str, torch.Tensor] = {}
    metadata: dict = {}
    origin: dict[str, str] = {}
    for path in files:
        if path.endswith(".safetensors"):
            part = load_safetensors_file(path, device="cpu")
        else:
            try:
                # weights_only: a checkpoint is untrusted input, and unpickling runs code.
                obj = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as error:  # noqa: BLE001 - re-raised with the file and the fix
                raise CheckpointError(
                    f"{path}: torch.load(weights_only=True) failed ({type(error).__name__}: {error}). "
                    f"specreplay never unpickles arbitrary objects; re-save with "
                    f"torch.save(model.state_dict(), path) or as safetensors"
                ) from error
            part, found = _unwrap_state_dict(obj, path)
            metadata.update(found)
        check_finite(part, path)
        for name, tensor in part.items():
            if name in state:
                raise CheckpointError(f"tensor {name!r} appears in both {origin[name]} and {path}")
            state[name] = tensor
            origin[name] = path
    return state, metadata


def nonfinite_counts(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """{name: NaN/Inf values} of the floating-point tensors holding any (one reduction each)."""
    counts = {}
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            counts[name] = int((~torch.isfinite(tensor)).sum())
    return counts


def check_finite(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Refuse a weight file with NaN/Inf: scored, it would give NaN drafts, not a bad tau."""
    bad = nonfinite_counts(tensors)
    if not bad:
        return
    first, count = next(iter(bad.items()))
    others = f" (and {len(bad) - 1} more tensors: {_listing(list(bad)[1:])})" if len(bad) > 1 else ""
    raise NonFiniteWeightsError(
        f"{path}: tensor {first} has {count} NaN/Inf values{others}; the checkpoint is damaged "
        f"(fp16 overflow in training?); use another checkpoint"
    )


def _is_ignored(name: str) -> bool:
    """Derived buffers some savers include; the drafter recomputes them from the config."""
    return name.endswith("inv_freq")


def normalize_keys(state: dict[str, torch.Tensor], expected: set[str], source: str) -> tuple[dict, list[str]]:
    """Map saved names onto the drafter's names; returns (state, prefixes stripped).

    A wrapper prefix is removed from a key only while the key is not yet a drafter name and
    the stripped remainder eventually is one. So `module._orig_mod.fc.weight` -> `fc.weight`,
    a correct `layers.0...` is never touched, and a foreign tensor (say a frozen copy of the
    target's `model.embed_tokens.weight`) keeps its saved name and is reported as unexpected.
    """
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    stripped: set[str] = set()
    for name, tensor in state.items():
        if _is_ignored(name):
            continue
        candidate, prefix = name, ""
        while candidate not in expected:
            wrapper = next((p for p in WRAPPER_PREFIXES if candidate.startswith(p)), None)
            if wrapper is None:
                break
            candidate, prefix = candidate[len(wrapper) :], prefix + wrapper
        if candidate not in expected:
            candidate, prefix = name, ""
        if candidate in out:
            raise CheckpointError(
                f"{source}: tensors {origin[candidate]!r} and {name!r} both map to drafter weight {candidate!r}; "
                f"the checkpoint holds more than one model. Save the drafter's state dict alone"
            )
        if prefix:
            stripped.add(prefix)
        out[candidate] = tensor
        origin[candidate] = name
    return out, sorted(stripped)


def _listing(names: list[str]) -> str:
    names = sorted(names)
    more = f", ... ({len(names) - MAX_LISTED} more)" if len(names) > MAX_LISTED else ""
    return ", ".join(names[:MAX_LISTED]) + more


def check_state_dict(
    state: dict[str, torch.Tensor],
    expected: dict[str, torch.Size],
    config: DrafterConfig,
    source: str,
    config_file: str,
) -> None:
    """Strict names and shapes; one error listing everything wrong, since one fix may cover all."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing: {_listing(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected: {_listing(unexpected)}")
        raise CheckpointError(
            f"{source}: weights do not match the drafter described by {config_file} "
            f"({config.num_hidden_layers} layers, target_layer_ids {config.target_layer_ids}); "
            + "; ".join(parts)
            + ". Is this a DFlash drafter checkpoint, with the config.json it was trained with?"
        )
    wrong = [
        f"{name}: checkpoint {list(state[name].shape)} vs config {list(shape)}"
        for name, shape in sorted(expected.items())
        if tuple(state[name].shape) != tuple(shape)
    ]
    if wrong:
        raise CheckpointError(
            f"{source}: {len(wrong)} tensor shapes differ from what {config_file} implies (hidden_size "
            f"{config.hidden_size}, heads {config.num_attention_heads}/{config.num_key_value_heads}, head_dim "
            f"{config.head_dim}, intermediate_size {config.intermediate_size}, "
            f"{len(config.target_layer_ids)} feature layers): "
            + "; ".join(wrong[:MAX_LISTED])
            + ". Use the config.json this checkpoint was trained with"
        )
    not_float = sorted(name for name, tensor in state.items() if not tensor.is_floating_point())
    if not_float:
        raise CheckpointError(f"{source}: non-floating-point weights {_listing(not_float)}; not a drafter checkpoint")


# ---------------------------------------------------------------------------------------------
# identity


def content_hash(files: list[str], config_raw: dict, chunk_bytes: int = 16 << 20) -> str:
    """sha256 over every weight file's bytes (streamed, each preceded by its size so file
    boundaries count) and the canonical config JSON (so whitespace edits do not change it)."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(os.path.getsize(path).to_bytes(8, "little"))
        with open(path, "rb") as handle:
            while chunk := handle.read(chunk_bytes):
                digest.update(chunk)
    digest.update(json.dumps(config_raw, sort_keys=True, separators=(",", ":")).encode())
    return digest.hexdigest()


def parse_step(path: str, *metadata: dict) -> int | None:
    """Training step from metadata fields (config first), else from the path's nearest component."""
    for source in metadata:
        for name in STEP_FIELDS:
            value = source.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, str) and value.isdigit():
                return int(value)
    for part in reversed(os.path.abspath(path).split(os.sep)):
        matches = STEP_PATTERN.findall(part)
        if matches:
            return int(matches[-1])
    return None


def display_name(path: str) -> str:
    """Directory name, or parent/file; a bare step directory (`checkpoint-1500`) gets its run's name too."""
    path = os.path.abspath(path)
    base, parent = os.path.basename(path), os.path.basename(os.path.dirname(path))
    if os.path.isfile(path) or STEP_PATTERN.fullmatch(base) or re.fullmatch(r"\d+", base):
        return f"{parent}/{base}" if parent else base
    return base


@dataclass
class CheckpointInfo:
    """Identity of a loaded checkpoint; every output row carries it."""

    path: str  # absolute
    content_hash: str  # sha256 hex over weight bytes + canonical config JSON
    config: DrafterConfig
    config_raw: dict = field(repr=False)
    step: int | None
    name: str
    weight_files: list[str] = field(default_factory=list)
    config_file: str = ""
    stripped_prefixes: list[str] = field(default_factory=list)  # e.g. ["module._orig_mod."]


# ---------------------------------------------------------------------------------------------
# loading


def _expected_shapes(config: DrafterConfig) -> tuple[DFlashDrafter, dict[str, torch.Size]]:
    """A drafter skeleton on the meta device: names and shapes without allocating 1e9 weights."""
    with torch.device("meta"):
        skeleton = DFlashDrafter(config)
    return skeleton, {name: tensor.shape for name, tensor in skeleton.state_dict().items()}


def _materialize(skeleton: DFlashDrafter, state: dict, dtype, device, source: str = "checkpoint") -> DFlashDrafter:
    """Give the meta skeleton the checkpoint's tensors, and rebuild the rotary buffers.

    The rotary inverse frequencies are not in the state dict (non-persistent) and a meta
    skeleton has none, so they are recomputed on `device`, in float32 whatever `dtype` is,
    as the reference keeps them (transformers casts only cos/sin to the activation dtype).
    """
    stored = state
    state = {name: tensor.to(device=device, dtype=dtype).contiguous() for name, tensor in state.items()}
    overflow = nonfinite_counts({name: t for name, t in state.items() if stored[name].dtype != dtype})
    if overflow:  # finite as stored (check_finite), so the cast to the compute dtype overflowed
        name, count = next(iter(overflow.items()))
        largest = float(stored[name].abs().max())
        raise NonFiniteWeightsError(
            f"{source}: tensor {name} has {count} values beyond the range of {str(dtype).replace('torch.', '')} "
            f"(largest |value| {largest:.3g}, stored as {str(stored[name].dtype).replace('torch.', '')}); "
            f"score with --dtype fp32"
        )
    skeleton.load_state_dict(state, strict=True, assign=True)
    for module_name, module in list(skeleton.named_modules()):
        if isinstance(module, Qwen3RotaryEmbedding):
            parent_name, _, attr = module_name.rpartition(".")
            parent = skeleton.get_submodule(parent_name) if parent_name else skeleton
            setattr(parent, attr, Qwen3RotaryEmbedding(module.config).to(device))  # built on CPU, outside meta
    leftover = [name for name, t in list(skeleton.named_parameters()) + list(skeleton.named_buffers()) if t.is_meta]
    if leftover:  # a new kind of non-persistent buffer in drafter.py; fail rather than run on garbage
        raise CheckpointError(f"internal: drafter tensors {leftover} were not materialized by the loader")
    skeleton.eval().requires_grad_(False)
    return skeleton


def _read_config(config_file: str) -> tuple[DrafterConfig, dict]:
    config_raw = _read_json_file(config_file)
    return parse_drafter_config(config_raw, source=config_file), config_raw


def check_checkpoint(path: str, config_path: str | None = None) -> None:
    """Raise checkpoint_problem's line as a CheckpointError (before any tensor is read)."""
    problem = checkpoint_problem(path, config_path)
    if problem is not None:
        raise CheckpointError(problem)


def read_drafter_config(path: str, config_path: str | None = None) -> DrafterConfig:
    """The checkpoint's parsed config without reading any weights, so `check_compatibility`
    can reject a drafter before gigabytes of weights are loaded. A partly written checkpoint is
    refused here already (checkpoint_problem reads headers only)."""
    check_checkpoint(path, config_path)
    _, config_file = resolve_checkpoint_files(path, config_path)
    return _read_config(config_file)[0]


def load_drafter(
    path: str, dtype: torch.dtype = torch.float32, device="cpu", config_path: str | None = None
) -> tuple[DFlashDrafter, CheckpointInfo]:
    """Load a drafter checkpoint strictly; see the module docstring for accepted layouts.

    Raises CheckpointError (files, names, shapes; NonFiniteWeightsError for NaN/Inf weights, or
    weights the compute `dtype` cannot hold) or DrafterConfigError (the config describes a
    variant or field specreplay cannot score exactly), both before any compute; a partly
    written checkpoint (checkpoint_problem) before any tensor is read.
    """
    check_checkpoint(path, config_path)
    weight_files, config_file = resolve_checkpoint_files(path, config_path)
    config, config_raw = _read_config(config_file)
    source = weight_files[0] if len(weight_files) == 1 else os.path.dirname(weight_files[0])
    skeleton, expected = _expected_shapes(config)
    raw_state, metadata = read_state_dict(weight_files)
    state, stripped = normalize_keys(raw_state, set(expected), source)
    check_state_dict(state, expected, config, source, config_file)
    drafter = _materialize(skeleton, state, dtype, device, source)
    info = CheckpointInfo(
        path=os.path.abspath(path),
        content_hash=content_hash(weight_files, config_raw),
        config=config,
        config_raw=config_raw,
        step=parse_step(path, config_raw, metadata),
        name=display_name(path),
        weight_files=weight_files,
        config_file=config_file,
        stripped_prefixes=stripped,
    )
    return drafter, info


# ---------------------------------------------------------------------------------------------
# compatibility with the shards


def _manifest_target(manifest: dict) -> tuple[list[int], dict, str]:
    """(stored feature layer ids, target facts, a name for messages) from an extract manifest.

    pipeline/extract/run.py writes `settings.layer_ids`, the target's identity (num_layers,
    hidden_size, vocab_size = embedding rows, ...) at `settings.target`, and the full TargetInfo
    (with `name` and `path`) at the top-level `target`.
    """
    settings = manifest.get("settings") or {}
    layer_ids = settings.get("layer_ids")
    target = {**(manifest.get("target") or {}), **(settings.get("target") or {})}
    if layer_ids is None or not target:
        raise CompatibilityError(
            "manifest has no settings.layer_ids / settings.target; it was not written by this specreplay's "
            "extract (re-run extract)"
        )
    for name in ("num_layers", "hidden_size", "vocab_size"):
        if name not in target:
            raise CompatibilityError(f"manifest settings.target lacks {name!r}; re-run extract")
    label = target.get("name") or target.get("path") or target.get("architecture") or "the extracted target"
    return [int(i) for i in layer_ids], target, str(label)


def check_compatibility(config: DrafterConfig, manifest: dict, ckpt_path: str) -> None:
    """Every drafter/target mismatch as an error naming both sides, before any weight is read.

    The drafter has no embedding or head of its own: block inputs are the target's embeddings
    and `fc` maps the concatenated target features (n * target hidden) to its hidden size, so
    its hidden size must equal the target's and the mask token must be a row of the target's
    embedding. The drafter's `vocab_size` field is otherwise unused by the reference, but a
    different value means it was trained for another tokenizer.
    """
    stored, target, label = _manifest_target(manifest)
    where = f"drafter {ckpt_path} vs shards of {label}"
    _check_block_and_target(config, target, where)
    _check_layers(config, stored, where)
    _check_widths(config, target, where)


def _check_block_and_target(config: DrafterConfig, target: dict, where: str) -> None:
    if config.block_size < 2:
        raise CompatibilityError(
            f"{where}: block_size {config.block_size} drafts nothing (a block is [last token, B-1 masks]); "
            f"block_size must be >= 2"
        )
    if config.num_target_layers is not None and config.num_target_layers != int(target["num_layers"]):
        raise CompatibilityError(
            f"{where}: drafter num_target_layers {config.num_target_layers} != target num_layers "
            f"{target['num_layers']}; the drafter was trained for a different target model"
        )


def _check_layers(config: DrafterConfig, stored: list[int], where: str) -> None:
    missing = [i for i in config.target_layer_ids if i not in stored]
    if missing:
        union = sorted(set(stored) | set(config.target_layer_ids))
        raise CompatibilityError(
            f"{where}: drafter target_layer_ids {config.target_layer_ids} but the shards store layer ids {stored} "
            f"(missing {missing}); re-run extract with --layer-ids {','.join(map(str, union))}"
        )


def _check_widths(config: DrafterConfig, target: dict, where: str) -> None:
    hidden, vocab = int(target["hidden_size"]), int(target["vocab_size"])
    if config.hidden_size != hidden:
        raise CompatibilityError(
            f"{where}: drafter hidden_size {config.hidden_size} (fc expects {len(config.target_layer_ids)} x "
            f"{config.hidden_size} feature columns) != target hidden_size {hidden}; the drafter was trained for a "
            f"different target model"
        )
    if not 0 <= config.mask_token_id < vocab:
        raise CompatibilityError(
            f"{where}: drafter mask_token_id {config.mask_token_id} is not a row of the target embedding "
            f"(vocab_size {vocab}, valid ids 0..{vocab - 1}); the drafter was trained for a different tokenizer"
        )
    if config.vocab_size != vocab:
        raise CompatibilityError(
            f"{where}: drafter vocab_size {config.vocab_size} != target vocab_size {vocab}; the drafter was "
            f"configured for a different tokenizer (set vocab_size {vocab} in its config.json if only the "
            f"field is off: the drafter uses the target's embedding and lm_head)"
        )
