"""Capture files of the three producers, from a real forward of a tiny target, for the import tests.

The states come from transformers (`hidden_states` plus a hook on the last layer for the state
before the final norm); the files are written the way each producer writes them:
  - vLLM (ExampleHiddenStatesConnector._write_tensors): `save_file({"hidden_states": [N, n, H],
    "token_ids": [N]}, path)`; vLLM does not run here, so `write_vllm` makes that one call itself and
    the tests read its files back with speculators' and hs-connectors' own readers;
  - hs-connectors' FP8HiddenStatesConnector: its own `_write_tensors`, called for real (`write_fp8`),
    with the vLLM base class it extends stubbed (vLLM is not installed; the method uses none of it);
  - speculators' prepared dataset: its own `build_speculator_training_dataset` (the pre-tokenized
    path, which needs no vLLM render server) and `datasets`' save_to_disk;
  - SpecForge: `torch.save` of the strategy's record in rows_<g>-<g+2000>/data_<i>.ckpt(.gz), as
    scripts/prepare_hidden_states.py saves it; checked against the real files in tests/data/specforge/.
"""

from __future__ import annotations

import gzip
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

SPECFORGE_FIXTURES = Path(__file__).resolve().parents[1] / "data" / "specforge"


@dataclass
class States:
    """One sequence's hidden states: `layers[s]` = transformers' hidden_states[s] (s = 1..L-1: the
    output of layer s - 1), `pre` / `post` the final hidden state before / after the final norm."""

    input_ids: list[int]
    prompt_len: int
    layers: tuple
    pre: torch.Tensor  # [N, H]
    post: torch.Tensor  # [N, H]

    def before(self, s: int) -> torch.Tensor:
        """vLLM / speculators numbering: the residual entering layer s (s = L: `pre`)."""
        return self.pre if s == len(self.layers) - 1 else self.layers[s]

    def output(self, s: int) -> torch.Tensor:
        """SpecForge numbering: the output of layer s (s = L - 1: `pre`, the raw last output)."""
        return self.pre if s == len(self.layers) - 2 else self.layers[s + 1]


@torch.inference_mode()
def states(model, input_ids: list[int], prompt_len: int) -> States:
    """A plain full forward over one sequence (fp32 on CPU, as extract's reference is)."""
    from pipeline.extract.target import decoder_layers

    captured = {}
    last = decoder_layers(model)[-1]
    handle = last.register_forward_hook(
        lambda m, a, out: captured.update(pre=(out[0] if isinstance(out, tuple) else out))
    )
    try:
        out = model(torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        handle.remove()
    layers = tuple(h[0] for h in out.hidden_states)
    return States(list(input_ids), prompt_len, layers, captured["pre"][0].clone(), layers[-1])


# ---------------------------------------------------------------------------------------------
# vLLM and hs-connectors


def vllm_tensors(state: States, before_ids: list[int], dtype=torch.float32) -> dict:
    """What ExampleHiddenStatesConnector saves: hidden_states [N, n, H], token_ids int64 [N]."""
    stack = torch.stack([state.before(s) for s in before_ids], dim=1).to(dtype).contiguous()
    return {"hidden_states": stack, "token_ids": torch.tensor(state.input_ids)}


def write_vllm(path, state: States, before_ids: list[int], dtype=torch.float32) -> str:
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(vllm_tensors(state, before_ids, dtype), str(path))
    return str(path)


def fp8_connector():
    """hs_connectors.fp8_hidden_states_connector.FP8HiddenStatesConnector, its vLLM base stubbed."""
    name = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
    if name not in sys.modules:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        sys.modules[name].ExampleHiddenStatesConnector = type("ExampleHiddenStatesConnector", (), {})
        for i in range(1, len(parts)):
            setattr(sys.modules[".".join(parts[:i])], parts[i], sys.modules[".".join(parts[: i + 1])])
    from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector

    return FP8HiddenStatesConnector


def write_fp8(path, state: States, before_ids: list[int]) -> str:
    """An FP8 capture file written by hs-connectors' own FP8HiddenStatesConnector._write_tensors."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    done = types.SimpleNamespace(synchronize=lambda: None)  # the CUDA event it waits on
    fp8_connector()._write_tensors(vllm_tensors(state, before_ids), done, str(path), None)
    return str(path)


def write_prompt_lens(path, lens: dict[str, int]) -> str:
    Path(path).write_text("".join(json.dumps({"id": k, "prompt_len": v}) + "\n" for k, v in lens.items()))
    return str(path)


def vllm_speculative_config(path, before_ids: list[int]) -> str:
    """The --speculative-config speculators' launch_vllm.py passes to `vllm serve`."""
    config = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(before_ids)}},
    }
    Path(path).write_text(json.dumps(config))
    return str(path)


# ---------------------------------------------------------------------------------------------
# speculators


def loss_mask(state: States) -> list[int]:
    return [0] * state.prompt_len + [1] * (len(state.input_ids) - state.prompt_len)


