"""The EAGLE dynamic tree as sglang builds it (EAGLE-2's, which sglang drafts for EAGLE-1/2 and
EAGLE-3 drafters alike), at every anchor of a chunk at once (its verification against the stored
tokens, and the tree settings: scoring/methods/eagle_tree.py).

sglang (speculative/eagle_worker.py `draft_forward`, eagle_utils.py `select_top_k_tokens`,
`organize_draft_results`): probabilities are the softmax of a step's draft logits (over the draft
vocabulary, mapped to target ids). Depth 1: the `topk` best tokens of step 1, scored by their
probability; they are the first beam. Depth d > 1: each of the `topk` beam nodes of depth d - 1
runs one drafter step (its token, the hidden state of the step that proposed it, at position
t + d - 2, seeing the context before the anchor and its own ancestors' steps only), its `topk`
best children scored parent score x probability; the `topk` best of those topk x topk children
are the next beam. After `depth` levels every candidate (topk at depth 1, topk x topk at each
deeper one, in that order) competes and the best `draft_tokens - 1` are the tree.

Ties (docs/eagle-tree.md): every top-k here is `ranking.top_k_ids` (equal values to the lower
index: the lower token id among a step's tokens, the earlier candidate among candidates), where
sglang's torch.topk leaves them unspecified. A child's score never exceeds its parent's
(p <= 1, and float multiplication is monotone) and a parent always comes earlier, so the kept
set is closed under parents; a node whose parent were missing could not be reached anyway.

Unlike the chain, a branch's drafts are not the stored tokens, so nothing is teacher-forced: the
trees are drafted for real, all anchors' branches of a chunk batched as rows of one step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proposers.interface import ROOT, Chunk, PackedTokens, ProposeOptions, TargetHead, TreeCandidates
from proposers.toolkit.ranking import top_k_ids

# Candidates (proposers.interface.TreeCandidates) in sglang's order: depth 1's topk, then per deeper
# depth the topk x topk children of its beam (beam node major). C = topk + (depth - 1) x topk^2;
# the candidates of a shallower tree are a prefix.


def top_probs(drafter, lm_head, h: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities [R, k], target ids [R, k]) of the k likeliest drafts after steps whose last
    hidden states are h [R, H] (pre-norm), ties to the lower id."""
    logits = drafter.logits(drafter.norm(h)[:, None], lm_head)[:, 0]  # [R, V]
    probs = torch.softmax(logits.float(), dim=-1)
    ids = top_k_ids(probs, topk)
    return probs.gather(-1, ids), ids


def beam_candidates(
    drafter, packed: PackedTokens, chunk: Chunk, topk: int, depth: int, target: TargetHead, options: ProposeOptions
) -> TreeCandidates:
    """The candidates of the `depth`-level beam of `topk` at the chunk's anchors (module docstring);
    `packed.state` is the drafter's context (proposers/toolkit/neural.py)."""
    anchors, lm_head, context = chunk.anchors, target.lm_head, packed.state
    starts = packed.starts[chunk.sample_idx]
    rows = anchors.repeat_interleave(topk)  # [a * k] one row per beam node
    base, layer_kv = drafter.step_context(rows, context, options.attention_backend, starts.repeat_interleave(topk))
    h = drafter.first_hidden(anchors, context, starts)  # [a, H] step 1
    p, ids = top_probs(drafter, lm_head, h, topk)  # [a, k]
    found = TreeCandidates(p, ids, torch.full_like(ids, ROOT), topk)
    beam = Beam(p, ids, torch.arange(topk, device=ids.device).expand_as(ids), h.repeat_interleave(topk, 0), None)
    table, scale = drafter.embedding_table(target.embed), drafter.config.scales(options.conventions)[0]
    for d in range(2, depth + 1):
        embeds = torch.nn.functional.embedding(beam.tokens.flatten(), table).to(options.dtype) * scale
        h, path = drafter.step(beam.hidden, embeds, (rows + d - 2)[:, None], base, layer_kv, beam.path)
        p, ids = top_probs(drafter, lm_head, h, topk)  # [a * k, k]
        beam = beam.expand(found, p, ids, h, path)
    return found


@dataclass
class Beam:
    """The `topk` nodes of one depth that run the next step, per anchor."""

    scores: torch.Tensor  # [a, k]
    tokens: torch.Tensor  # [a, k]
    index: torch.Tensor  # [a, k] their candidate indices
    hidden: torch.Tensor  # [a * k, H] the last hidden state of the step that proposed each
    path: list | None  # per drafter layer (k, v) [a * k, kv_heads, m, d]: the steps of its ancestors

    def expand(self, found: TreeCandidates, p, ids, h, path) -> Beam:
        """Record the children of this beam (probabilities p and ids [a * k, k] of the step it ran,
        its hidden states h [a * k, H] and step keys `path`) in `found`; the next beam."""
        a, k = self.scores.shape
        children = child_scores(self.scores, p.view(a, k, k)).flatten(1)  # [a, k * k] sglang's expand_scores
        offset = found.scores.shape[1]
        found.scores = torch.cat([found.scores, children], 1)
        found.tokens = torch.cat([found.tokens, ids.view(a, k * k)], 1)
        found.parents = torch.cat([found.parents, self.index.repeat_interleave(k, 1)], 1)
        chosen = top_k_ids(children, k)  # [a, k]
        rows = (chosen // k + torch.arange(a, device=chosen.device)[:, None] * k).flatten()  # parents' rows
        keep = path_rows(rows)
        return Beam(
            children.gather(1, chosen),
            ids.view(a, k * k).gather(1, chosen),
            offset + chosen,
            h[rows],
            [(keys[keep], values[keep]) for keys, values in path],
        )


def child_scores(parents: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[a, k, k] a child's score: its parent's (parents [a, k]) times its own probability p [a, k, k]."""
    return parents[:, :, None] * p


def path_rows(parents: torch.Tensor) -> torch.Tensor:
    """The rows whose step keys a new beam node's path continues: its parent's, so that it attends
    to its own ancestors only (sglang's v1 worker keeps lane i's keys for the lane's next node
    instead, whoever its parent: docs/eagle-tree.md)."""
    return parents
