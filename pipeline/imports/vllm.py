"""vLLM `extract_hidden_states` captures: one safetensors file per request, as vLLM's
ExampleHiddenStatesConnector writes it (`<shared_storage_path>/<request id>.safetensors`):

    hidden_states         [N, n, H]  model dtype; layer j = eagle_aux_hidden_state_layer_ids[j]
    token_ids             [N] int64  the request's prompt tokens (with `include_output_tokens`:
                                     prompt + output, less the last output token)
    hidden_states_scales  [N, 1, 1] float32, only from hs-connectors' FP8HiddenStatesConnector:
                                     hidden_states is then float8_e4m3fn, value = q * scale

The layer ids are not in the file: they are the server's `--speculative-config`
(`draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids`), numbered BEFORE layer s (the
residual entering it; s = L is the final hidden state before the norm). Pass that JSON as
`--capture-config`, or the ids as `--captured-layer-ids`. Nor does a file say where its prompt
ends: `--prompt-lens` is a JSONL file of {"id": "<file stem>", "prompt_len": P}.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import torch
from pydantic import Field

from pipeline.common.errors import UserError
from pipeline.common.schema import Positive, Schema, validate
from pipeline.imports.reader import Captured, CaptureFormat, Entry, block_layers, damaged, probe_zeros, stated_ids

HIDDEN, TOKENS, SCALES = "hidden_states", "token_ids", "hidden_states_scales"
# Where a capture config names the captured layers: vLLM's speculative config (alone or inside a
# server config), or a drafter config in speculators' layout.
CONFIG_KEYS = (
    "draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids",
    "speculative_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids",
    "eagle_aux_hidden_state_layer_ids",
    "aux_hidden_state_layer_ids",
)
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn}


def header(path: str) -> dict:
    """{tensor name: (shape, dtype)} of a safetensors file, its data untouched."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as file:
            return {name: (file.get_slice(name).get_shape(), file.get_slice(name).get_dtype()) for name in file.keys()}
    except Exception as error:  # safetensors raises its own error type, or OSError
        raise damaged(path, error) from None


def check_layout(path: str, tensors: dict, stated: list[int]) -> tuple[int, int, torch.dtype]:
    """(N, H, dtype) of a vLLM capture file, its tensors checked against each other and `stated`."""
    for name in (HIDDEN, TOKENS):
        if name not in tensors:
            raise UserError(f"{path}: no {name!r} tensor (it holds {sorted(tensors)}); is this a vLLM capture file?")
    shape, dtype = tensors[HIDDEN]
    if len(shape) != 3 or tensors[TOKENS][0] != [shape[0]] or dtype not in _DTYPES:
        raise UserError(
            f"{path}: hidden_states {shape} {dtype} and token_ids {tensors[TOKENS][0]} do not make a capture "
            f"([N, layers, H] float states for N token ids)"
        )
    block_layers(shape[1] * shape[2], shape[2], stated, path)
    return shape[0], shape[2], _DTYPES[dtype]


def probe(path: str, tokens: int, names: list[str]) -> None:
    """The zero check on the first and last positions, read through the file's slices."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as file:
        block = file.get_slice(HIDDEN)
        probe_zeros(path, block[0:1].float(), block[tokens - 1 : tokens].float(), names)


def token_ids(path: str) -> list[int]:
    """A capture file's token_ids (small: N int64), for the checks before anything is written."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as file:
            return file.get_tensor(TOKENS).tolist()
    except Exception as error:
        raise damaged(path, error) from None


def load_file(path: str, tokens: int) -> Captured:
    """One capture file's tensors, cut to its first `tokens` positions."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as file:
            names = set(file.keys())
            block = file.get_slice(HIDDEN)[:tokens]  # [N, n, H]
            ids = file.get_tensor(TOKENS)[:tokens].to(torch.int64)
            scale = file.get_slice(SCALES)[:tokens].reshape(-1).float() if SCALES in names else None
    except Exception as error:
        raise damaged(path, error) from None
    return Captured(input_ids=ids, block=block, scale=scale)


class PromptLen(Schema):
    id: str
    prompt_len: Annotated[Positive, Field(description="tokens of prompt before the response")]


def read_prompt_lens(path: str) -> dict[str, int]:
    """{sample id: prompt_len} from a JSONL file, each line checked."""
    lens = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}:{number}: not valid JSON ({error})") from None
        record = validate(PromptLen, raw, f"{path}:{number}")
        lens[record.id] = record.prompt_len
    return lens


class VllmCapture(CaptureFormat):
    name = "vllm"
    convention = "before"

    def __init__(self, path: str, num_layers: int, capture_config=None, captured_layer_ids=None, prompt_lens=None):
        self.path = path
        self.stated, self.stated_from = stated_ids(
            capture_config,
            captured_layer_ids,
            CONFIG_KEYS,
            None,
            "a vLLM capture does not record which layers it holds: pass the server's --speculative-config JSON "
            "as --capture-config, or the ids as --captured-layer-ids (vLLM's numbering, e.g. 2,15,27,30)",
        )
        if prompt_lens is None:
            raise UserError(
                "a vLLM capture does not record where each prompt ends: pass --prompt-lens, a JSONL file of "
                '{"id": "<file stem>", "prompt_len": P} lines (or import the speculators data directory instead)'
            )
        self.prompt_lens = read_prompt_lens(prompt_lens)
        self.num_layers = num_layers

    def files(self) -> list[Path]:
        root = Path(self.path)
        if not root.is_dir():
            raise FileNotFoundError(f"{self.path}: no such directory (pass the connector's shared_storage_path)")
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise UserError(f"{self.path}: holds no .safetensors capture files")
        return files

    def entry(self, file: Path) -> Entry:
        path = str(file)
        tokens, hidden, dtype = check_layout(path, header(path), self.stated)
        if file.stem not in self.prompt_lens:
            raise UserError(f"{path}: --prompt-lens has no line for id {file.stem!r}")
        prompt_len = self.prompt_lens[file.stem]
        if prompt_len >= tokens:
            raise UserError(f"{path}: prompt_len {prompt_len} leaves no response in its {tokens} tokens")
        probe(path, tokens, [f"captured layer {s}" for s in self.stated])
        return Entry(path, file.stem, tokens, prompt_len, self.stated, False, dtype, hidden)

    def load(self, entry: Entry) -> Captured:
        return load_file(entry.path, entry.kept)

    def identity(self) -> dict:
        return {
            "format": self.name,
            "source": str(Path(self.path).resolve()),
            "captured_layer_ids": self.stated,
            "captured_layer_ids_from": self.stated_from,
        }
