"""The suffix decoding proposer's settings in the project's terms, and its registry record."""

from __future__ import annotations

from dataclasses import dataclass, field

from proposers.registry import Family
from proposers.suffix.layout import VllmSuffix
from proposers.suffix.proposer import SuffixProposer


@dataclass
class SuffixConfig:
    block_size: int  # drafts per step at most: vLLM's num_speculative_tokens (`score --steps` sets it)
    max_tree_depth: int  # the trees' depth, and the context matched: its last max_tree_depth tokens
    max_cached_requests: int  # responses the global tree keeps (FIFO); 0: no global tree
    max_spec_factor: float  # a match of m tokens drafts at most m * max_spec_factor tokens
    min_token_prob: float  # a draft token's estimated probability below it ends the draft
    family: str = "suffix"
    layout: str = "vllm"
    raw: dict = field(default_factory=dict, repr=False)


def parse_config(checked: VllmSuffix, raw: dict, source: str = "config", target_layers: int | None = None):
    return SuffixConfig(
        checked.draft_length,
        checked.suffix_decoding_max_tree_depth,
        checked.suffix_decoding_max_cached_requests,
        checked.suffix_decoding_max_spec_factor,
        checked.suffix_decoding_min_token_prob,
        raw=raw,
    )


FAMILY = Family("suffix", parse_config, model=None, proposer=SuffixProposer, independent_drafts=False, chain_steps=True)
