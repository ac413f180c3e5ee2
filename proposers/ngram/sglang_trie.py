"""SGLang's n-gram corpus (SGLang 0.5.23 `--speculative-algorithm NGRAM`): the trie of token sequences
and the per-request match state, read line by line from sglang/kernels/jit/csrc/ngram_corpus/trie.h and
trie.cpp (cited below as trie.h:LINE, trie.cpp:LINE).

- A node per distinct sequence, at most `max_trie_depth` tokens deep, `capacity` nodes counting the root
  (trie.cpp:14-21). Each node counts how often its sequence was inserted (`freq`) and orders its
  children by recency (`lru`, the latest inserted or touched first) and by frequency (`sorted_children`:
  higher freq first, then the smaller token, trie.h:33-38).
- insert(seq) (trie.cpp:23-67): every suffix seq[i:] cut to max_trie_depth tokens, walked from the
  root: a new node gets freq 1, an existing one freq + 1; each is moved to the front of its parent's
  recency list, then the walked path to the front of the global LRU (the shallowest first). Before a
  suffix of L tokens, when fewer than L nodes are free, the least recently used nodes are evicted
  (squeeze, trie.cpp:69-93): leaves, as a parent is always used after its children.
- A request's MatchState (trie.h:49-56) caches, for d = 1..max_trie_depth, the node of its context's
  last d tokens (None: not in the trie), advanced by the tokens appended since the last match instead of
  looked up afresh while it is still valid (trie.cpp:152-218). Advancing keeps a None where the trie has
  since gained the sequence, so the cache is part of the rule (a fresh lookup can find more).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


class TrieNode:
    """trie.h:19-39; `children` in recency order, the most recent LAST (SGLang's `lru` begins with it)."""

    __slots__ = ("token", "parent", "children", "freq", "version")

    def __init__(self, token: int, parent: TrieNode | None):
        self.token, self.parent = token, parent
        self.children: dict[int, TrieNode] = {}
        self.freq = 0
        self.version = 1  # bumped when evicted: a cached reference to it no longer resolves (trie.h:27-31)

    def by_recency(self):
        """The children as SGLang's `lru` list runs: the latest inserted or touched first."""
        return reversed(self.children.values())

    def by_frequency(self, count: int) -> list[TrieNode]:
        """The first `count` of `sorted_children` (trie.h:33-38): higher freq first, then the smaller token."""
        return sorted(self.children.values(), key=lambda c: (-c.freq, c.token))[:count]


Ref = tuple  # (node, its version when captured): trie.h:44-47 NodeRef


@dataclass
class MatchState:
    """trie.h:52-56: one request's cached suffix matches; anchors[d - 1] is its last d tokens' node."""

    epoch: int = 0
    processed_total_len: int = 0
    anchors: list[Ref | None] = field(default_factory=list)


class Trie:
    def __init__(self, capacity: int, max_trie_depth: int):
        self.capacity, self.depth = capacity, max_trie_depth
        self.root = TrieNode(-1, None)
        self.free = capacity - 1  # the root takes one node of the pool (trie.cpp:20)
        self.lru: OrderedDict[TrieNode, None] = OrderedDict()  # global_lru_, the front LAST
        self.epoch = 1  # trie.h:141

    # ------------------------------------------------------------------------------------- insert

    def insert(self, tokens: list[int]) -> None:
        """trie.cpp:23-67."""
        for i in range(len(tokens)):
            length = min(len(tokens) - i, self.depth)
            if length > self.free:
                self.squeeze(length - self.free)
            cursor, path = self.root, []
            for token in tokens[i : i + length]:
                node = cursor.children.pop(token, None)
                if node is None:  # a new node: freq 1 (trie.cpp:37-49)
                    node, self.free = TrieNode(token, cursor), self.free - 1
                node.freq += 1
                cursor.children[token] = node  # to the front of the parent's lru (trie.cpp:41, 55)
                path.append(node)
                cursor = node
            for node in reversed(path):  # the shallowest ends in front (trie.cpp:62-65)
                self.lru[node] = None
                self.lru.move_to_end(node)

    def squeeze(self, count: int) -> None:
        """trie.cpp:69-93: the `count` least recently used nodes back to the pool."""
        if self.capacity < self.free + count:
            raise RuntimeError("Insufficient node size to release required nodes.")
        for _ in range(count):
            last, _ = self.lru.popitem(last=False)
            if last.children:
                raise RuntimeError("The node to be released still has child nodes and cannot be released.")
            del last.parent.children[last.token]
            last.version += 1
            self.free += 1

    # -------------------------------------------------------------------------------------- match

    def resolve(self, state: MatchState, ref: Ref | None) -> TrieNode | None:
        """trie.cpp:109-114."""
        if ref is None or state.epoch != self.epoch or ref[0].version != ref[1]:
            return None
        return ref[0]

    def match(self, context: list[int], state: MatchState, total_len: int) -> list[tuple[TrieNode, int]]:
        """trie.cpp:204-218: (node, suffix length) of the context's suffixes in the trie that have
        children, the longest first; `context` is the request's last tokens, `total_len` its length."""
        progress = total_len >= state.processed_total_len
        appended = total_len - state.processed_total_len if progress else 0
        expected_depth = min(state.processed_total_len, self.depth)
        can_advance = (
            state.epoch == self.epoch and progress and appended <= len(context) and len(state.anchors) == expected_depth
        )
        if not (can_advance and self._advance(state, context[len(context) - appended :], total_len)):
            self._rebuild(context, state, total_len)
        return self._expandable(state)

    def _rebuild(self, context: list[int], state: MatchState, total_len: int) -> None:
        """trie.cpp:128-150: every suffix of up to max_trie_depth tokens looked up from the root."""
        state.epoch, state.processed_total_len = self.epoch, total_len
        state.anchors = [None] * min(len(context), self.depth)
        for depth in range(1, len(state.anchors) + 1):
            cursor = self.root
            for token in context[len(context) - depth :]:
                cursor = cursor.children.get(token)
                if cursor is None:
                    break
            if cursor is not None:
                state.anchors[depth - 1] = (cursor, cursor.version)

    def _valid(self, state: MatchState) -> bool:
        """trie.cpp:116-126."""
        if state.epoch != self.epoch:
            return False
        return all(ref is None or self.resolve(state, ref) is not None for ref in state.anchors)

    def _advance(self, state: MatchState, appended: list[int], total_len: int) -> bool:
        """trie.cpp:152-190: each appended token extends the cached matches by one."""
        if not self._valid(state):
            return False
        for token in appended:
            nxt: list[Ref | None] = [None] * min(len(state.anchors) + 1, self.depth)
            child = self.root.children.get(token)
            nxt[0] = None if child is None else (child, child.version)
            for depth in range(1, len(nxt)):
                ref = state.anchors[depth - 1]
                if ref is None:
                    continue
                node = self.resolve(state, ref)
                if node is None:
                    return False
                child = node.children.get(token)
                if child is not None:
                    nxt[depth] = (child, child.version)
            state.anchors = nxt
        state.processed_total_len = total_len
        return True

    def _expandable(self, state: MatchState) -> list[tuple[TrieNode, int]]:
        """trie.cpp:192-202: the cached matches that have children, the longest first."""
        found = []
        for depth in range(len(state.anchors), 0, -1):
            node = self.resolve(state, state.anchors[depth - 1])
            if node is not None and node.children:
                found.append((node, depth))
        return found
