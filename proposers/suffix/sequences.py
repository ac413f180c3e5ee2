"""Adding a token to the suffix tree's growing sequence, and removing a whole sequence, as Arctic
Inference's SuffixTree::append and SuffixTree::remove do (csrc/suffix_decoding/suffix_tree.cc, cited
`cc:` by line; tree.py has the storage and the order of children these edit).

Adding token x at store position p (cc:293-504): a new suffix starts at the root, the oldest of the
`depth` growing ones is dropped once it holds `depth` tokens (cc:306-314), and each growing suffix,
oldest first (cc:318-319), gains x where it ends, at node v:
  1. v has no child for x: a leaf v reached by this suffix alone (count 1) runs on by one token
     (cc:332-340); else a new leaf, count 1, last among v's children (cc:341-376);
  2. v has a child c for x with count(v) = count(c) + 1 (v not the root): all other suffixes through v
     go on into c, its only child, so this one follows them: c of one token absorbs v (cc:384-411),
     a longer c gives its first token to v (cc:412-438);
  3. otherwise the suffix steps into c, counted (cc:442-454), c first split after its first token
     when it is longer (cc:455-501).
Removing a sequence (cc:513-591): for each start, oldest first, its suffix's path loses one count
per node (a node left with none goes: it is a leaf), and the last node reached merges with its only
child when their counts became equal.
"""

from __future__ import annotations

import numba

from proposers.suffix.tree import (
    COUNT,
    FIRST,
    LAST,
    LENGTH,
    M_ACTIVE,
    M_RING,
    NONE,
    PARENT,
    ROOT,
    START,
    TOKEN,
    adopt,
    child_of,
    decrement,
    disown,
    free_node,
    increment,
    leave_group,
    link,
    new_node,
    take_place,
    unlink,
)

_jit = numba.njit(cache=True, nogil=True)


@_jit
def append(tree, pos):
    """The token at store position `pos` added to the growing sequence (whose earlier tokens are the
    store's positions before it)."""
    nodes, meta, ring = tree[0], tree[2], tree[5]
    depth, oldest, active = ring.shape[0], meta[M_RING], meta[M_ACTIVE]
    ring[(oldest + active) % depth] = ROOT  # the suffix starting here (cc:306-309)
    if active == depth:  # the oldest suffix already holds `depth` tokens: it stops growing (cc:311-314)
        oldest = (oldest + 1) % depth
    else:
        active += 1
    meta[M_RING], meta[M_ACTIVE] = oldest, active
    nodes[ROOT, COUNT] += 1
    token = tree[4][pos]
    for k in range(active):  # the oldest (longest) suffix first (cc:318-319)
        slot = (oldest + k) % depth
        ring[slot] = _extend(tree, ring[slot], token, pos)


@_jit
def start_sequence(tree):
    """The next token appended starts a new sequence: no suffix of the last one grows on."""
    tree[2][M_RING] = tree[2][M_ACTIVE] = 0


@_jit
def _extend(tree, node, token, pos):
    """The suffix ending at the end of `node` gains `token` (at `pos`); the node it now ends in."""
    nodes = tree[0]
    child = child_of(tree, node, token)
    if child == NONE:
        if node != ROOT and nodes[node, COUNT] == 1:
            # reached by this suffix alone, so a leaf this sequence made, its edge ending at pos - 1
            nodes[node, LENGTH] += 1
            return node
        leaf = new_node(tree, node, token, pos, 1, 1)
        adopt(tree, node, leaf)
        link(tree, leaf, nodes[node, LAST], NONE)
        return leaf
    if node != ROOT and nodes[node, COUNT] == nodes[child, COUNT] + 1:
        if nodes[child, LENGTH] == 1:
            return _absorb(tree, node, child, pos)
        _take_first(tree, node, child, token, pos)
        return node
    if nodes[child, LENGTH] == 1:
        increment(tree, child)
        return child
    return _split(tree, node, child, token, pos)


