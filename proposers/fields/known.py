"""A key of a drafter config's decoder namespace that nothing declares, refused by name.

The namespaces that are a transformers config (the top level of a z-lab, SpecForge or DeepSpec
config, speculators' `transformer_layer_config` and its own top level, a target's config and its
`text_config`) may hold any attribute of the config class the reference builds from them
(Qwen3Config, LlamaConfig, Qwen3NextConfig, Qwen3_5TextConfig, ...), the keys transformers still
accepts from older files (`rope_theta`, `torch_dtype`, generation settings, ...) and what the
layout declares (layout.namespaces() says which class and which schema). Anything else is one
error line naming the key: never dropped.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import transformers
from transformers import GenerationConfig

from proposers.toolkit.config import DrafterConfigError

KNOWN_NOT = "is not a field specreplay knows"
REFUSING = "refusing rather than scoring the drafter as something it is not"

# keys transformers 4.x's PretrainedConfig wrote into a full config.json; transformers 5 still reads
# several of them (consumes or keeps as plain attributes): bookkeeping or training-only everywhere
PRETRAINED_V4 = (
    "add_cross_attention", "bad_words_ids", "begin_suppress_tokens", "bos_token_id", "chunk_size_feed_forward",
    "cross_attention_hidden_size", "decoder_start_token_id", "eos_token_id", "finetuning_task", "id2label",
    "is_decoder", "is_encoder_decoder", "label2id", "output_attentions", "output_hidden_states", "pad_token_id",
    "prefix", "problem_type", "pruned_heads", "return_dict", "sep_token_id", "suppress_tokens",
    "task_specific_params", "tf_legacy_loss", "tie_encoder_decoder", "tie_word_embeddings", "tokenizer_class",
    "torchscript", "use_bfloat16", "num_labels", "torch_dtype", "dtype", "transformers_version", "architectures",
)  # fmt: skip
# read and moved or dropped by transformers 5's PreTrainedConfig.__post_init__
CONSUMED = (
    "rope_theta", "rope_scaling", "partial_rotary_factor", "name_or_path", "_name_or_path", "_commit_hash",
    "attn_implementation", "experts_implementation", "per_layer_config",
)  # fmt: skip
# written by the saving code, read by no replay or engine: which class saved it, the training step
# (proposers/checkpoints/files.py STEP_FIELDS), the attention kernel chosen at training, the shards
# `specreplay fit` fitted the drafter on (scoring/fit.py, read by the report)
BOOKKEEPING = (
    "model_type", "auto_map", "step", "global_step", "training_step", "_attn_implementation",
    "_attn_implementation_autoset", "_attn_implementation_internal", "_experts_implementation", "specreplay_fit",
)  # fmt: skip
# keys transformers' RoPE validation accepts in rope_parameters / rope_scaling (modeling_rope_utils.py,
# every rope_type), M-RoPE's sections (Qwen3.5) and vLLM's rope_dim (refused by decoder_rules.py)
ROPE_KEYS = frozenset(
    (
        "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "attention_factor",
        "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "short_factor", "long_factor",
        "low_freq_factor", "high_freq_factor", "partial_rotary_factor", "mrope_section", "mrope_interleaved",
        "rope_dim",
    )
)  # fmt: skip
# rope_parameters nested per layer type (DeepSeek-V4's per rope type: transformers' DeepseekV4Config)
LAYER_TYPES = ("full_attention", "sliding_attention", "main", "compress")


@cache
def transformers_keys(class_name: str) -> frozenset[str]:
    """Every key transformers' `class_name` takes from a config.json."""
    config_class = getattr(transformers, class_name)
    generation = GenerationConfig._get_default_generation_params().keys()
    names = {f.name for f in dataclasses.fields(config_class)} | set(config_class.attribute_map)
    return frozenset(names | set(generation) | set(PRETRAINED_V4) | set(CONSUMED) | set(BOOKKEEPING))


def _rope_unknown(values: dict, prefix: str) -> list[str]:
    found = []
    for name in ("rope_parameters", "rope_scaling"):
        rope = values.get(name)
        if not isinstance(rope, dict):
            continue
        nested = {k: v for k, v in rope.items() if k in LAYER_TYPES and isinstance(v, dict)}
        for where, inner in nested.items() or [("", rope)]:
            path = f"{prefix}{name}." + (f"{where}." if where else "")
            found += [path + key for key in inner if key not in ROPE_KEYS]
    return found


def unknown_fields(checked, raw: dict) -> list[tuple[str, str]]:
    """(path, transformers' class) of every key of the config `raw` (validated as `checked`) that
    neither transformers' class of its namespace nor the layout declares, in file order."""
    found = []
    for path, (class_name, schema) in checked.namespaces().items():
        values = raw.get(path) if path else raw
        if class_name is None or not isinstance(values, dict):
            continue
        known = transformers_keys(class_name) | set(schema.model_fields)
        prefix = f"{path}." if path else ""
        found += [(prefix + key, class_name) for key in values if key not in known]
        found += [(key, class_name) for key in _rope_unknown(values, prefix)]
    return found


def refuse_unknown(checked, raw: dict, source: str) -> None:
    """DrafterConfigError naming the first key nothing declares (and how many more there are)."""
    found = unknown_fields(checked, raw)
    if not found:
        return
    path, class_name = found[0]
    more = f" (and {len(found) - 1} more: {', '.join(p for p, _ in found[1:4])})" if len(found) > 1 else ""
    layout = getattr(checked, "LAYOUT", "")
    raise DrafterConfigError(
        f"{source}: field {path!r} {KNOWN_NOT} (neither transformers' {class_name} nor specreplay's {layout} "
        f"layout declares it){more}; {REFUSING}"
    )
