"""DDTree pop indices compiled (numba): the same answer as ddtree_heap.py, ~10x+ faster per
core, and without the GIL, so the score loop runs it in a worker thread beside the drafter.

Per anchor: the top-K logits of every depth (a size-K min-heap over one pass of the vocabulary,
ties by token id as ranking.top_k_ids), their log-probabilities against the row's logsumexp
(computed by torch, so the float32 values are the reference's), the target's rank per depth,
then the reference's best-first heap (ddtree_heap.best_first) until every path prefix is found or
max_nodes nodes are popped. Heap keys are (-log weight, rank tuple) in float64 with the
reference's arithmetic: a sibling's weight is its elder's minus q(elder) plus q(its own), a
child's its parent's plus q(top token), in that order. Rank tuples are compared only on equal
weights, by walking prefix pointers (a node stores its depth, last rank and prefix node).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from proposers.toolkit.ranking import top_k_ids
from scoring.methods.ddtree_heap import NOT_IN_TREE, path_ranks

_JIT = dict(nogil=True, cache=True)


@numba.njit(**_JIT)
def _worse(value_a, id_a, value_b, id_b) -> bool:
    """Entry a ranks below entry b: a smaller logit, or an equal one with a larger id."""
    return value_a < value_b or (value_a == value_b and id_a > id_b)


@numba.njit(**_JIT)
def _sift_down(values, ids, size, i) -> None:
    """Restore the min-heap (worst entry at 0) below position i."""
    while True:
        child = 2 * i + 1
        if child >= size:
            return
        if child + 1 < size and _worse(values[child + 1], ids[child + 1], values[child], ids[child]):
            child += 1
        if not _worse(values[child], ids[child], values[i], ids[i]):
            return
        values[i], values[child] = values[child], values[i]
        ids[i], ids[child] = ids[child], ids[i]
        i = child


_BLOCK = 16  # top_k_row skips whole blocks whose maximum cannot enter the top-k


@numba.njit(**_JIT)
def _block_maxima(row):
    """Maximum of each run of _BLOCK values of row [V] -> [ceil(V / _BLOCK)] (a branch-free pass
    the compiler vectorises)."""
    V = row.shape[0]
    out = np.full((V + _BLOCK - 1) // _BLOCK, -np.inf, np.float32)
    for b in range(V // _BLOCK):
        best = row[b * _BLOCK]
        for i in range(b * _BLOCK + 1, (b + 1) * _BLOCK):
            best = max(best, row[i])
        out[b] = best
    for i in range(V // _BLOCK * _BLOCK, V):
        out[-1] = max(out[-1], row[i])
    return out


@numba.njit(**_JIT)
def _offer(values, ids, k, value, index) -> None:
    """Put (value, index) in the min-heap of the best k if it beats the worst; indices arrive
    in increasing order, so a value equal to the worst never enters (lower ids win ties)."""
    if value > values[0]:
        values[0], ids[0] = value + np.float32(0.0), index  # + 0.0: -0.0 ties 0.0, as top_k_ids
        _sift_down(values, ids, k, 0)


@numba.njit(**_JIT)
def top_k_row(row, k, out_values, out_ids) -> None:
    """The k largest of row [V] float32, largest first, equal values by lower id, into
    out_values [k] float32 / out_ids [k] int64: a min-heap of the best k over one pass that
    skips every block whose maximum does not beat the heap's worst, then a sort of the k."""
    values, ids = np.empty(k, np.float32), np.empty(k, np.int64)
    for i in range(k):
        values[i], ids[i] = row[i] + np.float32(0.0), i
    for i in range(k // 2 - 1, -1, -1):
        _sift_down(values, ids, k, i)
    maxima = _block_maxima(row)
    for i in range(k, min(row.shape[0], (k // _BLOCK + 1) * _BLOCK)):  # the rest of k's own block
        _offer(values, ids, k, row[i], i)
    for b in range(k // _BLOCK + 1, maxima.shape[0]):
        if maxima[b] > values[0]:
            for i in range(b * _BLOCK, min(row.shape[0], (b + 1) * _BLOCK)):
                _offer(values, ids, k, row[i], i)
    by_id = np.argsort(ids)
    order = by_id[np.argsort(-values[by_id], kind="mergesort")]  # stable: equal values keep id order
    out_values[:] = values[order]
    out_ids[:] = ids[order]


@numba.njit(**_JIT)
def _ranks_before(a, b, depth, rank, prefix) -> bool:
    """Rank tuple of node a < that of node b (lexicographic, a proper prefix first)."""
    x, y = a, b
    for _ in range(depth[a] - depth[b]):
        x = prefix[x]
    for _ in range(depth[b] - depth[a]):
        y = prefix[y]
    decided = 0  # walking up, the last difference seen is the one nearest the root
    while x >= 0:
        if rank[x] != rank[y]:
            decided = -1 if rank[x] < rank[y] else 1
        x, y = prefix[x], prefix[y]
    return decided < 0 if decided != 0 else depth[a] < depth[b]


@numba.njit(**_JIT)
def _pops_before(key_a, node_a, key_b, node_b, depth, rank, prefix) -> bool:
    """Heap order: larger log weight first, equal weights by rank tuple (the reference's keys)."""
    return key_a > key_b or (key_a == key_b and _ranks_before(node_a, node_b, depth, rank, prefix))


@numba.njit(**_JIT)
def _heap_push(keys, nodes, size, key, node, depth, rank, prefix) -> int:
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        if not _pops_before(key, node, keys[parent], nodes[parent], depth, rank, prefix):
            break
        keys[i], nodes[i] = keys[parent], nodes[parent]
        i = parent
    keys[i], nodes[i] = key, node
    return size + 1


@numba.njit(**_JIT)
def _heap_pop(keys, nodes, size, depth, rank, prefix):
    """(best node, new size)."""
    top, size = nodes[0], size - 1
    key, node, i = keys[size], nodes[size], 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        right = child + 1
        if right < size and _pops_before(keys[right], nodes[right], keys[child], nodes[child], depth, rank, prefix):
            child = right
        if not _pops_before(keys[child], nodes[child], key, node, depth, rank, prefix):
            break
        keys[i], nodes[i] = keys[child], nodes[child]
        i = child
    keys[i], nodes[i] = key, node
    return top, size


@numba.njit(**_JIT)
def target_rank(row, target, limit) -> int:
    """Rank of token `target` in row [V] (larger logits first, equal ones by lower id), or -1
    when it is not among the first `limit`. One counting pass, no sort."""
    value, rank = row[target], 0
    for i in range(row.shape[0]):  # two branch-free counts the compiler vectorises
        rank += row[i] > value
    for i in range(target):
        rank += row[i] == value
    return rank if rank < limit else -1


@numba.njit(**_JIT)
def _ensure_ranks(logits_a, lse_a, d, need, have, K, top_logp) -> None:
    """Make ranks 0..need-1 of depth d available in top_logp[d] (log-probs, float32). Lists
    grow by doubling, each time recomputed whole: the canonical top-k is a prefix of the top-2k,
    so the heap never sees a value change."""
    if have[d] >= need:
        return
    k = min(K, max(need, 2 * have[d], 32))
    ids = np.empty(k, np.int64)
    top_k_row(logits_a[d], k, top_logp[d, :k], ids)
    top_logp[d, :k] -= lse_a[d]  # float32, as top_logits - logsumexp in torch
    have[d] = k


@numba.njit(**_JIT)
def _path_rank(logits_a, targets_a, depth, K, path_ranks, lazy) -> int:
    """The target's rank at `depth`: counted from the logits (lazy) or as given."""
    if lazy:
        path_ranks[depth] = target_rank(logits_a[depth], targets_a[depth], K)
    return path_ranks[depth]


@numba.njit(**_JIT)
def path_pops(logits_a, lse_a, targets_a, n_path, K, max_nodes, out, top_logp, have, path_ranks, scratch, prefix, lazy):
    """ddtree.path_pop_indices for one anchor. lazy: the top-K lists are read from the logits
    [L, V] (float32) and their logsumexp [L] as the heap reaches them (only the ranks it needs
    are selected) and the target's rank per depth is counted, not searched for; else top_logp
    [L, K] and path_ranks [L] are given whole (have = K). Writes out[:n_path] (left as is where
    a prefix is not popped). Scratch: scratch [2, 2 * max_nodes + 2] float64 (node log weights,
    heap keys), prefix [4, 2 * max_nodes + 2] int64 (node depth, rank, prefix node (-1 at the
    root), heap nodes)."""
    L = top_logp.shape[0]
    if n_path == 0 or max_nodes <= 0 or L == 0:
        return
    if _path_rank(logits_a, targets_a, 0, K, path_ranks, lazy) < 0:
        return
    logw, keys = scratch[0], scratch[1]
    depth, rank, parent, nodes = prefix[0], prefix[1], prefix[2], prefix[3]
    on_path = np.empty(prefix.shape[1], np.bool_)
    _ensure_ranks(logits_a, lse_a, 0, 1, have, K, top_logp)
    logw[0], depth[0], rank[0], parent[0], on_path[0] = np.float64(top_logp[0, 0]), 1, 0, -1, True
    size = _heap_push(keys, nodes, 0, logw[0], 0, depth, rank, parent)
    count, found, pops = 1, 0, 0
    while size > 0 and pops < max_nodes:
        node, size = _heap_pop(keys, nodes, size, depth, rank, parent)
        d, r = depth[node], rank[node]
        here = d <= n_path and on_path[node] and r == path_ranks[d - 1]  # the path's prefix of depth d
        if here and d == found + 1:
            out[found] = pops
            found += 1
            if found == n_path:
                return
            if _path_rank(logits_a, targets_a, found, K, path_ranks, lazy) < 0:
                return
        if r + 1 < K:  # next sibling
            _ensure_ranks(logits_a, lse_a, d - 1, r + 2, have, K, top_logp)
            w = logw[node] - np.float64(top_logp[d - 1, r]) + np.float64(top_logp[d - 1, r + 1])
            logw[count], depth[count], rank[count], parent[count], on_path[count] = (
                w,
                d,
                r + 1,
                parent[node],
                on_path[node],
            )
            size = _heap_push(keys, nodes, size, w, count, depth, rank, parent)
            count += 1
        if d < L:  # first child
            _ensure_ranks(logits_a, lse_a, d, 1, have, K, top_logp)
            w = logw[node] + np.float64(top_logp[d, 0])
            logw[count], depth[count], rank[count], parent[count], on_path[count] = w, d + 1, 0, node, here
            size = _heap_push(keys, nodes, size, w, count, depth, rank, parent)
            count += 1
        pops += 1


@numba.njit(**_JIT)
def tree_pops_batch(logits, lse, targets, known_depth, max_nodes, out) -> None:
    """Pop indices of every anchor: logits [a, L, V] float32, lse [a, L] float32 (torch's
    logsumexp of each row), targets [a, L] int64, known_depth [a]; out [a, L] int64 prefilled
    with NOT_IN_TREE. K = min(max_nodes, V) tokens per depth."""
    A, L, V = logits.shape
    K = min(max_nodes, V)
    top_logp = np.empty((L, max(K, 1)), np.float32)
    have, path_ranks = np.empty(L, np.int64), np.empty(L, np.int64)
    scratch = np.empty((2, 2 * max_nodes + 2))
    prefix = np.empty((4, 2 * max_nodes + 2), np.int64)
    for a in range(A):
        have[:] = 0
        path_pops(
            logits[a],
            lse[a],
            targets[a],
            known_depth[a],
            K,
            max_nodes,
            out[a],
            top_logp,
            have,
            path_ranks,
            scratch,
            prefix,
            True,
        )


@numba.njit(**_JIT)
def tree_pops_from_lists(top_logp, path_ranks, known_depth, max_nodes, out) -> None:
    """The same from whole top-K lists (computed on the device): top_logp [a, L, K] float32,
    path_ranks [a, L] int64 (-1: not in the top-K), known_depth [a]; out as tree_pops_batch."""
    A, L, K = top_logp.shape
    have = np.full(L, K, np.int64)
    scratch = np.empty((2, 2 * max_nodes + 2))
    prefix = np.empty((4, 2 * max_nodes + 2), np.int64)
    no_logits, no_lse = np.empty((L, 1), np.float32), np.empty(L, np.float32)
    for a in range(A):
        path_pops(
            no_logits,
            no_lse,
            path_ranks[a],
            known_depth[a],
            K,
            max_nodes,
            out[a],
            top_logp[a],
            have,
            path_ranks[a],
            scratch,
            prefix,
            False,
        )


def tree_pops(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, known: torch.Tensor, max_nodes: int):
    """ddtree.tree_pops_reference, compiled: logits [a, L, V], lse [a, L] = their logsumexp (as
    torch computes it), targets/known [a, L] -> [a, L] int64 on CPU. On CPU the lists are read
    lazily from the logits; on another device the top-K lists are selected there
    (ddtree.top_log_probs) and only they are copied. Releases the GIL while it runs."""
    out = np.full(tuple(targets.shape), NOT_IN_TREE, dtype=np.int64)
    known_depth = known.sum(dim=1).cpu().numpy()
    if logits.device.type == "cpu":
        logits = logits.float().contiguous()
        tree_pops_batch(logits.numpy(), lse.float().numpy(), targets.numpy(), known_depth, max_nodes, out)
    else:
        top_ids = top_k_ids(logits, max_nodes)
        top_logp = (logits.float().gather(-1, top_ids) - lse[..., None]).cpu().numpy()
        ranks = path_ranks(top_ids, targets.to(logits.device)).cpu().numpy()
        tree_pops_from_lists(top_logp, ranks, known_depth, max_nodes, out)
    return torch.from_numpy(out)