@_jit
def _absorb(tree, node, child, pos):
    """Case 2 with a one-token child: child, now as common as node, becomes node's edge plus its token
    (its edge re-pointed at this sequence's last tokens) in node's place (cc:384-411)."""
    nodes = tree[0]
    parent, length = nodes[node, PARENT], nodes[node, LENGTH] + 1
    leave_group(tree, child)  # it was node's only child: that run goes
    disown(tree, node, nodes[child, TOKEN])
    nodes[child, COUNT] += 1
    nodes[child, TOKEN], nodes[child, START], nodes[child, LENGTH] = nodes[node, TOKEN], pos - length + 1, length
    nodes[child, PARENT] = parent
    take_place(tree, node, child)
    adopt(tree, parent, child)  # under node's key: the same first token
    free_node(tree, node)
    return child


@_jit
def _take_first(tree, node, child, token, pos):
    """Case 2 with a longer child: node's edge grows by child's first token (re-pointed at this
    sequence), child's shrinks by it (cc:412-438)."""
    nodes, store = tree[0], tree[4]
    nodes[node, LENGTH] += 1
    nodes[node, START] = pos - nodes[node, LENGTH] + 1
    disown(tree, node, token)
    nodes[child, LENGTH] -= 1
    nodes[child, START] += 1
    nodes[child, TOKEN] = store[nodes[child, START]]
    adopt(tree, node, child)


@_jit
def _split(tree, node, child, token, pos):
    """Case 3 with a longer child: a one-token node takes child's place and count, child (less its
    first token) below it, then that node is counted (cc:455-501)."""
    nodes, store = tree[0], tree[4]
    middle = new_node(tree, node, token, pos, 1, nodes[child, COUNT])
    take_place(tree, child, middle)
    adopt(tree, node, middle)  # replaces child under the same key
    nodes[child, LENGTH] -= 1
    nodes[child, START] += 1
    nodes[child, TOKEN] = store[nodes[child, START]]
    nodes[child, PARENT] = middle
    adopt(tree, middle, child)
    link(tree, child, NONE, NONE)  # middle's only child, a run of its own
    increment(tree, middle)
    return middle


# ------------------------------------------------------------------------------------ removal


@_jit
def remove(tree, begin, end):
    """Drop the sequence at store[begin:end] (cc:513-591)."""
    depth = tree[5].shape[0]
    for start in range(begin, end):
        tree[0][ROOT, COUNT] -= 1
        last = _uncount_path(tree, start, min(end, start + depth))
        _merge_below(tree, last)


@_jit
def _uncount_path(tree, start, stop):
    """Each node on the path of store[start:stop] loses one count; one left with none goes (count 1
    nodes are leaves: a child as common as its parent would have been merged into it). The last node
    reached (cc:518-545)."""
    nodes, store = tree[0], tree[4]
    node, pos = ROOT, start
    while pos < stop:
        child = child_of(tree, node, store[pos])
        if child == NONE:
            break
        if nodes[child, COUNT] > 1:
            decrement(tree, child)
        else:
            if nodes[child, FIRST] != NONE:
                raise RuntimeError("suffix tree: a node counted once has children")
            leave_group(tree, child)
            unlink(tree, child)
            disown(tree, node, nodes[child, TOKEN])
            free_node(tree, child)
            break
        pos += nodes[child, LENGTH]
        node = child
    return node


@_jit
def _merge_below(tree, node):
    """`node` and its only child, now of one count, become one node: the child, in node's place, its
    edge node's edge and its own (cc:546-560)."""
    nodes = tree[0]
    child = nodes[node, FIRST]
    if node == ROOT or child == NONE or child != nodes[node, LAST] or nodes[child, COUNT] != nodes[node, COUNT]:
        return
    parent = nodes[node, PARENT]
    leave_group(tree, child)
    disown(tree, node, nodes[child, TOKEN])
    nodes[child, LENGTH] += nodes[node, LENGTH]
    nodes[child, START] -= nodes[node, LENGTH]  # the store holds node's tokens right before child's
    nodes[child, TOKEN], nodes[child, PARENT] = nodes[node, TOKEN], parent
    take_place(tree, node, child)
    adopt(tree, parent, child)
    free_node(tree, node)
