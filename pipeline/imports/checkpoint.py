"""The target as an import needs it, read from its checkpoint WITHOUT loading the model: its
facts (the manifest's `target`), its final norm, its lm_head and its input embedding, each read
alone from the safetensors files. The model's structure comes from a skeleton built on the meta
device (no memory, no weights), so the final norm is the architecture's own module (RMSNorm,
Gemma's 1 + w, Qwen3.5's zero-centred one alike) and the logits get the model's own
post-processing (softcap, scale), exactly as extract's capture forward computes them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from pipeline.common.dtypes import dtype_name
from pipeline.common.errors import UserError
from pipeline.extract.capture import head_rows, next_token_distribution, ties_last_hidden_state
from pipeline.extract.target import (
    TargetInfo,
    decoder_layers,
    hash_chat_template,
    hash_config,
    prepare_tokenizer,
    read_stop_token_ids,
    resolve_model_dir,
    text_config,
    text_decoder,
)

INDEX = "model.safetensors.index.json"


def weight_files(model_dir: Path) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it}, from the index or the files' headers."""
    from safetensors import safe_open

    index = model_dir / INDEX
    if index.is_file():
        return {name: model_dir / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir}: no safetensors weights; import reads the target's norm and lm_head from them")
    names = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names.update(dict.fromkeys(handle.keys(), file))
    return names


def read_weight(files: dict[str, Path], name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(files[name]), framework="pt") as handle:
        return handle.get_tensor(name)


def find_key(files: dict, name: str, model_dir: Path) -> str:
    """The checkpoint's name for the skeleton's parameter `name` (wrappers nest the text model as
    model.language_model.*, and some checkpoints name it without the wrapper, or the other way)."""
    body = name.removeprefix("model.").removeprefix("language_model.")
    for candidate in (name, f"model.{body}", f"model.language_model.{body}", f"language_model.model.{body}", body):
        if candidate in files:
            return candidate
    raise UserError(f"{model_dir}: its safetensors hold no {name!r} (nor a wrapper's name for it)")


def skeleton(model_dir: Path):
    """The model built on the meta device: structure and config, no weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError as causal_error:
            try:
                return AutoModelForImageTextToText.from_config(config)
            except ValueError:
                raise causal_error from None


def qualified(model, module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)


def materialize(model, module, files: dict, model_dir: Path) -> torch.nn.Module:
    """`module` of the meta skeleton on the CPU, its parameters and buffers read from the checkpoint."""
    prefix = qualified(model, module)
    state = {key: read_weight(files, find_key(files, f"{prefix}.{key}", model_dir)) for key in module.state_dict()}
    module.to_empty(device="cpu")
    module.load_state_dict(state)
    return module.eval().requires_grad_(False)


def fingerprint(files: dict, weights: list[torch.Tensor]) -> str:
    """sha256 of the checkpoint's tensor names and files, and the bytes of the head weights we
    read: tells two checkpoints with one config.json apart without reading 27B of weights."""
    digest = hashlib.sha256(json.dumps(sorted((k, Path(v).name) for k, v in files.items())).encode())
    for weight in weights:
        digest.update(weight.reshape(-1)[:65536].float().numpy().tobytes())
    return digest.hexdigest()[:32]


@dataclass
class TargetHead:
    """What import computes with: the final norm and lm_head (in the capture's dtype once
    `to` has run), the target facts, and the two matrices the target head file stores."""

    info: TargetInfo
    config: object  # the text config: postprocess_logits reads softcap and scales from it
    norm: torch.nn.Module
    head: torch.nn.Linear
    embed_tokens: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when tied)
    ties_norm: bool  # id L - 1 is the final norm's output (pipeline/extract/capture.py)
    fingerprint: str
    tokenizer: object

    @property
    def num_layers(self) -> int:
        return self.info.num_layers

    def to(self, dtype: torch.dtype, device: str = "cpu") -> TargetHead:
        self.norm.to(device=device, dtype=dtype)
        self.head.to(device=device, dtype=dtype)
        return self

    @torch.inference_mode()
    def post(self, pre: torch.Tensor) -> torch.Tensor:
        """The final hidden state after the norm [N, H] from the one before it [N, H] (on the head's device)."""
        weight = self.head.weight
        return self.norm(pre.to(device=weight.device, dtype=weight.dtype)[None])[0]

    @torch.inference_mode()
    def distribution(self, post: torch.Tensor, input_ids: torch.Tensor, prompt_len: int, top_k: int, budget: int):
        """topk_ids, topk_logprobs [R+1, k] and argmax_mismatch [R] of rows P-1.. (extract's own code)."""
        vocab = self.head.weight.shape[0]
        return next_token_distribution(
            post.to(self.head.weight.dtype),
            self.head,
            self.config,
            prompt_len - 1,
            input_ids[prompt_len:],
            min(top_k, vocab),
            head_rows(vocab, budget),
        )


def output_head(model, files: dict, model_dir: Path) -> torch.nn.Linear:
    """The lm_head as a CPU Linear; the input embedding's weight when the checkpoint ties them."""
    meta = model.get_output_embeddings()
    if meta is None:
        raise UserError(f"{model_dir}: {type(model).__name__} has no output head; import needs a language model")
    name = f"{qualified(model, meta)}.weight"
    try:
        weight = read_weight(files, find_key(files, name, model_dir))
    except UserError:
        embed = f"{qualified(model, model.get_input_embeddings())}.weight"
        weight = read_weight(files, find_key(files, embed, model_dir))  # tied: stored once
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=getattr(meta, "bias", None) is not None)
    head.weight = torch.nn.Parameter(weight, requires_grad=False)
    if head.bias is not None:
        head.bias = torch.nn.Parameter(read_weight(files, find_key(files, name[:-6] + "bias", model_dir)), False)
    return head


