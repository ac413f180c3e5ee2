"""The n-gram proposer's settings in the project's terms, and its registry record."""

from __future__ import annotations

from dataclasses import dataclass, field

from proposers.ngram.layout import VllmNgram
from proposers.ngram.proposer import NgramProposer
from proposers.registry import Family


@dataclass
class NgramConfig:
    min_n: int
    max_n: int
    block_size: int  # drafts per step: vLLM's num_speculative_tokens (`score --steps` sets it, as the engine's flag)
    family: str = "ngram"
    layout: str = "vllm"
    raw: dict = field(default_factory=dict, repr=False)


def parse_config(checked: VllmNgram, raw: dict, source: str = "config", target_layers: int | None = None):
    low, high = checked.lookup
    return NgramConfig(low, high, checked.num_speculative_tokens, raw=raw)


FAMILY = Family("ngram", parse_config, model=None, proposer=NgramProposer, independent_drafts=False, chain_steps=True)
