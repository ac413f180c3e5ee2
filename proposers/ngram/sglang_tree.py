"""SGLang's n-gram draft tree (SGLang 0.5.23, sglang/kernels/jit/csrc/ngram_corpus/: trie.cpp
buildRecency / buildFrequency, result.cpp fillResult), built from the matches Trie.match returns (the
longest suffix first), and its greedy verification (kernels/jit/include/sgl_kernel/speculative/eagle.cuh
VerifyTreeGreedy over the links ngram.cuh reconstructIndicesFromTreeMask derives).

The tree holds at most `budget` = speculative_num_draft_tokens - 1 nodes below the root (the request's
last token): ngram.cpp:171 asks Param::get_draft_token_num, which is draft_token_num - 1 (param.h:30-38).
A node's children are distinct tokens (`Draft.children[pos]`: token -> node); a token met again under
the same parent from another match reuses its node (trie.cpp:253-257, 319-325).

- BFS (match type "BFS", trie.cpp:220-264): per match, a breadth-first walk of the trie below it, taking
  at each trie node its first `breadth` children by recency; the breadth starts at
  (max_trie_depth - 1 - d) * scale + min_bfs_breadth for a match of d tokens, scale =
  (max - min breadth) / (max_trie_depth - 1), and drops by scale per level (at least 1).
- PROB (trie.cpp:266-331): a max-heap of candidates by path probability, each trie node's top
  max_bfs_breadth children by frequency with freq / (their freq sum) * parent's probability. Ties pop
  in the order std::priority_queue leaves them: `CppMaxHeap` is libstdc++'s push_heap / pop_heap.

fillResult (result.cpp:12-51) lays the nodes out breadth first and pads to speculative_num_draft_tokens
tokens with token 0, each padding node a child of the root with no children (prevs 0, result.cpp:34-38).
Verification (eagle.cuh:214-254) walks from the root, at each level trying the node's children in
layout order (first child, then next siblings: ngram.cuh:26-90) and taking the first whose token is the
target's; the real nodes come before the padding, so padding is taken only at the root, and only when
the target's token is 0 and no real child of the root is 0.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from proposers.ngram.sglang_trie import TrieNode

PAD = 0  # result.cpp:34-38


@dataclass
class Draft:
    """A tree as fillResult receives it: children[pos] maps a token to its node (0: the root)."""

    children: list[dict[int, int]]
    padding: int  # token-0 children of the root fillResult adds

    @property
    def size(self) -> int:
        return sum(len(c) for c in self.children)


def build_bfs(anchors, budget: int, max_trie_depth: int, min_breadth: int, max_breadth: int) -> Draft:
    """trie.cpp:220-264 (buildRecency)."""
    deepest = max(1, max_trie_depth - 1)
    scale = float(max_breadth - min_breadth) / deepest
    tree: list[dict[int, int]] = [{} for _ in range(budget + 1)]
    cursor = 1
    for node, depth in anchors:
        queue = deque([(0, (deepest - depth) * scale + min_breadth, node)])
        while queue and cursor <= budget:
            parent, breadth_now, trie_node = queue.popleft()
            breadth = max(1, int(breadth_now))  # int32_t(cur_breadth): toward zero
            for i, child in enumerate(trie_node.by_recency()):
                if i >= breadth or cursor > budget:
                    break
                pos = tree[parent].get(child.token)
                if pos is None:
                    pos = tree[parent][child.token] = cursor
                    cursor += 1
                queue.append((pos, breadth_now - scale, child))
    return Draft(tree, budget - (cursor - 1))


class CppMaxHeap:
    """std::priority_queue over a vector with `less` on the probability (trie.cpp:275-287): libstdc++'s
    push_heap (__push_heap) and pop_heap (__pop_heap, __adjust_heap), so equal probabilities pop in
    the same order as SGLang's."""

    def __init__(self):
        self.items: list[tuple[int, TrieNode, float]] = []

    def __len__(self) -> int:
        return len(self.items)

    def _up(self, hole: int, top: int, value) -> None:
        items = self.items
        parent = (hole - 1) // 2
        while hole > top and items[parent][2] < value[2]:
            items[hole] = items[parent]
            hole = parent
            parent = (hole - 1) // 2
        items[hole] = value

    def push(self, value) -> None:
        self.items.append(value)
        self._up(len(self.items) - 1, 0, value)

    def pop(self):
        items = self.items
        top, last = items[0], len(items) - 1
        if last > 0:
            value, items[last] = items[last], items[0]
            self._adjust(0, last, value)
        items.pop()
        return top

    def _adjust(self, hole: int, length: int, value) -> None:
        items, top, second = self.items, hole, hole
        while second < (length - 1) // 2:
            second = 2 * (second + 1)
            if items[second][2] < items[second - 1][2]:
                second -= 1
            items[hole] = items[second]
            hole = second
        if length % 2 == 0 and second == (length - 2) // 2:
            second = 2 * (second + 1)
            items[hole] = items[second - 1]
            hole = second - 1
        self._up(hole, top, value)


def build_prob(anchors, budget: int, max_breadth: int) -> Draft:
    """trie.cpp:266-331 (buildFrequency)."""
    heap, tree = CppMaxHeap(), [{} for _ in range(budget + 1)]
    cursor = 1

    def add(parent: int, trie_node: TrieNode, prob: float) -> None:  # addToHeap, trie.cpp:295-309
        top = trie_node.by_frequency(max_breadth)
        total = float(sum(child.freq for child in top))
        total = total if total > 0 else 1.0
        for child in top:
            heap.push((parent, child, float(child.freq) / total * prob))

    for node, _ in anchors:
        add(0, node, 1.0)
        while heap and cursor <= budget:
            parent, trie_node, prob = heap.pop()
            pos = tree[parent].get(trie_node.token)
            if pos is None:
                pos = tree[parent][trie_node.token] = cursor
                cursor += 1
            add(pos, trie_node, prob)
    return Draft(tree, budget - (cursor - 1))


def verified_path(draft: Draft, targets: list[int]) -> tuple[list[int], bool]:
    """(the drafts verification accepts when the target's greedy tokens are `targets`, whether the
    last accepted node, or the root, has a child left to try past them): eagle.cuh:234-252."""
    pos, path = 0, []
    for token in targets:
        nxt = draft.children[pos].get(token)
        if nxt is None:
            if pos == 0 and not path and token == PAD and draft.padding:  # a padding node: no children
                return [PAD], False
            break
        path.append(token)
        pos = nxt
    return path, bool(draft.children[pos]) or (pos == 0 and draft.padding > 0)


def rejected_child(draft: Draft, path: list[int]) -> int:
    """A child of the path's last node, a draft verification tries and (given the target's next token
    is none of them) rejects: the first one built, or the root's padding."""
    pos = 0
    for token in path:
        pos = draft.children[pos][token]
    return next(iter(draft.children[pos]), PAD)
