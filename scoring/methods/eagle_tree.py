"""EAGLE's dynamic tree as sglang verifies it (docs/eagle-tree.md): the proposer drafts its own tree
candidates (a TreeProposer: EAGLE-3, proposers/toolkit/eagle/tree.py) and the tree of a setting keeps the
best `draft_tokens - 1` of them. Greedy verification walks from the root along the target's argmax,
which offline is the stored token: alpha = the depth of the deepest node on the stored path inside
the tree. Unlike the chain, a branch's drafts are not the stored tokens, so nothing is teacher-forced:
the trees are drafted for real.

A setting is sglang's own numbers: a beam of `topk` nodes per depth (--speculative-eagle-topk),
`depth` levels (--speculative-num-steps), `draft_tokens` verified per step, the root included
(--speculative-num-draft-tokens). Drafted on greedy shards only: sglang verifies a tree at T > 0 by
tree speculative sampling, whose outcome the stored response does not decide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from pipeline.common import timing
from pipeline.common.errors import UserError
from proposers.interface import ROOT, Chunk, TreeCandidates
from proposers.toolkit.ranking import top_k_ids
from scoring.methods.base import ChunkScores, Method

EAGLE_TREE_PREFIX = "eagle-tree-"  # polars: pl.col("method").str.starts_with(EAGLE_TREE_PREFIX)
_SETTING = re.compile(r"(\d+)x(\d+)-(\d+)")  # as --eagle-trees spells one: 4x5-8
_NAME = re.compile(EAGLE_TREE_PREFIX + _SETTING.pattern)
SPELLING = "topk x depth - draft tokens, comma-separated, like 4x5-8,8x5-32"
# bytes per vocabulary entry per branch row a step holds at once: the logits, their probabilities
# and, for a row tied at its k-th value, top_k_ids' int64 sort keys and temporaries
BYTES_PER_ENTRY = 48


@dataclass(frozen=True, order=True)
class EagleTree:
    """One setting of sglang's EAGLE dynamic tree, in sglang's own numbers (module docstring)."""

    topk: int
    depth: int
    draft_tokens: int

    @property
    def name(self) -> str:
        """As `score --eagle-trees` spells it: '4x5-8'."""
        return f"{self.topk}x{self.depth}-{self.draft_tokens}"

    @property
    def method(self) -> str:
        return EAGLE_TREE_PREFIX + self.name

    @property
    def column(self) -> str:
        """anchors.parquet column of its accepted length per anchor (bonus-exclusive)."""
        return f"eagle_tree_{self.topk}x{self.depth}_{self.draft_tokens}_accepted_len"


def parse_eagle_trees(text: str, option: str = "--eagle-trees") -> list[EagleTree]:
    """'4x5-8,8x5-32' -> their EagleTrees, in the order given, repeats dropped; '' -> []. A
    setting sglang would not run is a UserError naming `option`."""
    trees = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        match = _SETTING.fullmatch(part)
        if not match:
            raise UserError(f"{option}: {part!r} is not a tree setting; expected {SPELLING}")
        tree = EagleTree(*map(int, match.groups()))
        most = 1 + tree.topk + (tree.depth - 1) * tree.topk**2  # the root and every candidate
        if min(tree.topk, tree.depth) < 1 or not 2 <= tree.draft_tokens <= most:
            raise UserError(
                f"{option} {part}: needs topk >= 1, depth >= 1 and 2 <= draft tokens <= {most} "
                "(the root plus every candidate the beam proposes)"
            )
        trees += [tree] if tree not in trees else []
    return trees


class EagleTrees(Method):
    kind = "eagle-tree"

    def name(self, tree: EagleTree) -> str:
        return tree.method

    def setting_of(self, name: str) -> EagleTree | None:
        match = _NAME.fullmatch(name)
        return EagleTree(*map(int, match.groups())) if match else None

    def column(self, tree: EagleTree, sampled: bool = False) -> str:
        return tree.column

    def order(self, tree: EagleTree) -> tuple:
        return (tree.draft_tokens, tree.topk, tree.depth)

    def empty(self, anchors: int, positions: int, settings) -> torch.Tensor:
        """[A, S] alpha of each setting."""
        return torch.zeros((anchors, len(settings)), dtype=torch.long)

    def chunk(self, scored: ChunkScores, settings) -> torch.Tensor:
        return chunk_accepted(scored, settings)

    def accepted(self, result, tree: EagleTree, settings, rows=slice(None)) -> torch.Tensor:
        return result.method_data[self.kind][rows, list(settings).index(tree)]


EAGLE_TREES = EagleTrees()


@torch.inference_mode()
def chunk_accepted(scored: ChunkScores, trees) -> torch.Tensor:
    """alpha [a, S] of each of `trees` (S of them, in order) at the chunk's anchors: one beam per
    distinct topk, run to the deepest depth asked of it (a shallower tree's beam is its prefix)."""
    chunk, packed = scored.chunk, scored.packed
    out = torch.zeros(chunk.anchors.numel(), len(trees), dtype=torch.long)
    for topk in sorted({tree.topk for tree in trees}):
        mine = [i for i, tree in enumerate(trees) if tree.topk == topk]
        depth = max(trees[i].depth for i in mine)
        size = anchors_per_tree_chunk(topk, scored.target.lm_head.shape[0], scored.options.memory_bytes)
        for begin in range(0, chunk.anchors.numel(), size):
            part = slice(begin, begin + size)
            sub = Chunk(chunk.sample_idx[part], chunk.anchors[part], chunk.block_len)
            with timing.stage("eagle tree", anchors=sub.anchors.numel(), topk=topk, depth=depth):
                found = scored.proposer.tree_candidates(packed, sub, topk, depth, scored.target, scored.options)
                targets = known_targets(packed, sub, depth)
                for i in mine:
                    out[part, i] = accepted_depth(found, trees[i], targets).cpu()
    return out


def accepted_depth(found: TreeCandidates, tree: EagleTree, targets: torch.Tensor) -> torch.Tensor:
    """alpha [a] of `tree` (its depth's candidates, the best draft_tokens - 1 kept) against the
    stored tokens `targets` [a, >= depth] (-1 where unknown): the levels holding a kept node whose
    token is the target's and whose parent was accepted (the root always is)."""
    size = found.size(tree.depth)
    kept = torch.zeros_like(found.tokens[:, :size], dtype=torch.bool)
    kept.scatter_(1, top_k_ids(found.scores[:, :size], tree.draft_tokens - 1), True)
    accepted = torch.zeros_like(kept)
    alpha = torch.zeros(kept.shape[0], dtype=torch.long, device=kept.device)
    for d in range(1, tree.depth + 1):
        level = slice(found.size(d - 1) if d > 1 else 0, found.size(d))
        parents = found.parents[:, level]
        parent_ok = accepted.gather(1, parents.clamp(min=0)) | (parents == ROOT)
        accepted[:, level] = kept[:, level] & parent_ok & (found.tokens[:, level] == targets[:, d - 1 : d])
        alpha += accepted[:, level].any(1).long()
    return alpha


def known_targets(packed, chunk: Chunk, depth: int) -> torch.Tensor:
    """[a, depth] the stored token at t + 1 .. t + depth, -1 past the end of the sample."""
    anchors = chunk.anchors
    positions = anchors[:, None] + 1 + torch.arange(depth, device=anchors.device)[None, :]
    known = positions < packed.lengths[chunk.sample_idx][:, None]
    return torch.where(known, packed.stored(chunk.sample_idx, anchors, depth), -1)


def anchors_per_tree_chunk(topk: int, vocab: int, memory_bytes: int) -> int:
    """Anchors whose branch rows' vocabulary-sized temporaries fit the memory budget."""
    return max(1, memory_bytes // (topk * vocab * BYTES_PER_ENTRY))
