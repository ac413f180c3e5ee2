"""The n-gram proposer's settings in the project's terms, and its registry record."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.common.errors import UserError
from proposers.ngram.layout import (
    LlamaNgramCache,
    LlamaNgramMap,
    LlamaNgramMod,
    LlamaNgramSimple,
    SglangNgram,
    VllmNgram,
)
from proposers.ngram.proposer import NgramProposer
from proposers.ngram.sglang import SglangNgramProposer, SglangSettings
from proposers.ngram.stateful import LlamaStatefulProposer
from proposers.registry import Family


@dataclass
class NgramConfig:
    min_n: int
    max_n: int
    block_size: int  # drafts per step at most: vLLM's num_speculative_tokens, llama.cpp's size-m
    family: str = "ngram"
    layout: str = "vllm"
    # whose lookup: vLLM's ngram (proposer.py), llama.cpp's ngram-simple (llama_simple.py), ngram-map-k,
    # ngram-map-k4v (llama_map.py), ngram-mod (llama_mod.py) or SGLang's NGRAM ("sglang": sglang.py)
    rule: str = "vllm"
    min_hits: int = 1  # ngram-map-k4v: draft calls a key needs before it drafts
    n_min: int = 0  # ngram-mod: fewer chained tokens drop the draft
    # why `score --steps` cannot set block_size (None: it is the engine's draft-length flag)
    fixed_steps: str | None = None
    sglang: SglangSettings | None = None  # SGLang's NGRAM: its flags
    raw: dict = field(default_factory=dict, repr=False)


FIXED_STEPS = (
    "llama-server's n-gram types draft as many tokens as their own settings allow whatever --spec-draft-n-max "
    "says; set {key} in its config instead"
)


def _cache_config(checked: LlamaNgramCache, raw: dict, source: str) -> NgramConfig:
    for key, value in (
        ("lookup-cache-static", checked.lookup_cache_static),
        ("lookup-cache-dynamic", checked.lookup_cache_dynamic),
    ):
        if value is not None:  # cache files drafted from beside the slot's own counts
            raise UserError(
                f"{source}: field {key!r}: ngram-cache's cache files are not replayed yet; score without them"
            )
    fixed = "llama-server's ngram-cache drafts up to 8 tokens whatever --spec-draft-n-max says (it has no size flag)"
    return NgramConfig(1, 4, 8, layout="llama.cpp", rule="ngram-cache", fixed_steps=fixed, raw=raw)


def _sglang_config(checked: SglangNgram, raw: dict, source: str) -> NgramConfig:
    """SGLang's NGRAM: a tree of speculative_num_draft_tokens - 1 nodes, its longest path the chain."""
    if checked.speculative_ngram_external_corpus_path is not None:  # a suffix automaton beside the trie
        raise UserError(
            f"{source}: field 'speculative_ngram_external_corpus_path': SGLang's external n-gram corpus is not "
            "replayed yet; score without it"
        )
    settings = SglangSettings(
        draft_token_num=checked.speculative_num_draft_tokens,
        max_trie_depth=checked.speculative_ngram_max_trie_depth,
        min_bfs_breadth=checked.speculative_ngram_min_bfs_breadth,
        max_bfs_breadth=checked.speculative_ngram_max_bfs_breadth,
        match_type=checked.speculative_ngram_match_type,
        capacity=checked.speculative_ngram_capacity,
        overlap=not checked.disable_overlap_schedule,
    )
    fixed = (
        "SGLang's NGRAM drafts a tree of speculative_num_draft_tokens - 1 nodes whatever --steps says; set "
        "speculative_num_draft_tokens in its config instead"
    )
    depth = settings.max_trie_depth
    return NgramConfig(
        1, depth, settings.budget, layout="sglang", rule="sglang", fixed_steps=fixed, sglang=settings, raw=raw
    )


def parse_config(checked, raw: dict, source: str = "config", target_layers: int | None = None):
    if isinstance(checked, SglangNgram):
        return _sglang_config(checked, raw, source)
    if isinstance(checked, LlamaNgramCache):
        return _cache_config(checked, raw, source)
    if isinstance(checked, LlamaNgramMap):
        n, m, hits = checked.sizes
        fixed = FIXED_STEPS.format(key=f"spec-ngram-map-{checked.spec_type.removeprefix('ngram-map-')}-size-m")
        rule = checked.spec_type
        return NgramConfig(n, n, m, layout="llama.cpp", rule=rule, fixed_steps=fixed, min_hits=hits, raw=raw)
    if isinstance(checked, LlamaNgramMod):
        fixed = FIXED_STEPS.format(key="spec-ngram-mod-n-max")
        n = checked.n_match
        return NgramConfig(
            n, n, checked.n_max, layout="llama.cpp", rule="ngram-mod", fixed_steps=fixed, n_min=checked.n_min, raw=raw
        )
    if isinstance(checked, LlamaNgramSimple):
        n = checked.size_n
        fixed = (
            "llama-server's ngram-simple drafts up to spec-ngram-simple-size-m tokens whatever --spec-draft-n-max "
            "says; set that key in its config instead"
        )
        return NgramConfig(n, n, checked.size_m, layout="llama.cpp", rule="ngram-simple", fixed_steps=fixed, raw=raw)
    assert isinstance(checked, VllmNgram), type(checked)
    low, high = checked.lookup
    return NgramConfig(low, high, checked.num_speculative_tokens, raw=raw)


STATEFUL_RULES = ("ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def ngram_proposer(config: NgramConfig):
    """The lookup as a Proposer: a stateless one at every anchor, or one with state along the server's loop."""
    if config.rule == "sglang":
        return SglangNgramProposer(config)
    return LlamaStatefulProposer(config) if config.rule in STATEFUL_RULES else NgramProposer(config)


FAMILY = Family("ngram", parse_config, model=None, proposer=ngram_proposer, independent_drafts=False, chain_steps=True)
