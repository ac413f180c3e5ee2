"""The compiled DDTree (scoring/methods/ddtree_kernels.py) equals the Python definition (scoring/methods/ddtree_heap.py):
the top-K selection token for token (ties by lower id, as a stable sort), and the pop index of
every target-path prefix, on random anchors with forced ties and near-ties.

Anchors per kind: SPECREPLAY_DDTREE_ANCHORS (default sized for CI; `make bench` section ddtree
runs 100k)."""

import os

import numpy as np
import pytest
import torch

from bench.standins import tree_cases
from scoring.methods.ddtree_heap import NOT_IN_TREE, path_ranks, top_k_ids, top_log_probs, tree_pops_reference
from scoring.methods.ddtree_kernels import target_rank, top_k_row, tree_pops, tree_pops_from_lists

ANCHORS = int(os.environ.get("SPECREPLAY_DDTREE_ANCHORS", "1500"))


def stable_order(row: torch.Tensor) -> torch.Tensor:
    """Token ids by logit, largest first, equal logits by lower id: a stable sort."""
    return torch.sort(row + 0.0, descending=True, stable=True).indices


@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 500, 4096])
@pytest.mark.parametrize("kind", ["plain", "ties", "signed-zero", "inner-ties", "mixed"])
def test_top_k_is_a_stable_sort(vocab, kind):
    """top_k_ids (topk of k + 1 re-sorted, the tied rows by keys) is the stable sort's first k on
    rows that take its quick path (plain), its fallback (ties at the k-th: ties, signed-zero),
    ties inside the top k only (inner-ties), and both in one batch (mixed)."""
    g = torch.Generator().manual_seed(vocab)
    rows = torch.randn(20, vocab, generator=g) * 2
    if kind == "ties":
        rows = rows.round()
    if kind == "signed-zero":  # -0.0 ties 0.0 (as the stable sort sees them)
        rows = torch.where(rows > 0, torch.tensor(0.0), torch.tensor(-0.0))
    if kind == "inner-ties":  # the two largest equal, at ids in either order
        rows[:, -1] = rows[:, 0] = rows.max() + 1
    if kind == "mixed":
        rows[::2] = rows[::2].round()
    for k in sorted({1, min(2, vocab), min(5, vocab), min(17, vocab), vocab}):
        expected = stable_order(rows)[:, :k]
        assert torch.equal(top_k_ids(rows, k), expected)
        for row, ids in zip(rows, expected):
            values, got = np.empty(k, np.float32), np.empty(k, np.int64)
            top_k_row(row.numpy(), k, values, got)
            assert np.array_equal(got, ids.numpy()), (k, row)
            assert np.array_equal(values, (row[ids] + 0.0).numpy())


def test_target_rank_counts_the_stable_order():
    row = torch.tensor([1.0, 3.0, 1.0, 2.0, 3.0, -0.0, 0.0])
    order = stable_order(row).tolist()
    for token in range(row.numel()):
        assert target_rank(row.numpy(), token, 7) == order.index(token)
        assert target_rank(row.numpy(), token, 3) == (order.index(token) if order.index(token) < 3 else -1)


@pytest.mark.parametrize("kind", ["plain", "ties", "near"])
@pytest.mark.parametrize(
    "depth,vocab,max_nodes",
    [(15, 300, 256), (15, 64, 1024), (7, 50, 64), (3, 8, 1024), (15, 2000, 1024), (4, 30, 1), (5, 40, 2)],
)
def test_compiled_pops_equal_the_definition(kind, depth, vocab, max_nodes):
    anchors = max(8, ANCHORS * 64 // (max_nodes + 64))  # fewer anchors where the Python heap is slow
    logits, targets, known = tree_cases(hash((kind, depth, vocab, max_nodes)) % 1000, anchors, depth, vocab, kind)
    expected = tree_pops_reference(logits, targets, known, max_nodes)
    found = tree_pops(logits, torch.logsumexp(logits, dim=-1), targets, known, max_nodes)
    assert torch.equal(found, expected)
    # the prefixes really are in trees of several budgets, and some are not: the test can fail
    assert (expected < NOT_IN_TREE).any() and (expected == NOT_IN_TREE).any()
    # from whole top-K lists (the path taken when the logits are on a GPU)
    top_logp, top_ids = top_log_probs(logits, max_nodes)
    out = np.full(tuple(targets.shape), NOT_IN_TREE, dtype=np.int64)
    ranks = path_ranks(top_ids, targets).numpy()
    tree_pops_from_lists(top_logp.numpy(), ranks, known.sum(1).numpy(), max_nodes, out)
    assert np.array_equal(out, expected.numpy())


def test_ties_are_decided_by_rank_tuple():
    """Two depths with equal log-probs everywhere: every sibling ties its neighbours, so the pop
    order is decided by rank tuples alone; a wrong tie-break moves the path's pop index."""
    logits = torch.zeros(1, 3, 6)
    known = torch.ones(1, 3, dtype=torch.bool)
    for path in ([0, 0, 0], [2, 1, 0], [5, 5, 5], [1, 0, 3]):
        targets = torch.tensor([path])
        expected = tree_pops_reference(logits, targets, known, 64)
        assert torch.equal(tree_pops(logits, torch.logsumexp(logits, -1), targets, known, 64), expected)
    # path [1, 0, 3]: (0,) pops first, then (1,) (a depth-1 sibling outweighs every depth-2 node)
    assert expected[0, 0] == 1
