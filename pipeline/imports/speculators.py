"""speculators data-generation outputs (PyPI `speculators`: `speculators prepare-data`, then
`speculators generate-offline-data` against a vLLM server launched by its `launch_vllm.py`):

    DATA/                        the prepared dataset (`datasets` save_to_disk: state.json lists
                                 its Arrow stream files), one row per assistant turn:
                                 input_ids [N], loss_mask [N] (0 context, 1 response), seq_len
    DATA/hidden_states/hs_<i>.safetensors
                                 row i's capture, the vLLM file of vllm.py moved into place
                                 (`--output` of generate-offline-data may put them elsewhere:
                                 pass that directory as --hidden-states)

A row whose request failed has no file and is left out, as speculators' trainer leaves it out.
Each file's token_ids must equal its row's input_ids (speculators' own `check_hidden_states`).
The prompt is the row's context (loss_mask 0), the response its supervised tokens.

Layer ids, numbered before layer s as vLLM numbers them: the server's --speculative-config as
--capture-config, or --captured-layer-ids, else launch_vllm.py's default when it was started
without --target-layer-ids: [2, L // 2, L - 3, L] (L, the last, is the final hidden state that
speculators trains against; a mismatch in count is refused file by file).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa

from pipeline.common.errors import UserError
from pipeline.imports.reader import Captured, CaptureFormat, Entry, loss_mask_span, stated_ids
from pipeline.imports.vllm import CONFIG_KEYS, check_layout, header, load_file, probe, token_ids

FILE = re.compile(r"^hs_(\d+)\.safetensors$")


def launch_default(num_layers: int) -> tuple[list[int], str]:
    """speculators' scripts/launch_vllm.py default capture, final hidden state included."""
    ids = [2, num_layers // 2, num_layers - 3, num_layers]
    return ids, "speculators' launch_vllm.py default (no --target-layer-ids)"


class Rows:
    """The prepared dataset's input_ids and loss_mask, row by row, memory-mapped (never all held)."""

    def __init__(self, directory: Path):
        state = directory / "state.json"
        if not state.is_file():
            raise UserError(f"{directory}: no state.json; pass the directory `speculators prepare-data --output` wrote")
        try:
            files = [directory / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
            self.tables = [pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files]
        except (OSError, KeyError, TypeError, ValueError, pa.ArrowException) as error:
            raise UserError(f"{directory}: cannot read the prepared dataset ({error})") from None
        for table, file in zip(self.tables, files):
            missing = {"input_ids", "loss_mask"} - set(table.column_names)
            if missing:
                raise UserError(f"{file}: no {sorted(missing)} column; is this a speculators prepared dataset?")
        self.sizes = [table.num_rows for table in self.tables]

    def __len__(self) -> int:
        return sum(self.sizes)

    def row(self, index: int) -> tuple[list[int], list[int]]:
        """(input_ids, loss_mask) of row `index`."""
        for table, size in zip(self.tables, self.sizes):
            if index < size:
                ids = table.column("input_ids")[index].values.to_numpy(zero_copy_only=False)
                mask = table.column("loss_mask")[index].values.to_numpy(zero_copy_only=False)
                return ids.tolist(), mask.tolist()
            index -= size
        raise IndexError(index)


class SpeculatorsCapture(CaptureFormat):
    name = "speculators"
    convention = "before"

    def __init__(self, path: str, num_layers: int, capture_config=None, captured_layer_ids=None, hidden_states=None):
        self.path = Path(path)
        self.hidden_dir = Path(hidden_states) if hidden_states else self.path / "hidden_states"
        self.stated, self.stated_from = stated_ids(
            capture_config, captured_layer_ids, CONFIG_KEYS, launch_default(num_layers), ""
        )
        if not self.path.is_dir():
            raise FileNotFoundError(f"{path}: no such directory (pass the directory prepare-data wrote)")
        self.rows = Rows(self.path)

    def files(self) -> list[tuple[int, Path]]:
        """(row index, file) of every capture file, by row."""
        if not self.hidden_dir.is_dir():
            raise FileNotFoundError(
                f"{self.hidden_dir}: no such directory; pass generate-offline-data's --output as --hidden-states"
            )
        found = sorted((int(m.group(1)), p) for p in self.hidden_dir.iterdir() if (m := FILE.match(p.name)))
        if not found:
            raise UserError(f"{self.hidden_dir}: holds no hs_<i>.safetensors capture files")
        return found

    def entry(self, item: tuple[int, Path]) -> Entry:
        index, file = item
        path = str(file)
        tokens, hidden, dtype = check_layout(path, header(path), self.stated)
        if index >= len(self.rows):
            raise UserError(f"{path}: the prepared dataset {self.path} has {len(self.rows)} rows, no row {index}")
        ids, mask = self.rows.row(index)
        if len(ids) != tokens or len(mask) != tokens:
            raise UserError(f"{path}: {tokens} positions, but dataset row {index} has {len(ids)} tokens")
        if token_ids(path) != ids:
            raise UserError(
                f"{path}: its token_ids are not dataset row {index}'s input_ids; the capture belongs to another "
                f"dataset (or another order of it)"
            )
        prompt_len, end = loss_mask_span(mask, f"{path} (dataset row {index})")
        probe(path, tokens, [f"captured layer {s}" for s in self.stated])
        return Entry(path, file.stem, tokens, prompt_len, self.stated, False, dtype, hidden, end, {"row": index})

    def load(self, entry: Entry) -> Captured:
        return load_file(entry.path, entry.kept)  # its token_ids were checked against the row

    def identity(self) -> dict:
        return {
            "format": self.name,
            "source": str(self.path.resolve()),
            "hidden_states": str(self.hidden_dir.resolve()),
            "captured_layer_ids": self.stated,
            "captured_layer_ids_from": self.stated_from,
        }
