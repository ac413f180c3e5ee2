"""The n-gram proposer's settings in the project's terms, and its registry record."""

from __future__ import annotations

from dataclasses import dataclass, field

from proposers.ngram.layout import LlamaNgramSimple, VllmNgram
from proposers.ngram.proposer import NgramProposer
from proposers.registry import Family


@dataclass
class NgramConfig:
    min_n: int
    max_n: int
    block_size: int  # drafts per step at most: vLLM's num_speculative_tokens, llama.cpp's size-m
    family: str = "ngram"
    layout: str = "vllm"
    rule: str = "vllm"  # whose lookup: vLLM's ngram (proposer.py), llama.cpp's ngram-simple (llama_simple.py)
    # why `score --steps` cannot set block_size (None: it is the engine's draft-length flag)
    fixed_steps: str | None = None
    raw: dict = field(default_factory=dict, repr=False)


def parse_config(checked, raw: dict, source: str = "config", target_layers: int | None = None):
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


FAMILY = Family("ngram", parse_config, model=None, proposer=NgramProposer, independent_drafts=False, chain_steps=True)
