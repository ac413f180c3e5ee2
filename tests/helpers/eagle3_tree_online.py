"""sglang's EAGLE dynamic tree, drafted and verified online, naively, from the reference's modules
(tests/parity/test_eagle3_parity.py and test_eagle1_parity.py compare specreplay's eagle-tree-*
results with it).

The drafter is speculators' `Eagle3DraftModel` (or the EAGLE repository's `Model`, through
tests/helpers/eagle1_online.py's own cache) driven as tests/helpers/eagle3_online.py drives it:
its cache holding slots 0..t - 1 written from the target's features, then one step per node. Every tree node keeps its own copy of the cache: the
context plus the steps of its ancestors, so a node's step (its token, the hidden state of the step
that proposed it, at the next position) attends to those alone, as a tree mask lets it.

The rule, from sglang's eagle_worker.py `draft_forward` and eagle_utils.py `select_top_k_tokens`
/ `organize_draft_results`, one node at a time: q = softmax of the step's logits over the draft
vocabulary, token ids mapped through d2t; depth 1 = the topk best tokens of step 1, score = q;
each following depth: every beam node (in beam order) runs its step, its topk best tokens become
children scored parent score x q (float32); the topk best children form the next beam. After
`depth` levels the best draft_tokens - 1 of all candidates (depth 1's, then each level's, in
order) are the tree. Verification descends from the root while a kept child holds the target's
greedy token. Ties: equal probabilities to the lower target id, equal scores to the earlier
candidate (specreplay documents the same rule; sglang's torch.topk leaves them open). Python
sorting, no top-k kernel, and nothing of specreplay's code.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from tests.helpers.dspark_online import commit, target_states
from tests.helpers.eagle3_online import DraftCache, OnlineRun, cache_for, states_for


@dataclass
class Node:
    token: int
    score: torch.Tensor  # float32 scalar: the path probability
    depth: int
    parent: Node | None
    cache: DraftCache  # the context and the steps of this node's ancestors
    hidden: torch.Tensor  # [1, H] the last hidden state of the step that proposed this node


def best(values: list[float], k: int) -> list[int]:
    """Indices of the k largest values, largest first, equal values to the lower index."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


def children_of(draft: DraftCache, h: torch.Tensor, topk: int) -> list[tuple[int, torch.Tensor]]:
    """(target id, q) of the topk best drafts after a step whose output is h [1, H]: softmax over
    the draft vocabulary (sglang's probs), ties to the lower target id."""
    q, ids = draft.draft_probs(h)  # [draft V]
    order = sorted(range(q.numel()), key=lambda d: (-float(q[d]), int(ids[d])))[:topk]
    return [(int(ids[d]), q[d]) for d in order]


@torch.no_grad()
def expand(node: Node, topk: int) -> list[Node]:
    """The node's step on a copy of its cache, and its topk children."""
    draft = copy.deepcopy(node.cache)
    h = draft.step(torch.tensor([node.token]), node.hidden)
    return [Node(t, node.score * q, node.depth + 1, node, draft, h) for t, q in children_of(draft, h, topk)]


@torch.no_grad()
def draft_tree(model, features: torch.Tensor, ids: torch.Tensor, anchor: int, topk, depth, draft_tokens) -> list[Node]:
    """The kept nodes of the tree at `anchor` of `ids` (x_anchor the last committed token), the
    drafter's slots 0..anchor - 1 written from `features` [>= anchor, n*H]."""
    return keep(beam_nodes(model, features, ids, anchor, topk, depth), draft_tokens)


@torch.no_grad()
def beam_nodes(model, features: torch.Tensor, ids: torch.Tensor, anchor: int, topk, depth) -> list[Node]:
    """Every candidate of the `depth`-level beam of `topk` at `anchor` (draft_tree), in sglang's order."""
    draft = cache_for(model)
    h = draft.slots(ids[1 : anchor + 1], features[:anchor])[-1:]
    beam = [Node(t, q, 1, None, draft, h) for t, q in children_of(draft, h, topk)]
    candidates = list(beam)
    for _ in range(depth - 1):
        level = [child for node in beam for child in expand(node, topk)]
        candidates += level
        beam = [level[i] for i in best([float(n.score) for n in level], topk)]
    return candidates


