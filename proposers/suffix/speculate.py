"""A draft from one suffix tree, as Arctic Inference's SuffixTree::speculate makes a chain
(csrc/suffix_decoding/suffix_tree.cc:593-622, with _match_context :800-823 and _speculate_path
:825-853; `use_tree_spec` false, as vLLM calls it), cited `cc:` by line.

For each match length m = 1, 2, ... up to one less than the context's length (the whole context is
never matched, cc:600), the context's last m tokens are walked down from the root; the first m that
leaves the tree ends the search (cc:603-605). From where the walk ends the draft follows the first
child at each node (the most common continuation, ties by tree.py's order), each token carrying the
probability prob = product of count(child) / count(node) over the steps taken (1 along one edge),
until it holds min(max_spec_tokens, int(m * max_spec_factor + max_spec_offset + 1e-6)) tokens, the
tree ends, or prob falls below min_token_prob (cc:606-609, 831-851). Its score is the sum of its
tokens' probabilities; the best score wins, a later (longer) match on a tie (cc:616). Arctic computes
prob and score in float32 and the cap's product in float32 before adding 1e-6 in double: so does this.
"""

from __future__ import annotations

import numba
import numpy as np

from proposers.suffix.tree import COUNT, FIRST, LENGTH, NONE, ROOT, START, child_of

_jit = numba.njit(cache=True, nogil=True)
INT_LIMIT = 2147483648.0  # 2^31: a cap at or past it is out of C++ int's range


@_jit
def match(tree, ids, lo, hi):
    """(node, tokens of its edge matched) where the walk of ids[lo:hi] from the root ends; (NONE, 0)
    when it leaves the tree."""
    nodes, store = tree[0], tree[4]
    node, used = ROOT, 0
    for i in range(lo, hi):
        if used == nodes[node, LENGTH]:
            node = child_of(tree, node, ids[i])
            if node == NONE:
                return NONE, 0
            used = 0
        if store[nodes[node, START] + used] != ids[i]:
            return NONE, 0
        used += 1
    return node, used


@_jit
def follow(tree, node, used, limit, min_prob, out):
    """(tokens written to out, their score): the path on from `used` tokens into `node`'s edge."""
    nodes, store = tree[0], tree[4]
    prob, score, n = np.float32(1.0), np.float32(0.0), 0
    while n < limit and prob >= min_prob:
        if used < nodes[node, LENGTH]:
            out[n] = store[nodes[node, START] + used]
            score += prob
            used += 1
            n += 1
        else:
            child = nodes[node, FIRST]
            if child == NONE:
                break
            prob *= np.float32(nodes[child, COUNT]) / np.float32(nodes[node, COUNT])
            node, used = child, 0
    return n, score


@_jit
def draft_cap(m, k, factor):
    """min(k, int(m * factor + 0 + 1e-6)), at least 0, computed as Arctic does (cc:606-609); a cap
    past int's range is INT_MIN on x86 (the C++ conversion is undefined there), so no draft."""
    value = np.float64(np.float32(m) * factor) + 1e-6
    if not value < INT_LIMIT:
        return 0
    return max(min(k, int(value)), 0)


@_jit
def speculate(tree, ids, lo, hi, k, factor, min_prob, out, scratch):
    """(tokens written to out, their score): the tree's best draft after the context ids[lo:hi]."""
    best_n, best = 0, np.float32(0.0)
    for m in range(1, hi - lo):
        node, used = match(tree, ids, hi - m, hi)
        if node == NONE:
            break
        n, score = follow(tree, node, used, draft_cap(m, k, factor), min_prob, scratch)
        if score >= best:
            best_n, best = n, score
            out[:n] = scratch[:n]
    return best_n, best