def target_info(model_dir: Path, name: str, source: str, model, embed: torch.Tensor, tokenizer) -> TargetInfo:
    """The manifest's target facts, as extract records them (pipeline/extract/target.py)."""
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(str(model_dir))
    except OSError:  # no generation_config.json: the tokenizer's eos
        generation = None
    stop_ids = read_stop_token_ids(SimpleNamespace(generation_config=generation), tokenizer)
    tokenizer = prepare_tokenizer(tokenizer, stop_ids)
    return TargetInfo(
        name=name,
        path=source,
        architecture=type(model).__name__,
        num_layers=len(decoder_layers(model)),
        hidden_size=int(text_config(model).hidden_size),
        vocab_size=int(embed.shape[0]),
        config_hash=hash_config(model_dir),
        dtype=dtype_name(embed.dtype),
        stop_token_ids=stop_ids,
        pad_token_id=int(tokenizer.pad_token_id),
        bos_token_id=None if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id),
        tokenizer_name=Path(str(tokenizer.name_or_path)).name or name,
        chat_template_hash=hash_chat_template(tokenizer),
    )


def load_head(path: str) -> TargetHead:
    """The target head of `path` (`smollm2`, a transformers directory, or a .gguf file, as
    extract takes it), read tensor by tensor; the model itself is never loaded."""
    from transformers import AutoTokenizer

    name, source, model_dir = resolve_model_dir(str(path))
    model = skeleton(model_dir)
    files = weight_files(model_dir)
    embed = read_weight(files, find_key(files, f"{qualified(model, model.get_input_embeddings())}.weight", model_dir))
    head = output_head(model, files, model_dir)
    decoder = text_decoder(model)
    if not isinstance(getattr(decoder, "norm", None), torch.nn.Module):
        raise UserError(f"{model_dir}: {type(model).__name__} has no final `norm` module where import looks for it")
    norm = materialize(model, decoder.norm, files, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return TargetHead(
        info=target_info(model_dir, name, str(source), model, embed, tokenizer),
        config=text_config(model),
        norm=norm,
        head=head,
        embed_tokens=embed,
        lm_head=head.weight.detach(),
        ties_norm=ties_last_hidden_state(decoder),
        fingerprint=fingerprint(files, [norm.weight.detach(), head.weight.detach()]),
        tokenizer=tokenizer,
    )
