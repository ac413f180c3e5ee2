"""What a verification method is, in the replay's terms.

A method has settings (the chain one, DDTree its node budgets, EAGLE trees their shapes), a results
name per setting (`chain`, `ddtree-16`, `eagle-tree-4x5-8`) and an anchors.parquet column of its
accepted length. While the replay scores a chunk of anchors it may compute per-anchor data from the
chunk's drafts (`chunk`: DDTree's pop indices, an EAGLE tree's depths); `accepted` reads that data
(or the chain's drafts) as accepted drafts per anchor, bonus-exclusive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch

from proposers.interface import Chunk, Drafts, PackedTokens, Proposer, TargetHead


@dataclass
class ChunkScores:
    """A chunk's drafts as the replay scored them, for the methods that compute from them."""

    proposer: Proposer
    packed: PackedTokens
    chunk: Chunk
    target: TargetHead
    options: Any  # scoring.replay.packing.ReplayOptions
    drafts: Drafts
    scores: torch.Tensor | None  # [a, depth, V] float32 draft logits (None when no metric or method reads them)
    lse: torch.Tensor | None  # [a, depth] their logsumexp
    targets: torch.Tensor  # [a, depth] the stored tokens, -1 where unknown
    known: torch.Tensor  # [a, depth] bool


class Method:
    """One verification method; subclasses override what differs from the chain-like defaults."""

    kind: str  # the registry's key, and what `plan` keys its settings by

    def name(self, setting) -> str:
        """The results' method name of one setting."""
        raise NotImplementedError

    def setting_of(self, name: str):
        """The setting whose name is `name`; None when `name` is not this method's."""
        raise NotImplementedError

    def column(self, setting, sampled: bool = False) -> str:
        """anchors.parquet column of the setting's accepted length per anchor (bonus-exclusive)."""
        raise NotImplementedError

    def order(self, setting) -> tuple:
        """Sort key among this method's settings; its first entry is the tree's size."""
        return (0,)

    def anchor_fields(self, settings) -> list[pa.Field]:
        """The anchors.parquet columns the method adds for `settings` (the chain's are the core's)."""
        return [pa.field(self.column(setting), pa.int32()) for setting in settings]

    def needs_scores(self, settings) -> bool:
        """Whether `chunk` reads the drafts' float32 logits and their logsumexp."""
        return False

    def empty(self, anchors: int, positions: int, settings) -> torch.Tensor | None:
        """Per-anchor data of a sample before any anchor is scored (None: the method keeps none)."""
        return None

    def chunk(self, scored: ChunkScores, settings):
        """Per-anchor data [a, ...] of a scored chunk (a Future when computed in a worker), or None."""
        return None

    def resolve(self, data):
        """The chunk's data once computed (a Future waited for)."""
        return data

    def write(self, store: torch.Tensor, rows: torch.Tensor, depth: int, data: torch.Tensor) -> None:
        """Store a chunk's data of anchors `rows` of one sample into its per-anchor `store`."""
        store[rows] = data

    def accepted(self, result, setting, settings, rows=slice(None)) -> torch.Tensor:
        """Accepted drafts [A] at the anchors `rows` of `result` (scoring.replay.anchors.AnchorTensors)."""
        raise NotImplementedError
