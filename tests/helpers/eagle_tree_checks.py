"""What the EAGLE tree parity tests (tests/parity/test_eagle3_parity.py, test_eagle1_parity.py) read
of specreplay's eagle-tree-* scoring to compare with the naive online tree of
tests/helpers/eagle3_tree_online.py: each anchor's tree alphas, and every candidate (token path and
score) the tree drafted, recorded where scoring/methods/eagle_tree.py verifies them."""

from __future__ import annotations

from contextlib import contextmanager

import polars as pl

import scoring.methods.eagle_tree as tree_method
from pipeline.shards import ShardSet


def column(name: str) -> str:
    """anchors.parquet's alpha column of the tree setting `name` ('4x5-8')."""
    return f"eagle_tree_{name.replace('-', '_')}_accepted_len"


def tree_alphas(out_dir: str, trees) -> pl.DataFrame:
    """(sample_id, anchor, accepted_len and each tree's alpha) of anchors.parquet, sorted."""
    rows = pl.read_parquet(f"{out_dir}/anchors.parquet")
    return rows.select("sample_id", "anchor", "accepted_len", *map(column, trees)).sort("sample_id", "anchor")


def mismatches(table: pl.DataFrame, online_trees, trees) -> dict[str, int]:
    """Per tree, the anchors whose alpha differs from the online tree's."""
    counts = dict.fromkeys(trees, 0)
    for row in table.iter_rows(named=True):
        for name in trees:
            counts[name] += row[column(name)] != online_trees[(row["sample_id"], row["anchor"])][0][name]
    return counts


@contextmanager
def drafted_candidates(monkeypatch, shards: str):
    """While scoring: (sample id, anchor, topk) -> every candidate's token path -> its score, as
    specreplay's tree drafted them (recorded where scoring/methods/eagle_tree.py verifies them)."""
    sample_of = {tuple(s.input_ids.tolist()): s.sample_id for s in ShardSet(shards).samples(tensors=[])}
    found, where = {}, {}
    known_targets, accepted_depth = tree_method.known_targets, tree_method.accepted_depth

    def seen(packed, chunk, depth):
        where["chunk"] = packed, chunk
        return known_targets(packed, chunk, depth)

    def recorded(candidates, tree, targets):
        packed, chunk = where["chunk"]
        for row, (s, anchor) in enumerate(zip(chunk.sample_idx.tolist(), chunk.anchors.tolist())):
            start, length = int(packed.starts[s]), int(packed.lengths[s])
            sample_id = sample_of[tuple(packed.ids[start : start + length].tolist())]
            found[(sample_id, anchor, candidates.topk)] = paths(candidates, row)
        return accepted_depth(candidates, tree, targets)

    with monkeypatch.context() as patch:
        patch.setattr(tree_method, "known_targets", seen)
        patch.setattr(tree_method, "accepted_depth", recorded)
        yield found


def paths(candidates, row: int) -> dict[tuple[int, ...], float]:
    """Each candidate of `row`'s tree: its token path from the root -> its score."""
    found, scores = {}, {}
    rows = zip(candidates.parents[row].tolist(), candidates.tokens[row].tolist(), candidates.scores[row].tolist())
    for c, (parent, token, score) in enumerate(rows):
        found[c] = (found[parent] if parent >= 0 else ()) + (token,)
        scores[found[c]] = score
    return scores


def candidate_mismatches(drafted: dict, online_trees, tolerance: float) -> tuple[int, float]:
    """(the (anchor, topk) pairs whose candidates differ from the online tree's: another set of
    token paths, or a path's score off by more than `tolerance`; the largest score difference over
    the paths both drafted)."""
    differ, largest = 0, 0.0
    for (sample_id, anchor, topk), mine in drafted.items():
        online = online_trees[(sample_id, anchor)][1][topk]
        gaps = [abs(mine[p] - online[p]) for p in mine.keys() & online.keys()]
        differ += mine.keys() != online.keys() or max(gaps, default=0.0) > tolerance
        largest = max([largest, *gaps])
    return differ, largest
