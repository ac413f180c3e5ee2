"""DDTree (docs/ddtree.md): the tree of a node budget N is the N best prefixes of the drafts' per-position
marginals, found best-first; a verification step accepts the depth of the deepest node on the target's
path inside it. One heap run per anchor at the largest budget gives every budget's depth (the pop order
does not depend on N): the pop index of each path prefix, computed compiled (ddtree_kernels.py) in a
worker thread while the next chunk's drafts are computed."""

from __future__ import annotations

import re
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pipeline.common import timing
from scoring.methods.base import ChunkScores, Method
from scoring.methods.ddtree_heap import NOT_IN_TREE
from scoring.replay import metrics

_NAME = re.compile(r"ddtree-(\d+)")


class DDTree(Method):
    kind = "ddtree"

    def name(self, nodes) -> str:
        """'ddtree-16' for a budget of 16 nodes (root not counted)."""
        return f"ddtree-{int(nodes)}"

    def setting_of(self, name: str):
        match = _NAME.fullmatch(name)
        return int(match.group(1)) if match else None

    def column(self, nodes, sampled: bool = False) -> str:
        return f"ddtree_{int(nodes)}_accepted_len"

    def order(self, nodes) -> tuple:
        return (int(nodes),)

    def needs_scores(self, settings) -> bool:
        return bool(settings)

    def empty(self, anchors: int, positions: int, settings) -> torch.Tensor:
        """[A, L] the pop index of the target-path prefix of each depth (NOT_IN_TREE: never popped)."""
        return torch.full((anchors, positions), NOT_IN_TREE, dtype=torch.long)

    def chunk(self, scored: ChunkScores, settings) -> Future:
        targets, known = scored.targets.cpu(), scored.known.cpu()
        return _tree_worker().submit(_timed_tree_pops, scored.scores, scored.lse, targets, known, max(settings))

    def resolve(self, data):
        if not isinstance(data, Future):
            return data
        with timing.stage("ddtree wait"):
            pops, seconds, anchors = data.result()
        timing.elapsed("ddtree", seconds, anchors=anchors)
        return pops

    def write(self, store, rows, depth, data) -> None:
        store[rows, :depth] = data

    def accepted(self, result, nodes, settings, rows=slice(None)) -> torch.Tensor:
        return metrics.tree_accepted(result.method_data[self.kind][rows], nodes)


DDTREE = DDTree()

_TREE_WORKER: ThreadPoolExecutor | None = None


def _tree_worker() -> ThreadPoolExecutor:
    """One thread for DDTree: the compiled heap releases the GIL, so it runs while the main
    thread computes the next chunk's drafter pass (its time shows as the "ddtree wait" stage
    only where it is not hidden)."""
    global _TREE_WORKER
    if _TREE_WORKER is None:
        _TREE_WORKER = ThreadPoolExecutor(1, thread_name_prefix="specreplay-ddtree")
    return _TREE_WORKER


def _timed_tree_pops(logits, lse, targets, known, max_nodes) -> tuple[torch.Tensor, float, int]:
    """(pop indices [a, L], seconds spent, anchors): ddtree_kernels.tree_pops in the worker."""
    from scoring.methods.ddtree_kernels import tree_pops  # numba: compiled on first use, not on import

    started = time.perf_counter()
    pops = tree_pops(logits, lse, targets, known, max_nodes)
    return pops, time.perf_counter() - started, int(targets.shape[0])
