"""The one interface every capture format implements, and the checks they share.

A format lists its capture's files, and makes each an `Entry` (one per sample) from headers only (shapes, dtypes, token
counts: no tensor data beyond a probe of the first and last positions), so a malformed capture is
refused before anything is written; it then loads one sample at a time (`Captured`), so a capture
of many GB never has to fit in memory. Formats: vllm.py, speculators.py, specforge.py.

A sample's tokens are teacher-forced: `prompt_len` tokens of prompt, then the captured response.
Where the producer marks the response with a loss mask (speculators, SpecForge), the prompt ends at
the first supervised token and the sample at the end of that supervised run (a later turn of a
conversation is not this response's continuation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.common.errors import UserError
from pipeline.common.layer_ids import parse_layer_ids


@dataclass
class Entry:
    """One captured sample as its file's header describes it."""

    path: str  # the capture file (messages name it)
    sample_id: str
    tokens: int  # N, the captured positions
    prompt_len: int  # P: positions 0..P-1 are prompt
    stated: list[int]  # the feature block's layer ids, as the producer numbers them, in file order
    final: bool  # whether a separate final hidden state (after the norm) is stored
    dtype: torch.dtype  # of the feature block
    hidden: int  # H
    length: int | None = None  # positions kept (the end of the first supervised run); None: all
    extra: dict = field(default_factory=dict)  # what the format needs to load it again

    @property
    def kept(self) -> int:
        return self.tokens if self.length is None else self.length


@dataclass
class Captured:
    """One sample's tensors as the producer stored them (cut to the entry's kept positions)."""

    input_ids: torch.Tensor  # [N] int64
    block: torch.Tensor  # [N, n, H] the feature block, capture dtype (float8_e4m3fn with `scale`)
    scale: torch.Tensor | None = None  # [N] float32: an fp8 block's per-token scale (value = q * scale)
    final: torch.Tensor | None = None  # [N, H] the final hidden state after the norm, when stored


class CaptureFormat:
    """What a format module provides: its name, its layer numbering, its entries and samples."""

    name: str = ""
    convention: str = ""  # "before" | "output" (pipeline/imports/layers.py)

    def files(self) -> list:
        """The capture's sample files (in sample order), from a directory listing alone."""
        raise NotImplementedError

    def entry(self, file) -> Entry:
        """One of `files()` as an Entry, from its header (UserError naming it when malformed)."""
        raise NotImplementedError

    def load(self, entry: Entry) -> Captured:
        raise NotImplementedError

    def identity(self) -> dict:
        """What names this capture in the manifest (compared on resume)."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------
# checks every format applies


def damaged(path: str, why) -> UserError:
    return UserError(f"{path}: cannot read it ({why}); the file is damaged or not a capture file: re-capture it")


def zero_vectors(block: torch.Tensor) -> tuple[int, int, int] | None:
    """(column, first position, count) of the first captured layer holding an all-zero hidden
    vector [H] at some position of `block` [N, n, H], or None. A real hidden state is never
    exactly zero; a capture read from unwritten cache slots is (the vLLM bug behind speculators
    #613, and block-size mismatches on hybrid targets)."""
    zero = block.reshape(block.shape[0], block.shape[1], -1).float().abs().amax(dim=-1) == 0  # [N, n]
    if not bool(zero.any()):
        return None
    column = int(zero.any(dim=0).nonzero()[0, 0])
    rows = zero[:, column]
    return column, int(rows.nonzero()[0, 0]), int(rows.sum())


def refuse_zeros(path: str, block: torch.Tensor, names: list[str], total: int | None = None) -> None:
    """UserError naming the file when a captured layer holds an all-zero hidden vector."""
    found = zero_vectors(block)
    if found is None:
        return
    column, first, count = found
    where = f"every position ({count})" if count == (total or block.shape[0]) else f"{count} positions, first {first}"
    raise UserError(
        f"{path}: the hidden states of {names[column]} are all zero at {where}; the capture is broken "
        f"(vLLM wrote unwritten cache slots: see speculators #613), re-capture it"
    )


def probe_zeros(path: str, first: torch.Tensor, last: torch.Tensor, names: list[str]) -> None:
    """The cheap check the listing makes: the first and last positions [1, n, H] of a block."""
    refuse_zeros(path, torch.cat([first, last]), names)


def loss_mask_span(mask: list[int], path: str) -> tuple[int, int]:
    """(prompt_len, end): the first supervised run of a loss mask, as positions P..end-1."""
    try:
        start = mask.index(1)
    except ValueError:
        raise UserError(f"{path}: its loss mask marks no response token; nothing to import") from None
    if start == 0:
        raise UserError(f"{path}: its loss mask marks position 0 as response; a sample needs a prompt token")
    end = start
    while end < len(mask) and mask[end] == 1:
        end += 1
    return start, end


def block_layers(width: int, hidden: int, stated: list[int], path: str) -> int:
    """n, the layers a flat [.., n*H] block holds, checked against the stated ids."""
    if width % hidden or width // hidden != len(stated):
        raise UserError(
            f"{path}: its feature block is {width} wide, i.e. {width / hidden:g} layers of {hidden}; the capture "
            f"config names {len(stated)} layers ({stated}): the layers do not match what was captured"
        )
    return len(stated)


# ---------------------------------------------------------------------------------------------
# which layers the producer captured: a capture config, or ids given on the command line


def dig(raw, dotted: str):
    for part in dotted.split("."):
        if not isinstance(raw, dict) or part not in raw:
            return None
        raw = raw[part]
    return raw


def stated_ids(config_path: str | None, given: str | None, keys: tuple[str, ...], default, fix: str) -> tuple:
    """(the producer's layer ids, where they came from): `--captured-layer-ids`, else the first
    of `keys` (dotted paths) found in the capture config JSON, else `default` (a producer's own
    documented default, or None: then UserError with `fix`)."""
    if given is not None:
        return parse_layer_ids(given), "--captured-layer-ids"
    if config_path is not None:
        return ids_from_config(config_path, keys), f"--capture-config {config_path}"
    if default is not None:
        return default
    raise UserError(fix)


def ids_from_config(path: str, keys: tuple[str, ...]) -> list[int]:
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--capture-config {path}: no such file") from None
    except json.JSONDecodeError as error:
        raise UserError(f"--capture-config {path}: not valid JSON ({error})") from None
    for key in keys:
        value = dig(raw, key)
        if value is not None:
            if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
                raise UserError(f"--capture-config {path}: field {key!r} is {value!r}; expected a list of integers")
            return list(value)
    raise UserError(f"--capture-config {path}: names no captured layers (looked for {', '.join(keys)})")
