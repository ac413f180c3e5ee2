"""What is read of a draft model before it is loaded: its directory, its vocabulary against the
shards' target (vocabulary.py: llama-server's rule) and its parameter count (score refuses one over
`--memory-budget`: a draft model is a whole language model, and the target itself passed by mistake
is refused, not loaded)."""

from __future__ import annotations

import os

import torch

from pipeline.common.errors import UserError
from pipeline.shards.schema import TOKENIZER_DIR
from proposers.draft.vocabulary import VocabularyError, check_vocabulary


def model_config(config):
    """The draft model's transformers config; one error when its directory holds none."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(config.model_dir, "config.json")):
        raise UserError(
            f"{config.model_dir}: no config.json: the draft config's 'model-draft' must name the draft model's "
            "transformers checkpoint directory (the one its GGUF was converted from)"
        )
    try:
        return AutoConfig.from_pretrained(config.model_dir)
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
    if config.layout == "vllm" and draft_vocab != target_vocab:  # speculative.py:2040-2055
        raise VocabularyError(
            f"{where}: the draft model's vocabulary has {draft_vocab} tokens, the target's {target_vocab}: vLLM "
            "requires the same size; a draft model needs the target's tokenizer"
        )
    check_vocabulary(config.model_dir, draft_vocab, target_vocab, _stored_tokenizer(uri), where)
