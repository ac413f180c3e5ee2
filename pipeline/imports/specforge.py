"""SpecForge offline captures (sgl-project/SpecForge, `scripts/prepare_hidden_states.py`): one
torch file per sample, `OUT/rows_<g>-<g+K>/data_<i>.ckpt` (`.ckpt.gz` with --compress: gzip of the
same bytes), a `torch.save` of the record its strategy's `OfflineCaptureLayout` materializes:

    input_ids [N], loss_mask [N]           every strategy
    aux_hidden_state [1, N, n*H]           eagle3: the capture layers, concatenated
    hidden_state [1, N, H]                 eagle3: the final hidden state, after the norm
    hidden_states [1, N, n*H]              dflash, domino, dspark: the capture layers
    target_last_hidden_states [1, N, H]    dspark: the final hidden state, after the norm

(SGLang hands the logits processor the normed state; older SpecForge versions saved the eagle3
record the same way.) A dflash or domino capture stores no final hidden state, so its next-token
distribution cannot be computed: it is refused unless its layers include the last one.

The capture layers are numbered as the OUTPUT of layer s (SGLang adds the 1 itself) and are the
draft config's: `dflash_config.target_layer_ids`, or for eagle3
`eagle_config.eagle_aux_hidden_state_layer_ids`, else SpecForge's eagle3 default
[1, L // 2 - 1, L - 4]. Pass that config as --capture-config (or the ids as
--captured-layer-ids). The prompt is the context before the first supervised token.
"""

from __future__ import annotations

import gzip
import io
import re
from pathlib import Path

import torch

from pipeline.common.errors import UserError
from pipeline.imports.reader import (
    Captured,
    CaptureFormat,
    Entry,
    block_layers,
    damaged,
    loss_mask_span,
    probe_zeros,
    stated_ids,
)

SUFFIXES = (".ckpt", ".ckpt.gz")
FILE = re.compile(r"^(data_\d+)\.ckpt(\.gz)?$")
# (feature block, final hidden state after the norm) by strategy layout
LAYOUTS = (("aux_hidden_state", "hidden_state"), ("hidden_states", "target_last_hidden_states"))
CONFIG_KEYS = ("dflash_config.target_layer_ids", "eagle_config.eagle_aux_hidden_state_layer_ids", "target_layer_ids")


def eagle3_default(num_layers: int) -> tuple[list[int], str]:
    return [1, num_layers // 2 - 1, num_layers - 4], "SpecForge's eagle3 default (no draft config)"


def read_record(path: str) -> dict:
    """The saved dict; `.ckpt` memory-mapped (tensors read on touch), `.ckpt.gz` decompressed."""
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as file:
                record = torch.load(io.BytesIO(file.read()), weights_only=True)
        else:
            record = torch.load(path, weights_only=True, mmap=True)
    except Exception as error:  # zip, gzip, pickle and torch errors alike
        raise damaged(path, error) from None
    if not isinstance(record, dict):
        raise UserError(f"{path}: holds a {type(record).__name__}, not a SpecForge feature record (a dict)")
    return record


def flat(record: dict, name: str, path: str) -> torch.Tensor:
    """A [1, N, W] (or [N, W]) state as [N, W]."""
    tensor = record[name]
    if (
        not isinstance(tensor, torch.Tensor)
        or tensor.dim() not in (2, 3)
        or (tensor.dim() == 3 and tensor.shape[0] != 1)
    ):
        raise UserError(
            f"{path}: {name!r} is {getattr(tensor, 'shape', type(tensor).__name__)}; expected [1, N, width]"
        )
    return tensor.reshape(tensor.shape[-2], tensor.shape[-1])


def layout(record: dict, path: str) -> tuple[str, str | None]:
    """(block name, final name or None) of a record; refused when it holds neither layout."""
    missing = {"input_ids", "loss_mask"} - set(record)
    for block, final in LAYOUTS:
        if block in record and not missing:
            return block, final if final in record else None
    raise UserError(
        f"{path}: keys {sorted(record)}; a SpecForge feature record holds input_ids, loss_mask and "
        f"aux_hidden_state (eagle3) or hidden_states (dflash, domino, dspark)"
    )


class SpecForgeCapture(CaptureFormat):
    name = "specforge"
    convention = "output"

    def __init__(self, path: str, num_layers: int, capture_config=None, captured_layer_ids=None):
        self.path = Path(path)
        self.stated, self.stated_from = stated_ids(
            capture_config, captured_layer_ids, CONFIG_KEYS, eagle3_default(num_layers), ""
        )
        self.explicit = capture_config is not None or captured_layer_ids is not None

    def files(self) -> list[Path]:
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: no such directory (pass prepare_hidden_states.py's --output-path)")
        files = sorted(p for p in self.path.rglob("*") if p.name.endswith(SUFFIXES))
        if not files:
            raise UserError(f"{self.path}: holds no data_<i>.ckpt(.gz) capture files")
        return files

    def entry(self, file: Path) -> Entry:
        path = str(file)
        record = read_record(path)
        block_name, final_name = layout(record, path)
        if block_name == "hidden_states" and not self.explicit:
            raise UserError(
                f"{path}: a {block_name!r} record (dflash, domino or dspark) names its layers in the draft "
                f"config: pass it as --capture-config (or --captured-layer-ids)"
            )
        block = flat(record, block_name, path)
        ids, mask = record["input_ids"].reshape(-1), record["loss_mask"].reshape(-1)
        tokens, hidden = block.shape[0], self.hidden_of(record, final_name, block, path)
        block_layers(block.shape[1], hidden, self.stated, path)
        if ids.numel() != tokens or mask.numel() != tokens:
            raise UserError(f"{path}: {ids.numel()} input_ids, {mask.numel()} loss_mask and {tokens} hidden states")
        prompt_len, end = loss_mask_span(mask.tolist(), path)
        names = [f"captured layer {s}" for s in self.stated]
        probe_zeros(path, *[block[i : i + 1].reshape(1, len(names), hidden) for i in (0, tokens - 1)], names)
        extra = {"block": block_name, "final": final_name}
        sample_id = FILE.match(file.name).group(1) if FILE.match(file.name) else file.name
        return Entry(
            path, sample_id, tokens, prompt_len, self.stated, final_name is not None, block.dtype, hidden, end, extra
        )

    def hidden_of(self, record: dict, final_name: str | None, block: torch.Tensor, path: str) -> int:
        """H: the final hidden state's width, else the block's over the stated layers."""
        if final_name is not None:
            return flat(record, final_name, path).shape[1]
        return block.shape[1] // max(1, len(self.stated))

    def load(self, entry: Entry) -> Captured:
        record = read_record(entry.path)
        n, end = len(entry.stated), entry.kept
        block = flat(record, entry.extra["block"], entry.path)[:end].reshape(end, n, entry.hidden)
        final_name = entry.extra["final"]
        final = flat(record, final_name, entry.path)[:end] if final_name else None
        return Captured(input_ids=record["input_ids"].reshape(-1)[:end].to(torch.int64), block=block, final=final)

    def identity(self) -> dict:
        return {
            "format": self.name,
            "source": str(self.path.resolve()),
            "captured_layer_ids": self.stated,
            "captured_layer_ids_from": self.stated_from,
        }
