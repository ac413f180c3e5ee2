"""DDTree (Ringel & Romano): the draft tree of budget N and how deep the
target's greedy path reaches into it.

From one drafter pass we have per-depth distributions q_1..q_L (L = block length - 1). A node is
a prefix u = (u_1..u_d) scored by prod q_i(u_i); the tree of budget N is the N best prefixes,
found best-first with a heap over the top-K tokens of every depth, K = min(N, V), the root (the
block's first token) not counted. We reproduce the reference `build_ddtree_tree` pop order
exactly (same heap keys: (-log weight, rank tuple), same float arithmetic), so ties resolve
the same way.

Key fact used here: the heap's pop sequence does not depend on N (a node whose last rank is
>= N is preceded by its N lower-ranked siblings), so the tree of budget N is the first N pops
of one run with K = max budget. We therefore run the heap once per anchor and record when each
prefix of the target's path is popped; the accepted depth for every budget follows
(metrics.tree_accepted).

Ties. Tokens with equal logits are ranked by token id (lower first). `torch.topk` leaves their
order unspecified and it changes with k (measured: the first 16 ids of topk(16) and topk(1024)
differ on quantised logits), which would make a tree depend on the largest budget scored; a
fixed order makes the top-K of budget N the first N of the top-K of any larger budget.

This module is the definition (Python heap, torch top-K); ddtree_kernels.py computes
the same pop indices compiled, and tests/scoring/methods/test_ddtree_kernels.py holds the two equal.

The semantics, in words: docs/ddtree.md.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from proposers.toolkit.ranking import top_k_ids

NOT_IN_TREE = np.iinfo(np.int64).max


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probabilities and token ids per depth, float32, as the reference computes them
    (top-k of the logits minus their logsumexp; ties by token id, see above).
    logits [..., L, V] -> ([..., L, k], [..., L, k])."""
    logits = logits.float()
    top_ids = top_k_ids(logits, k)
    return logits.gather(-1, top_ids) - torch.logsumexp(logits, dim=-1, keepdim=True), top_ids


def path_ranks(top_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Rank of each target token among the top-K of its depth, -1 if absent. [a, L, K], [a, L] -> [a, L]."""
    hit = top_ids == targets[..., None]
    return torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(targets, -1))


def best_first(top_logp: np.ndarray, topk: int):
    """Yield tree nodes as rank tuples in the reference heap's pop order (best-first by
    prod q, ties by rank tuple). A popped node pushes its next sibling (same depth, next
    rank, if rank + 1 < topk) and its first child (next depth, rank 0)."""
    depth_limit = top_logp.shape[0]
    if depth_limit == 0:
        return
    first_logw = float(top_logp[0, 0])
    heap = [(-first_logw, (0,), 1, 0, first_logw)]
    while heap:
        _, ranks, depth, rank, logw = heapq.heappop(heap)
        yield ranks
        if rank + 1 < topk:
            sibling_logw = logw - float(top_logp[depth - 1, rank]) + float(top_logp[depth - 1, rank + 1])
            heapq.heappush(heap, (-sibling_logw, ranks[:-1] + (rank + 1,), depth, rank + 1, sibling_logw))
        if depth < depth_limit:
            child_logw = logw + float(top_logp[depth, 0])
            heapq.heappush(heap, (-child_logw, ranks + (0,), depth + 1, 0, child_logw))


def path_pop_indices(top_logp: np.ndarray, path_ranks: np.ndarray, max_budget: int) -> np.ndarray:
    """Pop index (0-based) of each prefix of the target path in the best-first tree build.

    top_logp [L, K] float32 log-probs of the top-K tokens per depth (K = min(max_budget, V)).
    path_ranks [D] rank of the target's token at depth d+1 among the top-K (-1 if absent);
    D <= L is how far the target path is known. Returns [D] pop indices (NOT_IN_TREE when the
    prefix is not among the first max_budget pops). The tree of budget N contains the prefix of
    depth d iff its pop index < N.
    """
    result = np.full(len(path_ranks), NOT_IN_TREE, dtype=np.int64)
    if len(path_ranks) == 0 or path_ranks[0] < 0 or max_budget <= 0:
        return result
    found = 0  # prefixes of the path found so far; the next one wanted has depth found + 1
    wanted = (int(path_ranks[0]),)
    for pops, ranks in enumerate(best_first(top_logp, top_logp.shape[1])):
        if pops >= max_budget:
            break
        if ranks == wanted:
            result[found] = pops
            found += 1
            if found == len(path_ranks) or path_ranks[found] < 0:
                break
            wanted = wanted + (int(path_ranks[found]),)
    return result


def tree_pops_reference(
    logits: torch.Tensor, targets: torch.Tensor, known: torch.Tensor, max_nodes: int
) -> torch.Tensor:
    """DDTree pop index of every target-path prefix per anchor, one Python heap per anchor (the
    definition; the scorer runs ddtree_kernels.tree_pops). logits [a, L, V], targets/known
    [a, L] -> [a, L] int64 on CPU."""
    pops = torch.full(targets.shape, NOT_IN_TREE, dtype=torch.long)
    top_logp, top_ids = top_log_probs(logits, max_nodes)
    ranks = path_ranks(top_ids, targets).cpu().numpy()
    top_logp = top_logp.cpu().numpy()
    known_depth = known.sum(dim=1).cpu().numpy()
    for i in range(targets.shape[0]):
        found = path_pop_indices(top_logp[i], ranks[i, : known_depth[i]], max_nodes)
        pops[i, : found.size] = torch.from_numpy(found)
    return pops
