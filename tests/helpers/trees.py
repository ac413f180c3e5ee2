"""The DDTree oracle: the most probable prefixes by enumeration."""

from __future__ import annotations

import torch


def brute_force_tree(log_q: torch.Tensor, budget: int, *, prune: bool = True) -> set[tuple[int, ...]]:
    """The `budget` most probable prefixes (depth 1..L) under independent per-depth log-probs
    log_q [L, V], by enumerating and sorting prefixes.

    prune=False enumerates all V + V^2 + ... + V^L prefixes (tiny L and V only): the oracle with
    no argument to trust. prune=True enumerates only each depth's top-`budget` tokens and keeps the
    `budget` best prefixes of each depth as the next depth's parents, which is exact: a prefix
    holding a rank >= budget token is beaten by `budget` siblings, and a prefix outside its depth's
    best `budget` is beaten by those (tests/scoring/replay/test_ddtree.py checks the two agree); it
    makes the vocab of a real target tractable (tests/helpers/online_reference.py)."""
    depths, vocab = log_q.shape
    k = min(budget, vocab) if prune else vocab
    top = torch.topk(log_q.float(), k, dim=-1)
    scored, frontier = [], [((), 0.0)]
    for depth in range(depths):
        children = [
            (prefix + (int(top.indices[depth, r]),), score + float(top.values[depth, r]))
            for prefix, score in frontier
            for r in range(k)
        ]
        children.sort(key=lambda item: -item[1])
        if prune:
            children = children[:budget]
        scored += children
        frontier = children
    scored.sort(key=lambda item: -item[1])
    return {prefix for prefix, _ in scored[:budget]}
