"""Which files make a drafter checkpoint, whether they are whole, and what identifies it.

Accepted layouts:
  - a z-lab directory: config.json + model.safetensors, or sharded safetensors listed by
    model.safetensors.index.json (`weight_map`);
  - a training checkpoint: one .safetensors / .pt / .pth / .bin file holding a state dict
    (a .pt may nest it under "model", "state_dict", "module" or "model_state_dict"), with its
    config.json next to it or passed as `config_path=`; or a directory holding one such file
    plus config.json.

A `mask_embedding.pt` beside the weights is refused by name: the engines replace the mask
token's embedding with it, which the replay does not (docs/config-fields.md).

`checkpoint_problem` tells a completely written checkpoint from a partly written one from
file sizes and headers alone (no tensor data), so a truncated file is one clear error, not a
deserializer's traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file as load_safetensors_file

from pipeline.common.errors import UserError
from proposers import baselines

MAX_LISTED = 20  # names listed in one error message

CONFIG_NAME = "config.json"


SAFETENSORS_NAME = "model.safetensors"


SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"


WEIGHT_EXTENSIONS = (".safetensors", ".pt", ".pth", ".bin")


# A file the engines read beside a DFlash drafter's weights that the replay does not implement
MASK_EMBEDDING_NAME = "mask_embedding.pt"


# Keys under which training loops nest the model's state dict inside a .pt checkpoint.
NESTING_KEYS = ("model", "state_dict", "module", "model_state_dict")


# Training-metadata fields that carry the optimizer step.
STEP_FIELDS = ("step", "global_step", "training_step")


# `step_20000`, `checkpoint-1500`, `step20000`, `global_step500`, `ckpt-000500`, `iter_300`.
STEP_PATTERN = re.compile(r"(?:^|[^a-z])(?:global_step|step|checkpoint|ckpt|iter|iteration)[-_]?(\d+)(?![a-z])", re.I)


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded exactly as its config describes."""


class NonFiniteWeightsError(CheckpointError):
    """A checkpoint holding NaN/Inf weights (or weights the compute dtype cannot hold)."""


def _is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_EXTENSIONS) and not name.endswith(".index.json")


def resolve_checkpoint_files(path: str, config_path: str | None = None) -> tuple[list[str], str]:
    """(weight files in load order, config file) for any accepted layout; errors say what to pass."""
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    _refuse_mask_embedding(path)
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


def _refuse_mask_embedding(path: str) -> None:
    """mask_embedding.pt beside the weights: vLLM (models/qwen3_dflash.py), SGLang
    (speculative/dflash_worker_v2.py) and llama.cpp (conversion/qwen.py) replace the embedding of
    mask_token_id with its vector; the replay embeds mask slots with the target's row."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    if os.path.isfile(os.path.join(folder, MASK_EMBEDDING_NAME)):
        raise CheckpointError(
            f"{path}: file {MASK_EMBEDDING_NAME!r} beside the weights: vLLM, SGLang and llama.cpp replace the "
            f"embedding of mask_token_id with its vector, specreplay embeds the mask slots with the target's own "
            f"row; refusing rather than scoring it wrong"
        )


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
        weight_map = read_json_file(index).get("weight_map")
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


def read_json_file(path: str) -> dict:
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


def checkpoint_problem(path: str, config_path: str | None = None) -> str | None:
    """None when the checkpoint at `path` is complete, else one line saying what is wrong, naming
    the file: config.json missing or unparseable, weights missing (every shard a
    model.safetensors.index.json names), a safetensors header unreadable or the file shorter
    than its header says, an empty .pt/.pth/.bin (or a truncated zip one).

    Reads file sizes, safetensors headers and zip end records only, never tensor data, and
    prints nothing: it is meant to be called on checkpoints still being written."""
    try:
        weight_files, config_file = resolve_checkpoint_files(path, config_path)
        read_json_file(config_file)
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


def read_state_dict(files: list[str], skip: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict]:
    """All tensors of the weight files (CPU, as stored) but those named in `skip`, and any training
    metadata of a .pt file. `skip` names tensors the drafter never reads (DraftHead.reloaded_weights),
    dropped before the NaN check: their values do not matter, so they may be placeholders."""
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
        part = {name: tensor for name, tensor in part.items() if name not in skip}
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
    others = f" (and {len(bad) - 1} more tensors: {listing(list(bad)[1:])})" if len(bad) > 1 else ""
    raise NonFiniteWeightsError(
        f"{path}: tensor {first} has {count} NaN/Inf values{others}; the checkpoint is damaged "
        f"(fp16 overflow in training?); use another checkpoint"
    )


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
    """Directory name, or parent/file; a bare step directory (`checkpoint-1500`) gets its run's name too;
    a baseline's name as given (`ngram:vllm:k=4`)."""
    if baselines.is_named(path):
        return path
    path = os.path.abspath(path)
    base, parent = os.path.basename(path), os.path.basename(os.path.dirname(path))
    if os.path.isfile(path) or STEP_PATTERN.fullmatch(base) or re.fullmatch(r"\d+", base):
        return f"{parent}/{base}" if parent else base
    return base


def check_checkpoint(path: str, config_path: str | None = None) -> None:
    """Raise checkpoint_problem's line as a CheckpointError (before any tensor is read)."""
    problem = checkpoint_problem(path, config_path)
    if problem is not None:
        raise CheckpointError(problem)


def listing(names: list[str]) -> str:
    names = sorted(names)
    more = f", ... ({len(names) - MAX_LISTED} more)" if len(names) > MAX_LISTED else ""
    return ", ".join(names[:MAX_LISTED]) + more


def read_prefixed(
    files: list[str], prefix: str | tuple[str, ...], source: str, promise: str | None = None
) -> dict[str, torch.Tensor]:
    """The tensors named `prefix`... of safetensors files, the prefix stripped, each read alone
    (safe_open): a target's MTP head out of its checkpoint without reading the target. Several
    prefixes (a stack of heads, `model.layers.{L + i}.`): what they share up to its last dot is
    stripped, so that each name keeps its head's index. `promise`: the config field that says the
    head is there, named when it is not."""
    prefixes = (prefix,) if isinstance(prefix, str) else prefix
    shared = os.path.commonprefix(list(prefixes))
    cut = len(prefixes[0]) if len(prefixes) == 1 else shared.rfind(".") + 1
    state: dict[str, torch.Tensor] = {}
    for path in files:
        if not path.endswith(".safetensors"):
            raise CheckpointError(f"{path}: a target's MTP head is read from safetensors files only")
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.startswith(prefixes):
                    state[name[cut:]] = handle.get_tensor(name)
    prefix = prefixes[0]
    if not state:
        said = f", although its config.json's {promise}" if promise else ""
        raise CheckpointError(
            f"{source}: no '{prefix}*' tensors in its weights{said}: this target has no native MTP head to score"
        )
    check_finite(state, source)
    return state


def tensors_hash(state: dict[str, torch.Tensor], config_raw: dict) -> str:
    """sha256 over the tensors (by name) and the canonical config JSON: a part of a checkpoint."""
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    digest.update(json.dumps(config_raw, sort_keys=True, separators=(",", ":")).encode())
    return digest.hexdigest()
