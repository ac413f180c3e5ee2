"""A llama.cpp drafter GGUF (`convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET`) read back as
the checkpoint it was converted from: the config.json of the layout whose meaning llama.cpp runs,
and the tensors under that layout's names, which load.py then loads strictly as it loads that
checkpoint's directory (docs/gguf-drafters.md: per family, the GGUF architecture, the keys read
and the inverse of the converter's mapping; gguf_layouts.py holds it).

The GGUF holds no target embedding or lm_head unless the drafter had its own (llama.cpp borrows the
target's at run time, as specreplay takes them from the shards). What the converter drops (t2d,
DeepSpec's full-vocabulary lm_head) is rebuilt as llama.cpp rebuilds it. Whatever the file holds
that no family reads back (a key, a tensor, another architecture: a target model's GGUF) is one
CheckpointError naming the file, the key or tensor, and what to do instead.
"""

from __future__ import annotations

import functools
import os

import torch

from proposers.checkpoints.files import CheckpointError, check_finite
from proposers.checkpoints.gguf_file import GgufFile, read_gguf
from proposers.checkpoints.gguf_layouts import READERS, Metadata, Reading

SUFFIX = ".gguf"


def is_gguf(path: str) -> bool:
    """A GGUF file given as the checkpoint (`--ckpt drafter.gguf`)."""
    return str(path).lower().endswith(SUFFIX) and os.path.isfile(path)


def gguf_config(path: str) -> dict:
    """The config.json of the layout the drafter GGUF at `path` reads back as (no tensor read)."""
    return _reading(path).config


def gguf_state(path: str) -> dict[str, torch.Tensor]:
    """The drafter's tensors under its layout's names (NaN/Inf refused, as for any checkpoint)."""
    state = {name: make() for name, make in _reading(path).tensors.items()}
    check_finite(state, path)
    return state


def _reading(path: str) -> Reading:
    stat = os.stat(path)
    return _read(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read(path: str, size: int, mtime_ns: int) -> Reading:
    """Once per version of the file: the config is asked for before the weights, and more than once."""
    file = read_gguf(path)
    arch = file.key("general.architecture")
    if not isinstance(arch, str) or arch not in READERS:
        raise not_a_drafter(file, arch)
    meta = Metadata(file, arch)
    label, reading = READERS[arch](meta)
    meta.check_all_read(label)
    return reading


def not_a_drafter(file: GgufFile, arch) -> CheckpointError:
    """The refusal of a GGUF whose architecture is no drafter's llama.cpp defines (a target model's)."""
    if not isinstance(arch, str):
        return CheckpointError(f"{file.path}: a GGUF without a 'general.architecture' name; not a llama.cpp model file")
    nextn = file.key(f"{arch}.nextn_predict_layers")
    mtp = (
        f". Its MTP head ({arch}.nextn_predict_layers = {nextn}) is not read from a GGUF: pass the target's HF "
        f"checkpoint directory to --ckpt, whose config.json specreplay reads as its native MTP head"
        if nextn
        else ""
    )
    return CheckpointError(
        f"{file.path}: GGUF architecture {arch!r} is not a drafter's: llama.cpp's drafter GGUFs are 'dflash' "
        f"(DFlash, DFlash2, DSpark) and 'eagle3' (EAGLE-3), written by `convert_hf_to_gguf.py DRAFTER_DIR "
        f"--target-model-dir TARGET_DIR`; a target model's GGUF is extract's --model, not a --ckpt{mtp}"
    )
