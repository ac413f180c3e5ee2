"""The suffix tree of Arctic Inference's suffix decoding, as arctic-inference 0.3.0 keeps it
(csrc/suffix_decoding/suffix_tree.h and suffix_tree.cc, cited `h:` and `cc:` by line), rule by rule;
our own implementation, in numba.

What it holds: for every sequence added and every start position in it, the suffix from there cut to
`depth` tokens (cc:310-314: at most `depth` suffixes of a sequence grow at once), path-compressed: a
node is a run of tokens with one count, the number of those suffixes that pass through or end in it
(h:30-31). speculate.py reads two things of it: count(child) / count(node) along a path, and which of
a node's children comes first.

Which child comes first decides the draft where counts tie, and Arctic keeps the order of children by
rules whose outcome depends on the history of the counts, not on the counts alone; so the rules are
replayed as they are, operation for operation:
  - children are kept in non-increasing count (h:56-58); a new child (count 1) goes last (cc:364-372);
  - a child whose count rises from c stays when it is first or the one before it has more than c + 1;
    else it moves in front of the first sibling with the count of the one before it (cc:188-228): to
    the front of the c + 1 run when the one before has c + 1, to the end of it when the one before
    has c;
  - a child whose count falls from c stays unless the one after it has c too; then it moves behind
    the last sibling with c (cc:230-291);
  - a node that takes another's place (a split, a merge) takes its place in the order (cc:161-186).
Runs of equal counts are groups that know their first and last member (h:66-69, 89-100), so that a
move finds its place at once, not by a walk along thousands of the root's children.

Storage: a tree is the tuple (nodes, groups, meta, children, store, ring): node rows and group rows
of int64 fields, counters, a typed dict from (node, first token) to the child, the token store whose
runs are the nodes' edges, and the nodes at which the growing sequence's last `depth` suffixes end.
Every token added stays in the store: Arctic re-points a node whose reference sequence is removed
(cc:561-587); a store that never drops a token needs no re-pointing, and a node's edge stays where it
was. A tree over n suffixes has at most 2n + 1 nodes (each node other than the root ends a suffix or
branches, cc:700-709) and at most as many groups: the caller (cache.py) sizes the arrays to that.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types

# node fields: parent, first token of its edge, the edge's start in the store and length, count,
# first and last child, next and previous sibling, group
PARENT, TOKEN, START, LENGTH, COUNT, FIRST, LAST, NEXT, PREV, GROUP = range(10)
NODE_FIELDS = 10
G_FIRST, G_LAST = 0, 1  # group fields: its first and last member
# meta: node rows ever used, the free node list (chained through NEXT), likewise for groups (through
# G_FIRST), the ring's oldest slot and size
M_NODES, M_FREE, M_GROUPS, M_GROUP_FREE, M_RING, M_ACTIVE = range(6)
ROOT, NONE = 0, -1
KEY = 1 << 31  # a child's key: its parent * KEY + its first token (token ids are below 2^31)


def new_tree(capacity: int, store: np.ndarray, depth: int) -> tuple:
    """An empty tree of `depth` over `store` (int64 tokens) with room for `capacity` nodes."""
    nodes = np.full((capacity, NODE_FIELDS), NONE, dtype=np.int64)
    nodes[ROOT, START] = nodes[ROOT, LENGTH] = nodes[ROOT, COUNT] = 0
    groups = np.full((capacity, 2), NONE, dtype=np.int64)
    meta = np.array([1, NONE, 0, NONE, 0, 0], dtype=np.int64)
    children = numba.typed.Dict.empty(types.int64, types.int64)
    return nodes, groups, meta, children, store, np.zeros(depth, dtype=np.int64)


def with_room(tree: tuple, capacity: int, store_size: int) -> tuple:
    """`tree` with room for `capacity` nodes and a store of `store_size` tokens (arrays copied when
    they grow; the numba functions take the tree as this tuple)."""
    nodes, groups, meta, children, store, ring = tree
    if nodes.shape[0] < capacity:
        rows = max(capacity, 2 * nodes.shape[0])
        nodes = np.concatenate([nodes, np.full((rows - nodes.shape[0], NODE_FIELDS), NONE, dtype=np.int64)])
        groups = np.concatenate([groups, np.full((rows - groups.shape[0], 2), NONE, dtype=np.int64)])
    if store.shape[0] < store_size:
        store = np.concatenate([store, np.zeros(max(store_size, 2 * store.shape[0]) - store.shape[0], np.int64)])
    return nodes, groups, meta, children, store, ring


# ------------------------------------------------------------------------------------ rows and keys

_jit = numba.njit(cache=True, nogil=True)


@_jit
def child_of(tree, node, token):
    """The child of `node` whose edge starts with `token`, NONE when it has none."""
    key = node * KEY + token
    if key in tree[3]:  # (dict.get types as an optional in numba)
        return tree[3][key]
    return NONE


@_jit
def adopt(tree, node, child):
    tree[3][node * KEY + tree[0][child, TOKEN]] = child


@_jit
def disown(tree, node, token):
    tree[3].pop(node * KEY + token)


@_jit
def new_node(tree, parent, token, start, length, count):
    nodes, meta = tree[0], tree[2]
    node = meta[M_FREE]
    if node != NONE:
        meta[M_FREE] = nodes[node, NEXT]
    else:
        node = meta[M_NODES]
        if node >= nodes.shape[0]:
            raise RuntimeError("suffix tree: out of node rows (cache.py sizes them)")
        meta[M_NODES] = node + 1
    nodes[node, :] = NONE
    nodes[node, PARENT], nodes[node, TOKEN], nodes[node, START] = parent, token, start
    nodes[node, LENGTH], nodes[node, COUNT] = length, count
    return node


@_jit
def free_node(tree, node):
    nodes, meta = tree[0], tree[2]
    nodes[node, :] = NONE
    nodes[node, NEXT], meta[M_FREE] = meta[M_FREE], node


@_jit
def _new_group(tree, node):
    groups, meta = tree[1], tree[2]
    group = meta[M_GROUP_FREE]
    if group != NONE:
        meta[M_GROUP_FREE] = groups[group, G_FIRST]
    else:
        group = meta[M_GROUPS]
        if group >= groups.shape[0]:  # runs are never more than nodes
            raise RuntimeError("suffix tree: out of group rows (cache.py sizes them)")
        meta[M_GROUPS] = group + 1
    groups[group, G_FIRST] = groups[group, G_LAST] = node
    return group


# ------------------------------------------------------------------------------------ the order of children


@_jit
def leave_group(tree, node):
    """`node` leaves its run of equal counts (only ever from an end of it, or with it out of the list)."""
    nodes, groups, meta = tree[0], tree[1], tree[2]
    group = nodes[node, GROUP]
    first, last = groups[group, G_FIRST], groups[group, G_LAST]
    if first == node and last == node:  # it was the whole run: the group goes
        groups[group, G_FIRST], meta[M_GROUP_FREE] = meta[M_GROUP_FREE], group
        groups[group, G_LAST] = NONE
    elif first == node:
        groups[group, G_FIRST] = nodes[node, NEXT]
    elif last == node:
        groups[group, G_LAST] = nodes[node, PREV]
    nodes[node, GROUP] = NONE


@_jit
def _join_group(tree, node):
    """`node`, in its place, joins the run of a neighbour with its count, or starts its own (cc:86-112)."""
    nodes, groups = tree[0], tree[1]
    before, after, count = nodes[node, PREV], nodes[node, NEXT], nodes[node, COUNT]
    if before != NONE and nodes[before, COUNT] == count:
        group = nodes[before, GROUP]
        if groups[group, G_LAST] == before:
            groups[group, G_LAST] = node
    elif after != NONE and nodes[after, COUNT] == count:
        group = nodes[after, GROUP]
        if groups[group, G_FIRST] == after:
            groups[group, G_FIRST] = node
    else:
        group = _new_group(tree, node)
    nodes[node, GROUP] = group


@_jit
def unlink(tree, node):
    nodes = tree[0]
    parent, before, after = nodes[node, PARENT], nodes[node, PREV], nodes[node, NEXT]
    if before == NONE:
        nodes[parent, FIRST] = after
    else:
        nodes[before, NEXT] = after
    if after == NONE:
        nodes[parent, LAST] = before
    else:
        nodes[after, PREV] = before
    nodes[node, PREV] = nodes[node, NEXT] = NONE


@_jit
def link(tree, node, before, after):
    """`node` between siblings `before` and `after` (NONE: that end of its parent's children), then
    in the run its count makes."""
    nodes = tree[0]
    parent = nodes[node, PARENT]
    nodes[node, PREV], nodes[node, NEXT] = before, after
    if before == NONE:
        nodes[parent, FIRST] = node
    else:
        nodes[before, NEXT] = node
    if after == NONE:
        nodes[parent, LAST] = node
    else:
        nodes[after, PREV] = node
    _join_group(tree, node)


@_jit
def _recount_in_place(tree, node, count):
    leave_group(tree, node)
    tree[0][node, COUNT] = count
    _join_group(tree, node)


@_jit
def increment(tree, node):
    """count + 1, moved as cc:188-228 moves it (module docstring)."""
    nodes, groups = tree[0], tree[1]
    count, before = nodes[node, COUNT], nodes[node, PREV]
    if node == ROOT:
        nodes[node, COUNT] = count + 1
    elif before == NONE or nodes[before, COUNT] > count + 1:
        _recount_in_place(tree, node, count + 1)
    else:  # in front of the first sibling with the count of the one before it
        ahead = groups[nodes[before, GROUP], G_FIRST]
        leave_group(tree, node)
        unlink(tree, node)
        nodes[node, COUNT] = count + 1
        link(tree, node, nodes[ahead, PREV], ahead)


@_jit
def decrement(tree, node):
    """count - 1, moved as cc:230-291 moves it: behind the last of its run when the next has its count."""
    nodes, groups = tree[0], tree[1]
    count, after = nodes[node, COUNT], nodes[node, NEXT]
    if node == ROOT:
        nodes[node, COUNT] = count - 1
    elif after == NONE or nodes[after, COUNT] < count:
        _recount_in_place(tree, node, count - 1)
    else:
        last = groups[nodes[node, GROUP], G_LAST]
        leave_group(tree, node)
        unlink(tree, node)
        nodes[node, COUNT] = count - 1
        link(tree, node, last, nodes[last, NEXT])


@_jit
def take_place(tree, old, new):
    """`new` (out of any list) takes `old`'s place among old's siblings, and its run (cc:161-186)."""
    nodes, groups = tree[0], tree[1]
    parent, before, after, group = nodes[old, PARENT], nodes[old, PREV], nodes[old, NEXT], nodes[old, GROUP]
    nodes[new, PREV], nodes[new, NEXT], nodes[new, GROUP] = before, after, group
    if before == NONE:
        nodes[parent, FIRST] = new
    else:
        nodes[before, NEXT] = new
    if after == NONE:
        nodes[parent, LAST] = new
    else:
        nodes[after, PREV] = new
    if groups[group, G_FIRST] == old:
        groups[group, G_FIRST] = new
    if groups[group, G_LAST] == old:
        groups[group, G_LAST] = new
    nodes[old, PREV] = nodes[old, NEXT] = nodes[old, GROUP] = NONE