def write_speculators(directory, all_states: list[States], before_ids: list[int], tokenizer, skip=()) -> str:
    """A speculators data directory: the prepared dataset (speculators' own code) and
    hidden_states/hs_<i>.safetensors for every row not in `skip` (a request that failed)."""
    from datasets import Dataset
    from speculators.data_generation.preprocessing import build_speculator_training_dataset

    rows = Dataset.from_dict(
        {"input_ids": [s.input_ids for s in all_states], "loss_mask": [loss_mask(s) for s in all_states]}
    )
    prepared = build_speculator_training_dataset(rows, tokenizer, max_length=4096, num_proc=1)
    prepared.save_to_disk(str(directory))
    for index, state in enumerate(all_states):
        if index not in skip:
            write_vllm(Path(directory) / "hidden_states" / f"hs_{index}.safetensors", state, before_ids)
    return str(directory)


# ---------------------------------------------------------------------------------------------
# SpecForge


def specforge_record(state: States, output_ids: list[int], layout: str, dtype=torch.bfloat16) -> dict:
    """The record OfflineCaptureLayout.materialize builds: eagle3 (aux_hidden_state + hidden_state),
    dflash (hidden_states) or dspark (hidden_states + target_last_hidden_states)."""
    aux = torch.cat([state.output(s) for s in output_ids], dim=-1).to(dtype).unsqueeze(0)  # [1, N, n*H]
    last = state.post.to(dtype).unsqueeze(0)  # [1, N, H]
    record = {"input_ids": torch.tensor(state.input_ids), "loss_mask": torch.tensor(loss_mask(state))}
    names = {"eagle3": ("aux_hidden_state", "hidden_state"), "dflash": ("hidden_states", None)}
    block, final = names.get(layout, ("hidden_states", "target_last_hidden_states"))
    record[block] = aux
    if final:
        record[final] = last
    return record


def specforge_path(root, index: int, compress: bool) -> Path:
    group = index // 2000 * 2000
    return Path(root) / f"rows_{group}-{group + 2000}" / f"data_{index}.ckpt{'.gz' if compress else ''}"


def write_specforge(root, index: int, record: dict, compress: bool = False) -> str:
    """prepare_hidden_states.py's _save_tensor_sync: torch.save, through gzip with --compress."""
    path = specforge_path(root, index, compress)
    path.parent.mkdir(parents=True, exist_ok=True)
    if compress:
        with gzip.open(path, "wb", compresslevel=6) as file:
            torch.save(record, file)
    else:
        torch.save(record, path)
    return str(path)


def read_specforge(path) -> dict:
    """SpecForge's own reading of a feature file (runtime/data_plane/feature_store.py load_feature_file)."""
    import io

    path = str(path)
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as file:
            return torch.load(io.BytesIO(file.read()), weights_only=False)
    return torch.load(path, weights_only=False, mmap=True)


# ---------------------------------------------------------------------------------------------
# the reference: extract's own output for the same tokens


def teacher_forced_records(count: int = 5) -> list[dict]:
    """Prompt and response token ids of different lengths, one past 64 positions (extract's
    forward and lm_head then run in windows)."""
    records = []
    for i in range(count):
        prompt = [1, *range(40 + i, 44 + 2 * i)]
        response = [(7 * j + 11 * i) % 380 + 10 for j in range(6 + 5 * i + (80 if i == count - 1 else 0))]
        records.append({"id": f"s{i}", "input_ids": prompt, "response": response})
    return records


def reference(tmp, model_dir: str, records: list[dict], layer_ids: list[int], top_k: int = 8):
    """(extract's samples by id, their States): extract over the given responses (fp32, CPU),
    and a plain transformers forward of the same tokens for the capture files."""
    from transformers import AutoModelForCausalLM

    from pipeline.extract.run import ExtractConfig, run_extract
    from pipeline.shards import ShardSet
    from tests.helpers.prompts import write_prompts

    prompts = write_prompts(Path(tmp) / "prompts.jsonl", records)
    out = str(Path(tmp) / "extract")
    run_extract(ExtractConfig(model=model_dir, prompts=prompts, out=out, layer_ids=layer_ids, top_k=top_k, quiet=True))
    samples = {s.sample_id: s for s in ShardSet(out).samples()}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    found = {k: states(model, s.input_ids.tolist(), s.prompt_len) for k, s in samples.items()}
    return samples, found


def columns(sample, stored: list[int], wanted: list[int]) -> torch.Tensor:
    """The features of layer ids `wanted` out of a sample storing `stored` [N, n*H]."""
    hidden = sample.features.shape[1] // len(stored)
    return torch.cat([sample.features[:, stored.index(i) * hidden : (stored.index(i) + 1) * hidden] for i in wanted], 1)


def make_tokenizer_for(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def lm_head(model_dir: str) -> torch.Tensor:
    """The target's lm_head weight [V, H], read from its checkpoint."""
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))["lm_head.weight"]


def gunzip(path) -> bytes:
    with gzip.open(path, "rb") as file:
        return file.read()
