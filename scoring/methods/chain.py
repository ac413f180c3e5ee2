"""The chain: a verification step accepts the leading drafts equal to the target's tokens (greedy:
the stored tokens; sampled shards: its expectation under rejection sampling, scoring/score/collect.py)."""

from __future__ import annotations

import torch

from scoring.methods.base import Method
from scoring.replay import metrics

CHAIN = "chain"


class Chain(Method):
    kind = CHAIN

    def name(self, setting) -> str:
        return CHAIN

    def setting_of(self, name: str):
        return CHAIN if name == CHAIN else None

    def column(self, setting, sampled: bool = False) -> str:
        return "expected_accepted_len" if sampled else "accepted_len"

    def anchor_fields(self, settings) -> list:
        return []  # accepted_len and expected_accepted_len are the anchors table's own (results.ANCHORS)

    def accepted(self, result, setting, settings, rows=slice(None)) -> torch.Tensor:
        return metrics.leading_matches(result.draft_tokens[rows], result.target_tokens[rows])


CHAIN_METHOD = Chain()
