"""All-anchor replay: every response position of a stored sample as a block start, in batches.

For each sample: the proposer prepares its state once (a drafter's context keys/values of every
layer, from the stored target features); then anchors are scored in chunks, each anchor's block
seeing only what comes before t. Blocks run at the length the online loop would use there
(`Proposer.block_len`: min(block_size, prompt_len + budget - t) for a block drafter), so the tail,
where `dflash_generate` truncates the block to the remaining max_new_tokens budget, is replayed on
that truncated block too (the drafter is bidirectional inside a block, so truncation changes its
output).

The output is per-anchor tensors (`AnchorTensors`); metrics.py turns them into numbers.

The semantics, in words: docs/anchors-and-blocks.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.common import timing
from pipeline.shards import Sample
from proposers.interface import Chunk, Proposer, TargetHead, is_stateful, serves_requests
from scoring.methods import registry
from scoring.methods.chain import CHAIN
from scoring.replay import metrics
from scoring.replay.chunk import ScoredChunk, score_chunk
from scoring.replay.packing import PackedSamples, ReplayOptions, pack_samples
from scoring.replay.walk import next_stop_positions, walk_finished, walk_in_rounds
from scoring.replay.walk_rules import walk_rule


@dataclass
class AnchorTensors:
    """Per-anchor results of one sample; A anchors, L = the drafts of a full block (block_size - 1,
    or block_size for families that draft from the anchor's own slot).
    Entries past an anchor's (possibly truncated) block or past the known response are -1
    (token ids), NaN (floats) or NOT_IN_TREE (pop indices)."""

    anchors: torch.Tensor  # [A] absolute positions of the block's first token
    remaining: torch.Tensor  # [A] positions left in the budget from the anchor on (P + budget - t)
    block_len: torch.Tensor  # [A] block queries
    # [A] drafts the block proposes (block_len - 1, or block_len drafting from the anchor; fewer
    # where the proposer cut them: Drafts.limit)
    depth: torch.Tensor
    draft_tokens: torch.Tensor  # [A, L] drafter argmax
    target_tokens: torch.Tensor  # [A, L] stored (greedy) tokens, -1 where unknown
    target_logprob: torch.Tensor  # [A, L] log q_k(y_k)
    sampled_logprob: torch.Tensor  # [A, L] log q_k(y_k) under the shards' sampling settings (NaN when greedy)
    kl_topk: torch.Tensor  # [A, L] KL(target || draft) on the stored top-k support
    computed: torch.Tensor  # [A] bool: scored (all True in all-anchor mode; walk mode scores visited anchors)
    nonfinite: torch.Tensor  # [A] bool: the drafter's logits held NaN/Inf there (the sample is not scored)
    # each planned tree method's per-anchor data, by its kind (scoring/methods/: DDTree's pop indices
    # [A, L], the EAGLE trees' alphas [A, S])
    method_data: dict[str, torch.Tensor] = field(default_factory=dict)


def empty_anchor_tensors(
    sample: Sample, max_new_tokens: int, proposer: Proposer, options: ReplayOptions
) -> AnchorTensors:
    """Per-anchor tensors for every anchor of a sample (`options.methods`: the planned tree methods'
    settings by kind; `options.walk_rule`: whether the tail's blocks are shortened), nothing computed yet."""
    methods = options.methods
    anchors = torch.arange(sample.prompt_len, sample.input_ids.numel() - 1)
    A, L = anchors.numel(), proposer.max_drafts
    remaining = sample.prompt_len + max_new_tokens - anchors
    block_len = proposer.block_len(walk_rule(options.walk_rule).block_remaining(remaining))
    depth = torch.tensor([proposer.depth(b) for b in block_len.tolist()], dtype=torch.long)
    data = {m.kind: m.empty(A, L, methods[m.kind]) for m in registry.TREES if methods.get(m.kind)}
    return AnchorTensors(
        anchors=anchors,
        remaining=remaining,
        block_len=block_len,
        depth=depth,
        draft_tokens=torch.full((A, L), -1, dtype=torch.long),
        target_tokens=torch.full((A, L), -1, dtype=torch.long),
        target_logprob=torch.full((A, L), float("nan")),
        sampled_logprob=torch.full((A, L), float("nan")),
        kl_topk=torch.full((A, L), float("nan")),
        computed=torch.zeros(A, dtype=torch.bool),
        nonfinite=torch.zeros(A, dtype=torch.bool),
        method_data=data,
    )


@torch.inference_mode()
def replay_anchors(
    proposer: Proposer,
    target: TargetHead,
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
        _replay_anchors(proposer, target, packed, results, wanted, options)


SMALL_CHUNK_ROWS = 256  # chunks of fewer block rows share one propose call (one lm_head GEMM, neural.py)


def _replay_anchors(proposer, target, packed, results, wanted, options) -> None:
    sample_idx = torch.tensor([s for s, _ in wanted])
    rows = torch.tensor([r for _, r in wanted])
    chunks = _chunks(proposer, target, packed, results, sample_idx, rows, options)  # (positions, block length, depth)
    # A sample's tail (the last anchors, one block length each) makes chunks of a few rows;
    # alone, each would read the whole lm_head for them. They share one call.
    is_small = [part.numel() * depth < SMALL_CHUNK_ROWS for part, _, depth in chunks]
    batches = [[c] for c, small in zip(chunks, is_small) if not small]
    batches += _batches_of([c for c, small in zip(chunks, is_small) if small], SMALL_CHUNK_ROWS * 4)
    anchors = torch.stack([results[s].anchors[r] for s, r in wanted])
    room = walk_rule(options.walk_rule).room(torch.stack([results[s].remaining[r] for s, r in wanted]))
    previous = None  # the last chunk, written once its methods' data is in (computed meanwhile)
    for batch in batches:
        on_device = [
            _chunk(sample_idx[p], anchors[p], b, None if room is None else room[p], options) for p, b, _ in batch
        ]
        drafts = proposer.propose(packed, on_device, target, options)
        for (part, _, depth), chunk, chunk_drafts in zip(batch, on_device, drafts):
            scored = score_chunk(proposer, packed, chunk, target, options, chunk_drafts)
            if previous is not None:
                _write_chunk(results, *previous)
            previous = (sample_idx[part], rows[part], depth, scored)
    if previous is not None:
        _write_chunk(results, *previous)


def _chunk(sample_idx, anchors, block_len: int, room, options) -> Chunk:
    device = options.device
    return Chunk(sample_idx.to(device), anchors.to(device), block_len, None if room is None else room.to(device))


def _chunks(proposer, target, packed, results, sample_idx, rows, options) -> list[tuple]:
    """(positions in the wanted list, block length, depth) of every chunk, grouped by block length
    and sized by the memory budget; the anchors drafting nothing are marked computed at once."""
    block_lens = torch.stack([results[s].block_len[r] for s, r in zip(sample_idx.tolist(), rows.tolist())])
    vocab, ctx_len = target.lm_head.shape[0], int(packed.lengths.sum())
    chunks = []
    for block_len in block_lens.unique().tolist():
        group = torch.nonzero(block_lens == block_len).flatten()
        depth = proposer.depth(block_len)
        if depth == 0:  # the budget's last position: no draft, the step is the target's token alone
            _mark_computed(results, sample_idx[group], rows[group])
            continue
        size = proposer.anchors_per_chunk(block_len, ctx_len, vocab, options)
        chunks += [(group[begin : begin + size], block_len, depth) for begin in range(0, group.numel(), size)]
    return chunks


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


def _write_chunk(results: list[AnchorTensors], sample_idx, rows, depth: int, scored: ScoredChunk) -> None:
    """Store a chunk's per-anchor results, one indexed write per sample in it, not per anchor.
    Waits for the chunk's methods' data when it is still being computed (DDTree's worker)."""
    planned = [(m, m.resolve(scored.methods[m.kind])) for m in registry.TREES if m.kind in scored.methods]
    for s in sample_idx.unique().tolist():
        mine = sample_idx == s
        r, out = rows[mine], results[s]
        out.draft_tokens[r, :depth] = scored.draft[mine]
        out.target_tokens[r, :depth] = scored.targets[mine]
        out.target_logprob[r, :depth] = scored.target_logprob[mine]
        out.sampled_logprob[r, :depth] = scored.sampled_logprob[mine]
        out.kl_topk[r, :depth] = scored.kl[mine]
        for method, data in planned:
            method.write(out.method_data[method.kind], r, depth, data[mine])
        out.nonfinite[r] = scored.nonfinite[mine]
        out.depth[r] = scored.proposed[mine]  # what the engines count as drafted at the step
        out.computed[r] = True


def step_inputs(result: AnchorTensors, accepted, produced, next_stop: torch.Tensor) -> dict:
    """What a walk rule's counts read of the anchors of `result` (WalkRule.counts), given their
    accepted drafts and produced tokens; next_stop: next_stop_positions of the sample."""
    return {
        "accepted": accepted,
        "produced": produced,
        "depth": result.depth,
        "known": (result.target_tokens >= 0).sum(dim=1),
        "remaining": result.remaining,
        "stop": next_stop[result.anchors] - result.anchors,
    }


def at_rows(result: AnchorTensors, rows) -> AnchorTensors:
    """The anchors `rows` (an index, slice or mask) of `result`."""
    fields = {name: getattr(result, name)[rows] for name in AnchorTensors.__dataclass_fields__ if name != "method_data"}
    return AnchorTensors(**fields, method_data={kind: data[rows] for kind, data in result.method_data.items()})


def replay_sample(
    proposer: Proposer,
    target: TargetHead,
    sample: Sample,
    feature_columns,
    max_new_tokens: int,
    options: ReplayOptions,
) -> AnchorTensors:
    """Score every anchor of one sample (all-anchor mode). `feature_columns(features)` selects
    the proposer's layers; `max_new_tokens` is the max_new_tokens the online loop would run with."""
    result = empty_anchor_tensors(sample, max_new_tokens, proposer, options)
    if result.anchors.numel() or serves_requests(proposer):  # served even without an anchor: later ones see it
        packed = pack_samples(proposer, [sample], feature_columns, options, target)
        replay_anchors(proposer, target, packed, [result], [(0, r) for r in range(result.anchors.numel())], options)
    return result


def replay_walks(
    proposer: Proposer,
    target: TargetHead,
    samples: list[Sample],
    feature_columns,
    max_new_tokens: list[int],
    methods: list[str],
    is_stop: list[torch.Tensor],
    options: ReplayOptions,
) -> list[AnchorTensors]:
    """Walk-only mode: score just the anchors the simulated walks visit. One walk per (sample,
    method), a method being a results method name (scoring/methods/); each round batches the
    current anchor of every unfinished walk (anchors shared between methods scored once)."""
    results = [empty_anchor_tensors(s, b, proposer, options) for s, b in zip(samples, max_new_tokens)]
    packed = pack_samples(proposer, samples, feature_columns, options, target)
    next_stop = [next_stop_positions(m) for m in is_stop]

    def row(s: int, position: int) -> int:
        return position - samples[s].prompt_len

    def score(current: list[tuple[tuple[int, int], int]]) -> None:
        wanted = sorted({(s, row(s, position)) for (s, _), position in current})
        replay_anchors(
            proposer, target, packed, results, [(s, r) for s, r in wanted if not results[s].computed[r]], options
        )

    def produced(key: tuple[int, int], position: int) -> int:
        s, m = key
        r, out = slice(row(s, position), row(s, position) + 1), results[s]
        accepted = registry.accepted(out, methods[m], options.methods, r)
        anchor = out.anchors[r]
        made = metrics.produced_tokens(accepted, anchor, samples[s].input_ids.numel(), next_stop[s][anchor])
        if stateful:  # the server's verification, as the walk rule counts it
            counts = walk_rule(options.walk_rule).counts(step_inputs(at_rows(out, r), accepted, made, next_stop[s]))
            proposer.accept(int(counts.accepted[0]))
        return int(made[0])

    stateful = is_stateful(proposer)
    if stateful:  # one request at a time: begin, then its walk, before the next request begins
        assert len(samples) == 1 and methods == [CHAIN], (len(samples), methods)
        proposer.begin(packed, 0)
        if hasattr(proposer, "set_budget"):  # SGLang's NGRAM: a request's end depends on its max_new_tokens
            proposer.set_budget(max_new_tokens[0])
    starts = {(s, m): sample.prompt_len for s, sample in enumerate(samples) for m in range(len(methods))}
    walk_in_rounds(starts, lambda key, position: walk_finished(position, is_stop[key[0]]), score, produced)
    return results