def keep(candidates: list[Node], draft_tokens: int) -> list[Node]:
    """The tree: the best draft_tokens - 1 candidates, in their order."""
    kept = best([float(n.score) for n in candidates], draft_tokens - 1)
    return [candidates[i] for i in sorted(kept)]


def descend(kept: list[Node], next_token) -> list[int]:
    """The accepted path: from the root, the kept child holding `next_token(path)` while there is one."""
    path, parent = [], None
    while True:
        wanted = next_token(path)
        child = next((n for n in kept if n.parent is parent and n.token == wanted), None)
        if child is None:
            return path
        path, parent = path + [wanted], child


@torch.no_grad()
def anchor_trees(model, target, ids: torch.Tensor, anchor: int, trees: list) -> tuple[list[int], dict]:
    """At `anchor` of the committed sequence `ids` (the target's greedy output, so its next tokens
    are the target's argmax; nothing is accepted past its end): the accepted depth of each tree
    (topk, depth, draft_tokens), and per topk every candidate's score by its token path (the
    deepest beam asked of that topk, drafted once: a shallower tree's candidates are its prefix)."""
    _, features, _ = states_for(model)(target, ids)
    stored = ids[anchor + 1 :].tolist()
    depths = {k: max(d for k2, d, _ in trees if k2 == k) for k, _, _ in trees}
    beams = {k: beam_nodes(model, features, ids, anchor, k, d) for k, d in depths.items()}
    alphas = [
        len(descend(keep(beams[k][: k + (d - 1) * k * k], n), lambda p: stored[len(p)] if len(p) < len(stored) else -1))
        for k, d, n in trees
    ]
    return alphas, {k: path_scores(nodes) for k, nodes in beams.items()}


def path_scores(nodes: list[Node]) -> dict[tuple[int, ...], float]:
    """Each candidate's token path from the root -> its score."""
    found = {}
    for node in nodes:
        path, at = [], node
        while at is not None:
            path.append(at.token)
            at = at.parent
        found[tuple(reversed(path))] = float(node.score)
    return found


def greedy_after(target, root: torch.Tensor, path: list[int]) -> int:
    """The target's argmax after the committed tokens `root` and the drafted `path`."""
    return int(target_states(target, torch.cat([root, torch.tensor(path, dtype=root.dtype)]))[0][-1].argmax())


@torch.no_grad()
def online_tree_walk(model, target, prompt: torch.Tensor, max_new_tokens: int, stop_ids, tree) -> OnlineRun:
    """The greedy online loop with `tree` = (topk, depth, draft_tokens) at every step: the target
    verifies node by node (its argmax after the committed tokens and the path so far); steps,
    budget and stop tokens as tests/helpers/eagle3_online.py (z-lab's dflash_generate)."""
    max_length = prompt.numel() + max_new_tokens
    states = states_for(model)
    logits, features, _ = states(target, prompt)
    seq = torch.cat([prompt, logits[-1].argmax().reshape(1)])
    run, start, stopped = OnlineRun(seq), prompt.numel(), int(seq[-1]) in stop_ids
    while start + 1 < max_length and not stopped:
        kept = draft_tree(model, features, seq, start, *tree)
        root = seq[: start + 1]
        argmax = functools.partial(greedy_after, target, root)
        path = descend(kept, argmax)
        candidate = torch.cat([root, torch.tensor(path, dtype=root.dtype)])
        new_tokens = torch.tensor(path + [argmax(path)], dtype=root.dtype)
        seq, features, produced, stopped = commit(
            seq, features, states(target, candidate)[1], start, new_tokens, max_length, stop_ids
        )
        start += produced
        run.produced.append(produced)
        run.accepted.append(len(path))
    run.output_ids = seq[: min(start + 1, max_length)]
    return run
