"""All-anchor replay: every response position of a stored sample as a block start, in batches.

For each sample: the drafter's context keys/values of every layer are computed once from the
stored target features; then anchors are scored in chunks, each anchor's block
[x_t, mask, ..., mask] seeing only context before t. Blocks run at the length the online loop
would use there: min(block_size, prompt_len + budget - t), so the tail, where `dflash_generate`
truncates the block to the remaining max_new_tokens budget, is replayed on that truncated block
too (the drafter is bidirectional inside a block, so truncation changes its output).

The output is per-anchor tensors (`AnchorTensors`); metrics.py turns them into numbers.

The semantics, in words: docs/anchors-and-blocks.md.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from pipeline.common import timing
from pipeline.shards import Sample
from scoring import results as names
from scoring.drafters.base import DrafterConfig, DraftModel, Drafts
from scoring.replay import eagle_tree, metrics
from scoring.replay.chunk import chunk_anchors, chunk_drafts, chunk_hidden, score_chunk
from scoring.replay.ddtree import NOT_IN_TREE
from scoring.replay.packing import (
    PackedSamples,
    ReplayOptions,
    pack_samples,
)
from scoring.replay.walk import next_stop_positions, walk_finished, walk_in_rounds


@dataclass
class AnchorTensors:
    """Per-anchor results of one sample; A anchors, L = the drafts of a full block (block_size - 1,
    or block_size for families that draft from the anchor's own slot).
    Entries past an anchor's (possibly truncated) block or past the known response are -1
    (token ids), NaN (floats) or NOT_IN_TREE (pop indices)."""

    anchors: torch.Tensor  # [A] absolute positions of the block's first token
    block_len: torch.Tensor  # [A] block queries
    depth: torch.Tensor  # [A] drafts the block proposes (block_len - 1, or block_len drafting from the anchor)
    draft_tokens: torch.Tensor  # [A, L] drafter argmax
    target_tokens: torch.Tensor  # [A, L] stored (greedy) tokens, -1 where unknown
    target_logprob: torch.Tensor  # [A, L] log q_k(y_k)
    sampled_logprob: torch.Tensor  # [A, L] log q_k(y_k) under the shards' sampling settings (NaN when greedy)
    kl_topk: torch.Tensor  # [A, L] KL(target || draft) on the stored top-k support
    tree_pop_index: torch.Tensor  # [A, L] DDTree pop index of the target-path prefix of depth k
    eagle_tree_accepted: torch.Tensor  # [A, S] alpha of each EAGLE tree setting (ReplayOptions.eagle_trees)
    computed: torch.Tensor  # [A] bool: scored (all True in all-anchor mode; walk mode scores visited anchors)
    nonfinite: torch.Tensor  # [A] bool: the drafter's logits held NaN/Inf there (the sample is not scored)


def empty_anchor_tensors(sample: Sample, max_new_tokens: int, config: DrafterConfig, trees: int = 0) -> AnchorTensors:
    """Per-anchor tensors for every anchor of a sample (`trees` EAGLE tree settings), nothing computed yet."""
    anchors = torch.arange(sample.prompt_len, sample.input_ids.numel() - 1)
    A, L = anchors.numel(), config.max_drafts
    block_len = config.block_len(sample.prompt_len + max_new_tokens - anchors)
    return AnchorTensors(
        anchors=anchors,
        block_len=block_len,
        depth=(block_len - config.first_draft_slot).clamp(min=0),
        draft_tokens=torch.full((A, L), -1, dtype=torch.long),
        target_tokens=torch.full((A, L), -1, dtype=torch.long),
        target_logprob=torch.full((A, L), float("nan")),
        sampled_logprob=torch.full((A, L), float("nan")),
        kl_topk=torch.full((A, L), float("nan")),
        tree_pop_index=torch.full((A, L), NOT_IN_TREE, dtype=torch.long),
        eagle_tree_accepted=torch.zeros((A, trees), dtype=torch.long),
        computed=torch.zeros(A, dtype=torch.bool),
        nonfinite=torch.zeros(A, dtype=torch.bool),
    )


@torch.inference_mode()
def replay_anchors(
    drafter: DraftModel,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    packed: PackedSamples,
    results: list[AnchorTensors],
    wanted: list[tuple[int, int]],
    options: ReplayOptions,
) -> None:
    """Score the anchors `wanted` = [(sample index, row in results[sample])] into `results`,
    batched across samples: grouped by block length, chunked by the memory budget."""
    if not wanted:
        return
    with timing.stage("replay anchors", anchors=len(wanted), tokens=int(packed.lengths.sum())):
        _replay_anchors(drafter, embed, lm_head, packed, results, wanted, options)


SMALL_CHUNK_ROWS = 256  # chunks of fewer block rows share one lm_head GEMM (see _replay_anchors)


def _replay_anchors(drafter, embed, lm_head, packed, results, wanted, options) -> None:
    sample_idx = torch.tensor([s for s, _ in wanted])
    rows = torch.tensor([r for _, r in wanted])
    anchors = torch.stack([results[s].anchors[r] for s, r in wanted])
    block_lens = torch.stack([results[s].block_len[r] for s, r in wanted])
    vocab = lm_head.shape[0]
    ctx_len = int(packed.lengths.sum())
    chunks = []  # (positions in `wanted`, block length, drafts)
    for block_len in block_lens.unique().tolist():
        group = torch.nonzero(block_lens == block_len).flatten()
        depth = drafter.config.depth(block_len)
        if depth == 0:  # the budget's last position: no draft, the step is the target's token alone
            _mark_computed(results, sample_idx[group], rows[group])
            continue
        size = chunk_anchors(drafter, block_len, ctx_len, vocab, options)
        chunks += [(group[begin : begin + size], block_len, depth) for begin in range(0, group.numel(), size)]
    # A sample's tail (the last anchors, one block length each) makes chunks of a few rows;
    # alone, each would read the whole lm_head for them. They share one GEMM.
    is_small = [part.numel() * depth < SMALL_CHUNK_ROWS for part, _, depth in chunks]
    batches = [[c] for c, small in zip(chunks, is_small) if not small]
    batches += _batches_of([c for c, small in zip(chunks, is_small) if small], SMALL_CHUNK_ROWS * 4)
    previous = None  # the last chunk, written once its DDTree pops are in (computed meanwhile)
    for batch in batches:
        on_device = [(sample_idx[p].to(options.device), anchors[p].to(options.device), b) for p, b, _ in batch]
        drafts = _batch_drafts(drafter, embed, lm_head, packed, on_device, options)
        for (part, _, depth), (idx, at, _), chunk_drafts_ in zip(batch, on_device, drafts):
            scored = score_chunk(drafter, packed, idx, at, options, chunk_drafts_)
            if options.eagle_trees:  # drafted for real at these anchors (eagle_tree.py)
                scored["eagle_trees"] = eagle_tree.chunk_accepted(drafter, embed, lm_head, packed, idx, at, options)
            if previous is not None:
                _write_chunk(results, *previous)
            previous = (sample_idx[part], rows[part], depth, scored)
    if previous is not None:
        _write_chunk(results, *previous)


def _mark_computed(results: list[AnchorTensors], sample_idx, rows) -> None:
    for s in sample_idx.unique().tolist():
        results[s].computed[rows[sample_idx == s]] = True


def _batches_of(chunks: list, rows: int) -> list[list]:
    """Consecutive runs of `chunks` holding about `rows` draft rows each."""
    batches, current, count = [], [], 0
    for part, block_len, depth in chunks:
        current.append((part, block_len, depth))
        count += part.numel() * depth
        if count >= rows:
            batches, current, count = batches + [current], [], 0
    return batches + ([current] if current else [])


def _batch_drafts(drafter, embed, lm_head, packed, chunks, options) -> list[Drafts]:
    """Drafts of each chunk (sample_idx, anchors, block_len): the drafter per chunk; for a family
    whose drafts are row by row (DFlash: logits only), one lm_head GEMM over all their rows."""
    if len(chunks) == 1 or not getattr(drafter, "rowwise_drafts", False):
        return [chunk_drafts(drafter, embed, lm_head, packed, *chunk, options) for chunk in chunks]
    hidden = [chunk_hidden(drafter, embed, packed, idx, at, b, options) for idx, at, b in chunks]  # [a, d, H] each
    flat = torch.cat([h.reshape(-1, h.shape[-1]) for h in hidden])  # [sum a*d, H]
    logits = drafter.logits(flat[None], lm_head, options.conventions)[0]  # [sum a*d, V]
    sizes = [h.shape[0] * h.shape[1] for h in hidden]
    return [Drafts(part.view(h.shape[0], h.shape[1], -1)) for part, h in zip(logits.split(sizes), hidden)]


def _write_chunk(results: list[AnchorTensors], sample_idx, rows, depth: int, scored: dict) -> None:
    """Store a chunk's per-anchor results, one indexed write per sample in it, not per anchor.
    Waits for the chunk's DDTree pop indices when they are still being computed."""
    if isinstance(scored["pops"], Future):
        with timing.stage("ddtree wait"):
            pops, seconds, anchors = scored["pops"].result()
        timing.elapsed("ddtree", seconds, anchors=anchors)
        scored = {**scored, "pops": pops}
    for s in sample_idx.unique().tolist():
        mine = sample_idx == s
        r, out = rows[mine], results[s]
        out.draft_tokens[r, :depth] = scored["draft"][mine]
        out.target_tokens[r, :depth] = scored["targets"][mine]
        out.target_logprob[r, :depth] = scored["target_logprob"][mine]
        out.sampled_logprob[r, :depth] = scored["sampled_logprob"][mine]
        out.kl_topk[r, :depth] = scored["kl"][mine]
        out.tree_pop_index[r, :depth] = scored["pops"][mine]
        if "eagle_trees" in scored:
            out.eagle_tree_accepted[r] = scored["eagle_trees"][mine]
        out.nonfinite[r] = scored["nonfinite"][mine]
        out.computed[r] = True


def at_rows(result: AnchorTensors, rows) -> AnchorTensors:
    """The anchors `rows` (an index, slice or mask) of `result`."""
    return AnchorTensors(**{name: getattr(result, name)[rows] for name in AnchorTensors.__dataclass_fields__})


def method_accepted(result: AnchorTensors, method: str, eagle_trees=(), rows=slice(None)) -> torch.Tensor:
    """Accepted draft tokens [A] (bonus-exclusive) at the anchors `rows` (all by default) of one
    method of results.py: the chain, a DDTree budget, or one of the EAGLE trees `eagle_trees`
    (result.eagle_tree_accepted's columns, in that order)."""
    tree = names.eagle_tree_of(method)
    if tree is not None:
        return result.eagle_tree_accepted[rows, list(eagle_trees).index(tree)]
    nodes = names.tree_nodes_of(method)
    return metrics.accepted_len(
        result.draft_tokens[rows], result.target_tokens[rows], result.tree_pop_index[rows], nodes
    )


def replay_sample(
    drafter: DraftModel,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    sample: Sample,
    feature_columns,
    max_new_tokens: int,
    options: ReplayOptions,
) -> AnchorTensors:
    """Score every anchor of one sample (all-anchor mode). `feature_columns(features)` selects
    the drafter's layers; `max_new_tokens` is the max_new_tokens the online loop would run with."""
    result = empty_anchor_tensors(sample, max_new_tokens, drafter.config, len(options.eagle_trees))
    if result.anchors.numel():
        packed = pack_samples(drafter, [sample], feature_columns, options, embed)
        replay_anchors(
            drafter, embed, lm_head, packed, [result], [(0, r) for r in range(result.anchors.numel())], options
        )
    return result


def replay_walks(
    drafter: DraftModel,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    samples: list[Sample],
    feature_columns,
    max_new_tokens: list[int],
    methods: list[str],
    is_stop: list[torch.Tensor],
    options: ReplayOptions,
) -> list[AnchorTensors]:
    """Walk-only mode: score just the anchors the simulated walks visit. One walk per (sample,
    method), a method being the chain, a DDTree budget or an EAGLE tree (results.py's names);
    each round batches the current anchor of every unfinished walk (anchors shared between
    methods scored once)."""
    trees = len(options.eagle_trees)
    results = [empty_anchor_tensors(s, b, drafter.config, trees) for s, b in zip(samples, max_new_tokens)]
    packed = pack_samples(drafter, samples, feature_columns, options, embed)
    next_stop = [next_stop_positions(m) for m in is_stop]

    def row(s: int, position: int) -> int:
        return position - samples[s].prompt_len

    def score(current: list[tuple[tuple[int, int], int]]) -> None:
        wanted = sorted({(s, row(s, position)) for (s, _), position in current})
        replay_anchors(
            drafter, embed, lm_head, packed, results, [(s, r) for s, r in wanted if not results[s].computed[r]], options
        )

    def produced(key: tuple[int, int], position: int) -> int:
        s, m = key
        r, out = slice(row(s, position), row(s, position) + 1), results[s]
        accepted = method_accepted(out, methods[m], options.eagle_trees, r)
        anchor = out.anchors[r]
        return int(metrics.produced_tokens(accepted, anchor, samples[s].input_ids.numel(), next_stop[s][anchor])[0])

    starts = {(s, m): sample.prompt_len for s, sample in enumerate(samples) for m in range(len(methods))}
    walk_in_rounds(starts, lambda key, position: walk_finished(position, is_stop[key[0]]), score, produced)
    return results
