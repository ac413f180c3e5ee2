"""DDTree: the best-first tree equals brute force, and pop indices give the right depth per budget."""

import math

import numpy as np
import pytest
import torch

from scoring.methods.ddtree_heap import best_first, path_pop_indices, top_log_probs
from scoring.replay.metrics import tree_accepted
from tests.helpers.trees import brute_force_tree


def build_tree(top_logp: np.ndarray, top_ids: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """The first `budget` nodes of the product's best-first order, as token-id prefixes."""
    nodes = []
    for ranks in best_first(top_logp, min(top_logp.shape[1], budget)):
        if len(nodes) == budget:
            break
        nodes.append(tuple(int(top_ids[d, r]) for d, r in enumerate(ranks)))
    return nodes


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 3, 4, 8, 17, 40])
def test_tree_equals_brute_force(seed, budget):
    torch.manual_seed(seed)
    L, V = 3, 5
    logits = torch.randn(L, V) * 2
    top_logp, top_ids = top_log_probs(logits, min(budget, V))
    tree = build_tree(top_logp.numpy(), top_ids.numpy(), budget)
    log_q = torch.log_softmax(logits, -1)
    expected = brute_force_tree(log_q, budget, prune=False)  # all 155 prefixes enumerated
    assert len(tree) == min(budget, len(expected))
    assert set(tree) == expected
    # the pruned enumeration online_reference.py relies on (vocab 512) finds the same tree
    assert brute_force_tree(log_q, budget) == expected
    # prefix-closed, parents first
    seen = set()
    for node in tree:
        assert node[:-1] in seen or len(node) == 1
        seen.add(node)


@pytest.mark.parametrize("seed", range(10))
def test_pop_indices_give_deepest_path_node_for_every_budget(seed):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    L, V, max_budget = 4, 6, 32
    logits = torch.randn(L, V) * 1.5
    top_logp, top_ids = top_log_probs(logits, max_budget)
    # a target path that follows likely tokens for a while, then something random
    path = [int(top_ids[d, rng.integers(0, 3)]) for d in range(L)]
    ranks = np.array([int((top_ids[d] == path[d]).nonzero()[0]) for d in range(L)])
    pops = path_pop_indices(top_logp.numpy(), ranks, max_budget)
    for budget in range(1, max_budget + 1):
        small_logp, small_ids = top_log_probs(logits, min(budget, V))
        tree = set(build_tree(small_logp.numpy(), small_ids.numpy(), budget))
        alpha = 0
        while alpha < L and tuple(path[: alpha + 1]) in tree:
            alpha += 1
        assert int(tree_accepted(torch.from_numpy(pops)[None], budget)[0]) == alpha, (budget, pops)


def test_absent_token_and_budget_limits():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    top_logp, top_ids = top_log_probs(logits, 2)
    # rank -1: the first target token is not among the top-2, so nothing is accepted
    pops = path_pop_indices(top_logp.numpy(), np.array([-1, 0]), 2)
    assert int(tree_accepted(torch.from_numpy(pops)[None], 2)[0]) == 0
    # the top-1 chain of depth 2 is found at pop indices 0 and 1 (q_1 top, then q_2 top beats sibling)
    pops = path_pop_indices(top_logp.numpy(), np.array([0, 0]), 2)
    p1 = math.exp(float(top_logp[0, 1]))
    p2 = math.exp(float(top_logp[0, 0] + top_logp[1, 0]))
    assert pops[0] == 0
    assert (pops[1] == 1) == (p2 > p1)
