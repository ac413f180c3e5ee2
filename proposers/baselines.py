"""Baselines named like checkpoints, torch-free: `--ckpt ngram:vllm:k=4`, `--ckpt draft:runs/small:n=4`.

A proposer that needs no trained drafter is otherwise given as a JSON file of its engine's settings
(docs/config-fields.md); a name is that file written inline. `PREFIX[:SETTINGS]`, SETTINGS being
`key=value` pairs separated by commas, each key the engine's own (`num_speculative_tokens`) or its
short name below (`k`); a draft model's prefix takes the model's directory first. The name becomes
the JSON file it stands for (`config_of`), parsed and refused exactly like one, and its results
directory is named after it (`dir_name`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from pipeline.common.errors import UserError


@dataclass(frozen=True)
class NamedBaseline:
    prefix: str
    fixed: dict  # the keys that say which engine setting this is
    short: dict = field(default_factory=dict)  # short key -> the engine's own key
    path_key: str | None = None  # a draft model's directory: the name's next part
    describes: str = ""

    def usage(self) -> str:
        path = ":PATH" if self.path_key else ""
        keys = ",".join(f"{s}=N" for s in self.short)
        return f"{self.prefix}{path}" + (f"[:{keys}]" if keys else "")


NAMED = (
    NamedBaseline(
        "ngram:vllm",
        {"method": "ngram"},
        {"k": "num_speculative_tokens", "min": "prompt_lookup_min", "max": "prompt_lookup_max"},
        describes="vLLM's prompt lookup (k drafts, n-grams of min..max tokens)",
    ),
    NamedBaseline(
        "ngram:llama.cpp",
        {"spec-type": "ngram-simple"},
        {"n": "spec-ngram-simple-size-n", "m": "spec-ngram-simple-size-m"},
        describes="llama-server's ngram-simple (n-gram of n tokens, up to m drafts)",
    ),
    NamedBaseline(
        "ngram:llama.cpp-map-k",
        {"spec-type": "ngram-map-k"},
        {"n": "spec-ngram-map-k-size-n", "m": "spec-ngram-map-k-size-m"},
        describes="llama-server's ngram-map-k (per-slot map; replayed along the server's loop)",
    ),
    NamedBaseline(
        "ngram:llama.cpp-map-k4v",
        {"spec-type": "ngram-map-k4v"},
        {"n": "spec-ngram-map-k4v-size-n", "m": "spec-ngram-map-k4v-size-m", "hits": "spec-ngram-map-k4v-min-hits"},
        describes="llama-server's ngram-map-k4v (per-slot map of values; replayed along the server's loop)",
    ),
    NamedBaseline(
        "ngram:llama.cpp-mod",
        {"spec-type": "ngram-mod"},
        {"n": "spec-ngram-mod-n-match", "min": "spec-ngram-mod-n-min", "max": "spec-ngram-mod-n-max"},
        describes="llama-server's ngram-mod (one table for every request; replayed along the server's loop)",
    ),
    NamedBaseline(
        "ngram:llama.cpp-cache",
        {"spec-type": "ngram-cache"},
        describes="llama-server's ngram-cache (per-slot n-gram counts; replayed along the server's loop)",
    ),
    NamedBaseline(
        "ngram:sglang",
        {"speculative_algorithm": "NGRAM"},
        {
            "n": "speculative_num_draft_tokens",
            "depth": "speculative_ngram_max_trie_depth",
            "min": "speculative_ngram_min_bfs_breadth",
            "max": "speculative_ngram_max_bfs_breadth",
            "match": "speculative_ngram_match_type",
            "capacity": "speculative_ngram_capacity",
        },
        describes="SGLang's NGRAM (one trie for every request, a tree of n - 1 drafts; replayed along SGLang's loop)",
    ),
    NamedBaseline(
        "suffix:vllm",
        {"method": "suffix"},
        {
            "k": "num_speculative_tokens",
            "depth": "suffix_decoding_max_tree_depth",
            "cached": "suffix_decoding_max_cached_requests",
            "factor": "suffix_decoding_max_spec_factor",
            "prob": "suffix_decoding_min_token_prob",
        },
        describes="vLLM's suffix decoding (Arctic Inference's trees over the prompt and earlier responses)",
    ),
    NamedBaseline(
        "draft",
        {"spec-type": "draft-simple"},
        {"n": "spec-draft-n-max"},
        path_key="model-draft",
        describes="a standalone draft model (a transformers directory), as llama-server's draft-simple runs it",
    ),
    NamedBaseline(
        "draft-vllm",
        {"method": "draft_model"},
        {"k": "num_speculative_tokens"},
        path_key="model",
        describes="a standalone draft model, as vLLM's draft_model runs it",
    ),
    NamedBaseline(
        "pard-vllm",
        {"method": "draft_model", "parallel_drafting": True},
        {"k": "num_speculative_tokens"},
        path_key="model",
        describes="a parallel draft model (PARD: K drafts in one pass through mask tokens), as vLLM's draft_model runs it",
    ),
)
_SETTINGS = re.compile(r"[\w.-]+=[^,=:]*(,[\w.-]+=[^,=:]*)*")


def _named(text: str) -> NamedBaseline | None:
    """The entry whose prefix `text` starts with (then ':' or its end), longest prefix first."""
    for entry in sorted(NAMED, key=lambda e: -len(e.prefix)):
        if text == entry.prefix or text.startswith(entry.prefix + ":"):
            return entry
    return None


def is_named(text: str) -> bool:
    """A baseline name rather than a path (a file or directory of that name wins): one of NAMED, or
    a misspelt one (`ngram:vlm`), which `config_of` then refuses by name."""
    families = {e.prefix.split(":")[0] for e in NAMED}
    misspelt = ":" in text and text.split(":")[0] in families
    return not os.path.exists(text) and (_named(text) is not None or misspelt)


def _entry(text: str) -> NamedBaseline:
    entry = _named(text)
    if entry is None:
        raise UserError(f"--ckpt {text!r}: no such baseline; named ones: {', '.join(e.usage() for e in NAMED)}")
    return entry


def _split(entry: NamedBaseline, text: str) -> tuple[str | None, str]:
    """(the draft model's path or None, the settings text) of a name."""
    rest = text[len(entry.prefix) + 1 :]
    if entry.path_key is None:
        return None, rest
    path, sep, settings = rest.rpartition(":")
    if not sep or not _SETTINGS.fullmatch(settings):  # a path may hold ':' itself
        path, settings = rest, ""
    if not path:
        raise UserError(f"--ckpt {text!r}: name the draft model's directory: {entry.usage()}")
    return path, settings


def _value(text: str):
    if text in ("true", "false"):  # a JSON boolean, as the engine's config file would spell it
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _settings(entry: NamedBaseline, text: str, name: str) -> dict:
    if text and not _SETTINGS.fullmatch(text):
        raise UserError(
            f"--ckpt {name!r}: settings {text!r} are not key=value pairs separated by commas: {entry.usage()}"
        )
    pairs = [item.split("=", 1) for item in text.split(",")] if text else []
    settings = {}
    for key, value in pairs:
        engine_key = entry.short.get(key, key)
        if engine_key in settings:
            raise UserError(f"--ckpt {name!r}: {key!r} is given twice")
        settings[engine_key] = _value(value)
    return settings


def config_of(text: str) -> dict:
    """The engine settings a name stands for, as its JSON file would hold them."""
    entry = _entry(text)
    path, settings_text = _split(entry, text) if text != entry.prefix else (None, "")
    if entry.path_key is not None and path is None:
        raise UserError(f"--ckpt {text!r}: name the draft model's directory: {entry.usage()}")
    raw = {**entry.fixed, **_settings(entry, settings_text, text)}
    if path is not None:
        raw[entry.path_key] = os.path.abspath(os.path.expanduser(path))
    return raw


def dir_name(text: str) -> str:
    """Its results directory under --out: `ngram_vllm_k=4`, `draft_small_n=4`."""
    entry = _entry(text)
    path, settings = _split(entry, text) if text != entry.prefix else (None, "")
    parts = [*entry.prefix.split(":"), os.path.basename(os.path.normpath(path)) if path else "", settings]
    return "_".join(p.replace(",", "_") for p in parts if p)
