"""What is read of a draft model before it is loaded: its directory, its vocabulary against the
shards' target (vocabulary.py: llama-server's rule; vocab_mapping.py: vLLM's heterogeneous one) and
its parameter count (score refuses one over `--memory-budget`: a draft model is a whole language
model, and the target itself passed by mistake is refused, not loaded).

A draft model given as a GGUF file (llama-server's `-md small.gguf`) is read as the extract reads a
GGUF target: transformers' GGUF loader, once, into a cached transformers directory
(pipeline/common/gguf_cache.py), which everything here and the proposers then read."""

from __future__ import annotations

import os

import torch

from pipeline.common.errors import UserError
from pipeline.shards.schema import TOKENIZER_DIR
from proposers.draft.vocab_mapping import remember, vocab_mapping
from proposers.draft.vocabulary import VocabularyError, check_vocabulary


def is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def transformers_dir(config) -> str:
    """The draft model's transformers directory: `model_dir` itself, or the one its GGUF converts
    to (gguf_to_cache: converted once, then reloaded from the cache); one error line for a GGUF
    that is missing, cut short or not a causal language model's."""
    path = config.model_dir
    if not is_gguf(path):
        return path
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such GGUF file: name the draft model's GGUF or its transformers directory")
    from pipeline.common.gguf_cache import gguf_to_cache

    try:
        return str(gguf_to_cache(path))
    except Exception as error:  # noqa: BLE001 - transformers' GGUF reader raises many kinds on a bad file
        raise UserError(
            f"{path}: not a GGUF of a causal language model transformers can read ({_first_line(error)}); a draft "
            "model's GGUF is one llama.cpp's convert_hf_to_gguf.py wrote from a transformers causal LM, or give that "
            "transformers directory"
        ) from None


def model_config(config):
    """The draft model's transformers config; one error when its directory holds none."""
    from transformers import AutoConfig

    directory = transformers_dir(config)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise UserError(
            f"{config.model_dir}: no config.json: the draft config's 'model-draft' must name the draft model's "
            "transformers checkpoint directory (the one its GGUF was converted from) or its GGUF file"
        )
    try:
        return AutoConfig.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as error:
        raise UserError(f"{config.model_dir}: its config.json does not load in transformers ({error})") from None


def parameters(config) -> int:
    """The draft model's parameter count, from its config alone (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(config))
    return sum(p.numel() for p in model.parameters())


def _stored_tokenizer(uri: str) -> str | None:
    path = os.path.join(uri, TOKENIZER_DIR)
    return path if "://" not in uri and os.path.isdir(path) else None


def check_shards(config, manifest: dict, uri: str, ckpt: str) -> None:
    """The draft model's vocabulary against the shards' target, before any weight is read."""
    target = {**(manifest.get("target") or {}), **((manifest.get("settings") or {}).get("target") or {})}
    where = f"draft model {config.model_dir} vs shards {uri}"
    draft_vocab, target_vocab = int(model_config(config).vocab_size), int(target["vocab_size"])
    directory = transformers_dir(config)
    if getattr(config, "heterogeneous_vocab", False):  # no size check: speculative.py:2036-2037
        stored = _stored_tokenizer(uri) or os.path.join(uri, TOKENIZER_DIR)
        mapping = vocab_mapping(stored, directory, target_vocab, draft_vocab, where)
        remember(config.model_dir, mapping)
        return
    if config.layout == "vllm" and draft_vocab != target_vocab:  # speculative.py:2040-2055
        raise VocabularyError(
            f"{where}: the draft model's vocabulary has {draft_vocab} tokens, the target's {target_vocab}: vLLM "
            "requires the same size; a draft model needs the target's tokenizer"
        )
    check_vocabulary(directory, draft_vocab, target_vocab, _stored_tokenizer(uri), where)
