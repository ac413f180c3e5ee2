"""Load a drafter checkpoint strictly into its family's model.

Wrapper prefixes (`module.`, `_orig_mod.`, `model.`, `draft_model.`, `drafter.`) are stripped
from a key only when that turns it into a name the drafter has, so a correct name is never
touched and a foreign tensor keeps the name it was saved under in the error. Every missing,
unexpected or mis-shaped tensor is an error: a drafter scored with a silently dropped weight
would still produce numbers, just wrong ones. Which files make a checkpoint, and whether they
are whole, is files.py's; a llama.cpp drafter GGUF is read back as the checkpoint it was
converted from by gguf.py; whether it fits the shards, compatibility.py's.

Everything here runs before any compute; nothing of the target model is loaded. `load_proposer`
hands the loaded drafter to the replay behind the proposer interface (proposers/toolkit/neural.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from proposers import baselines
from proposers.checkpoints import gguf
from proposers.checkpoints.files import (
    MAX_LISTED,
    CheckpointError,
    NonFiniteWeightsError,
    check_checkpoint,
    content_hash,
    display_name,
    listing,
    nonfinite_counts,
    parse_step,
    read_json_file,
    read_prefixed,
    read_state_dict,
    resolve_checkpoint_files,
    tensors_hash,
)
from proposers.detect import build_drafter, parse_config
from proposers.layouts import Override
from proposers.registry import family_label
from proposers.toolkit.config import DrafterConfig
from proposers.toolkit.neural import neural_proposer

# Prefixes added by DDP/DeepSpeed (`module.`), torch.compile (`_orig_mod.`) and training wrappers.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.", "draft_model.", "drafter.")


# ---------------------------------------------------------------------------------------------
# locating files


# ---------------------------------------------------------------------------------------------
# integrity: cheap checks that a checkpoint is completely written, before any tensor is read


# ---------------------------------------------------------------------------------------------
# reading state dicts


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
            parts.append(f"{len(missing)} missing: {listing(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected: {listing(unexpected)}")
        raise CheckpointError(
            f"{source}: weights do not match the drafter described by {config_file} "
            f"({config.num_hidden_layers} layers, target_layer_ids {config.target_layer_ids}); "
            + "; ".join(parts)
            + f". Was this checkpoint trained as the {family_label(config.family)} drafter its config declares, "
            "with this config.json?"
        )
    wrong = [
        f"{name}: checkpoint {list(state[name].shape)} vs config {list(shape)}"
        for name, (shape, _) in sorted(expected.items())
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
    kinds = {name: dtype.is_floating_point for name, (_, dtype) in expected.items()}
    wrong_kind = sorted(name for name, tensor in state.items() if tensor.is_floating_point() != kinds[name])
    if wrong_kind:  # integer id maps (d2t, t2d) stay integers; a weight is never one
        raise CheckpointError(
            f"{source}: tensors {listing(wrong_kind)} are not of the kind the drafter has (floating-point weights, "
            f"integer or boolean id maps); not a drafter checkpoint"
        )


# ---------------------------------------------------------------------------------------------
# identity


@dataclass
class CheckpointInfo:
    """Identity of a loaded checkpoint; every output row carries it."""

    path: str  # absolute, or a baseline's name as given (`ngram:vllm:k=4`)
    content_hash: str  # sha256 hex over weight bytes + canonical config JSON
    config: DrafterConfig
    config_raw: dict = field(repr=False)
    step: int | None
    name: str
    weight_files: list[str] = field(default_factory=list)
    config_file: str = ""
    stripped_prefixes: list[str] = field(default_factory=list)  # e.g. ["module._orig_mod."]
    assumed: str | None = None  # what family detection assumed (proposers/layouts.py); None: the file said


# ---------------------------------------------------------------------------------------------
# loading


def _expected_shapes(config: DrafterConfig) -> tuple[torch.nn.Module, dict[str, tuple[torch.Size, torch.dtype]]]:
    """A drafter skeleton on the meta device: names, shapes and dtypes without allocating 1e9 weights."""
    with torch.device("meta"):
        skeleton = build_drafter(config)
    return skeleton, _expected_of(skeleton)


def _expected_of(skeleton: torch.nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {name: (tensor.shape, tensor.dtype) for name, tensor in skeleton.state_dict().items()}


def _drop_absent_optional(skeleton, state: dict, expected: dict) -> dict:
    """When the checkpoint leaves out only weights the family may take from the target
    (DeepSpec's copies of its embedding and lm_head), the skeleton drops them."""
    absent = set(expected) - set(state)
    if absent and absent <= set(skeleton.optional_weights):
        skeleton.drop_weights(sorted(absent))
        return _expected_of(skeleton)
    return expected


def _materialize(skeleton: torch.nn.Module, state: dict, dtype, device, source: str = "checkpoint") -> torch.nn.Module:
    """Give the meta skeleton the checkpoint's tensors, and rebuild the rotary buffers.

    The rotary inverse frequencies are not in the state dict (non-persistent) and a meta
    skeleton has none, so they are recomputed on `device`, in float32 whatever `dtype` is,
    as the reference keeps them (transformers casts only cos/sin to the activation dtype).
    """
    stored = state
    # weights in the compute dtype; integer and boolean id maps (d2t, t2d) as they are
    state = {
        name: tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
        for name, tensor in state.items()
    }
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
    skeleton.rotary = type(skeleton.rotary)(skeleton.rotary.config).to(device)  # built on CPU, outside meta
    leftover = [name for name, t in list(skeleton.named_parameters()) + list(skeleton.named_buffers()) if t.is_meta]
    if leftover:  # a new kind of non-persistent buffer in drafter.py; fail rather than run on garbage
        raise CheckpointError(f"internal: drafter tensors {leftover} were not materialized by the loader")
    skeleton.eval().requires_grad_(False)
    return skeleton


def _read_config(config_file: str, target_layers: int | None = None, override: Override | None = None):
    """(Parsed, the raw config): a config.json, or the config a drafter GGUF reads back as."""
    if baselines.is_named(config_file):
        config_raw = baselines.config_of(config_file)
    elif gguf.is_gguf(config_file):
        config_raw = gguf.gguf_config(config_file)
    else:
        config_raw = read_json_file(config_file)
    return parse_config(config_raw, config_file, target_layers, override), config_raw


def _checked_files(path: str, config_path: str | None = None) -> tuple[list[str], str]:
    """(weight files, config file) of a checkpoint complete as far as sizes and headers tell; a
    drafter GGUF is both (proposers/checkpoints/gguf.py)."""
    if gguf.is_gguf(path):
        return [os.path.abspath(path)], os.path.abspath(path)
    check_checkpoint(path, config_path)
    return resolve_checkpoint_files(path, config_path)


def is_config_only(path: str) -> bool:
    """A proposer that loads no weights is given as its config file alone (`--ckpt ngram.json`), or
    by name (`--ckpt ngram:vllm:k=4`, proposers/baselines.py)."""
    return (path.endswith(".json") and os.path.isfile(path)) or baselines.is_named(path)


def read_drafter_config(
    path: str, config_path: str | None = None, target_layers: int | None = None, override: Override | None = None
) -> DrafterConfig:
    """The checkpoint's parsed config without reading any weights, so `check_compatibility`
    can reject a drafter before gigabytes of weights are loaded. A partly written checkpoint is
    refused here already (checkpoint_problem reads headers only)."""
    if is_config_only(path):
        return _read_config(path, target_layers, override)[0].config
    _, config_file = _checked_files(path, config_path)
    return _read_config(config_file, target_layers, override)[0].config


def _read_weights(config: DrafterConfig, skeleton, weight_files: list[str], source: str) -> tuple[dict, dict]:
    """(tensors, training metadata): the whole files less what the drafter never reads, or only the
    drafter's part of a target's checkpoint."""
    prefix = skeleton.embedded_prefix
    if gguf.is_gguf(weight_files[0]):
        return gguf.gguf_state(weight_files[0]), {}
    if prefix is None:
        return read_state_dict(weight_files, skip=skeleton.reloaded_weights)
    return read_prefixed(weight_files, prefix, source, skeleton.embedded_promise), {}


def _identity(drafter, weight_files: list[str], state: dict, config_raw: dict) -> str:
    """The content hash: of the weight files, or of the drafter's own tensors inside a target's
    checkpoint (hashing the whole target would read it all)."""
    if drafter.embedded_prefix is not None:
        return tensors_hash(state, config_raw)
    return content_hash(weight_files, config_raw)


def load_drafter(
    path: str,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    config_path: str | None = None,
    target_layers: int | None = None,
    override: Override | None = None,
) -> tuple[torch.nn.Module, CheckpointInfo]:
    """Load a drafter checkpoint strictly; see the module docstring for accepted layouts.

    Raises CheckpointError (files, names, shapes; NonFiniteWeightsError for NaN/Inf weights, or
    weights the compute `dtype` cannot hold) or DrafterConfigError (the config describes a
    variant or field specreplay cannot score exactly), both before any compute; a partly
    written checkpoint (checkpoint_problem) before any tensor is read.
    """
    weight_files, config_file = _checked_files(path, config_path)
    parsed, config_raw = _read_config(config_file, target_layers, override)
    source = weight_files[0] if len(weight_files) == 1 else os.path.dirname(weight_files[0])
    drafter, raw_state, metadata, stripped = _load_weights(
        parsed.config, weight_files, config_file, source, dtype, device
    )
    info = CheckpointInfo(
        path=os.path.abspath(path),
        content_hash=_identity(drafter, weight_files, raw_state, config_raw),
        config=parsed.config,
        config_raw=config_raw,
        step=parse_step(path, config_raw, metadata),
        name=display_name(path),
        weight_files=weight_files,
        config_file=config_file,
        stripped_prefixes=stripped,
        assumed=parsed.assumed,
    )
    return drafter, info


def _load_weights(config: DrafterConfig, weight_files: list[str], config_file: str, source: str, dtype, device):
    """(the drafter with its weights, the tensors as read, training metadata, prefixes stripped)."""
    skeleton, expected = _expected_shapes(config)
    raw_state, metadata = _read_weights(config, skeleton, weight_files, source)
    skeleton.check_checkpoint(raw_state, source, config_file)
    state, stripped = normalize_keys(skeleton.canonical_names(raw_state), set(expected), source)
    expected = _drop_absent_optional(skeleton, state, expected)
    check_state_dict(state, expected, config, source, config_file)
    drafter = _materialize(skeleton, state, dtype, device, source)
    drafter.check_loaded(source)
    return drafter, raw_state, metadata, stripped


def load_proposer(path: str, dtype=torch.float32, device="cpu", target_layers=None, override=None):
    """(the checkpoint behind the proposer interface, its CheckpointInfo): a drafter's weights loaded
    (load_drafter), or the proposer of a family without weights built from its config file."""
    if not is_config_only(path):
        drafter, info = load_drafter(path, dtype, device, target_layers=target_layers, override=override)
        return neural_proposer(drafter), info
    parsed, config_raw = _read_config(path, target_layers, override)
    if parsed.family.proposer is None:
        raise CheckpointError(
            f"{path}: a {parsed.family.label} drafter needs its weights: pass its checkpoint directory (config.json "
            f"and weights), not its config alone"
        )
    proposer = parsed.family.proposer(parsed.config)
    weights = proposer.load(dtype, device) if hasattr(proposer, "load") else {}  # a draft model's own
    where = path if baselines.is_named(path) else os.path.abspath(path)  # a name is kept as given
    info = CheckpointInfo(
        path=where,
        content_hash=tensors_hash(weights, config_raw),
        config=parsed.config,
        config_raw=config_raw,
        step=None,
        name=display_name(path),
        config_file=where,
        assumed=parsed.assumed,
    )
    return proposer, info
