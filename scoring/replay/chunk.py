"""What the metrics and the verification methods need of one chunk of anchors' drafts: draft tokens,
the stored targets, log q of the stored tokens, KL on the stored top-k, and each planned tree method's
per-anchor data (scoring/methods/: DDTree's pop indices in a worker thread, EAGLE's trees)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.common import timing
from proposers.interface import Chunk, Drafts, Proposer, TargetHead, point_mass_logprob
from scoring.methods.base import ChunkScores
from scoring.methods.registry import TREES
from scoring.replay import metrics
from scoring.replay.packing import PackedSamples, ReplayOptions


@dataclass
class ScoredChunk:
    """A chunk's per-anchor results [a, depth] on the CPU, ready to be written into its samples'
    AnchorTensors; `methods` holds each planned tree method's data by kind, which the method itself
    resolves (DDTree's is a Future while its worker computes it)."""

    draft: torch.Tensor  # the draft tokens (NOT_PROPOSED past a cut)
    targets: torch.Tensor  # the stored tokens, -1 where unknown
    target_logprob: torch.Tensor  # log q(target)
    sampled_logprob: torch.Tensor  # log q(target) under the shards' sampling (NaN when greedy)
    kl: torch.Tensor  # KL on the stored top-k
    nonfinite: torch.Tensor  # [a] bool
    proposed: torch.Tensor  # [a] drafts proposed: depth, or fewer (a confidence cut, a short n-gram match)
    methods: dict


def score_chunk(
    proposer: Proposer, packed: PackedSamples, chunk: Chunk, target: TargetHead, options: ReplayOptions, drafts: Drafts
) -> ScoredChunk:
    """From the drafts of a chunk of anchors (each in its sample of `packed`; logits [a, depth,
    V], or tokens alone): per-anchor draft tokens, target tokens, log q(target), KL on the stored
    top-k, and under "methods" each planned tree method's data (a Future when computed in a worker
    thread)."""
    drafts, nonfinite = finite_drafts(drafts)
    if packed.nonfinite_from is not None:  # anchor t sees context 0 .. t - 1 + visible_offset
        nonfinite = nonfinite | (
            chunk.anchors + options.conventions.visible_offset > packed.nonfinite_from[chunk.sample_idx]
        )
    draft = drafts.logits.argmax(dim=-1) if drafts.tokens is None else drafts.tokens
    depth = draft.shape[1]
    positions, known, targets = stored_targets(packed, chunk, depth)
    unknown = torch.full(targets.shape, float("nan"), device=targets.device)
    target_logprob = kl = sampled = unknown
    scores, lse = chunk_scores(drafts, options)
    if options.distribution_metrics:
        target_logprob, kl = _distribution_metrics(drafts, scores, lse, targets, known, packed, chunk, positions)
    if not options.sampling.greedy:  # log q_j(y_j), the proposer's rule (docs/sampling.md)
        sampled = torch.where(known, proposer.draft_logprob(drafts, targets, options.sampling), sampled)
    proposed = torch.full((draft.shape[0],), depth, dtype=torch.long, device=draft.device)
    if drafts.limit is not None:  # drafts past a confidence head's cut are never proposed
        kept = drafts.limit.clamp(max=depth).long()
        proposed = kept if drafts.drafted is None else drafts.drafted.clamp(max=depth).long()
        slot = torch.arange(depth, device=draft.device)[None, :]
        # the draft list is the loop's; acceptance (greedy: the same prefix, sampled: q) the stored chain's
        draft = draft.masked_fill(slot >= proposed[:, None], NOT_PROPOSED)
        sampled = sampled.masked_fill((slot >= kept[:, None]) & known, float("-inf"))
    scored = ChunkScores(proposer, packed, chunk, target, options, drafts, scores, lse, targets, known)
    planned = {m.kind: m.chunk(scored, options.methods[m.kind]) for m in TREES if options.methods.get(m.kind)}
    cpu = (t.cpu() for t in (draft, targets, target_logprob, sampled, kl, nonfinite, proposed))
    return ScoredChunk(*cpu, methods=planned)


def finite_drafts(drafts: Drafts) -> tuple[Drafts, torch.Tensor]:
    """(drafts with finite logits, nonfinite [a] bool): finite_logits of drafts with logits; drafts
    of tokens alone are always finite."""
    if drafts.logits is None:
        return drafts, torch.zeros(drafts.tokens.shape[0], dtype=torch.bool, device=drafts.tokens.device)
    logits, nonfinite = finite_logits(drafts.logits)
    return Drafts(logits, drafts.tokens, drafts.limit, drafts.drafted), nonfinite


def stored_targets(packed: PackedSamples, chunk: Chunk, depth: int):
    """(positions within the sample [a, depth], known [a, depth], the stored tokens there, -1 where unknown)."""
    starts, lengths = packed.starts[chunk.sample_idx], packed.lengths[chunk.sample_idx]
    positions = chunk.anchors[:, None] + torch.arange(1, depth + 1, device=chunk.anchors.device)[None, :]
    known = positions < lengths[:, None]
    flat = (starts[:, None] + positions).clamp(max=packed.ids.numel() - 1)
    return positions, known, torch.where(known, packed.ids[flat], torch.full_like(positions, -1))


def chunk_scores(drafts: Drafts, options: ReplayOptions):
    """(float32 logits [a, depth, V], their logsumexp [a, depth]) when a metric or a planned method
    reads them and the proposer has a distribution; else (None, None)."""
    wanted = options.distribution_metrics or any(m.needs_scores(options.methods.get(m.kind, ())) for m in TREES)
    if drafts.logits is None or not wanted:
        return None, None
    scores = drafts.logits.float()  # one fp32 copy for the metrics and DDTree (none in fp32)
    with timing.stage("logsumexp"):  # once, for log q(target), KL and DDTree's log-probs
        return scores, logsumexp_rows(scores)


NOT_PROPOSED = -2  # the draft token at a slot the drafter did not propose: it matches no stored token

LSE_ROWS = 16  # rows of the vocabulary per logsumexp call on CPU (see logsumexp_rows)


def logsumexp_rows(scores: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp over the last dim of [..., V], on CPU LSE_ROWS rows at a time: whole, it
    makes a temporary as large as the logits (fresh pages, several passes through memory); a
    few rows' temporary stays in cache. Each row's computation is the same, so the values are
    equal bit for bit. On a GPU one call is faster (one kernel)."""
    if scores.device.type != "cpu":
        return torch.logsumexp(scores, dim=-1)
    flat = scores.reshape(-1, scores.shape[-1])  # [rows, V]; a view of contiguous logits
    out = torch.empty(flat.shape[0], dtype=scores.dtype, device=scores.device)
    for begin in range(0, flat.shape[0], LSE_ROWS):
        torch.logsumexp(flat[begin : begin + LSE_ROWS], dim=-1, out=out[begin : begin + LSE_ROWS])
    return out.view(scores.shape[:-1])


def finite_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, nonfinite [a] bool): anchors whose drafter logits [a, L, V] hold NaN/Inf (a
    damaged or overflowing drafter), their logits zeroed so that nothing after this (argmax,
    DDTree, KL) runs on NaN; Collector leaves their samples out and reports them.

    One reduction over the chunk, allocating [a, L] only: a row's float32 sum is NaN or +Inf when
    the row holds NaN or +Inf (also when finite logits sum past 3.4e38, ~2e33 each over 150k
    tokens: a drafter that far gone is worth the same report). -Inf alone is a token the family
    never proposes (a reduced draft vocabulary, DFlash2's candidates): the sum is -Inf, not flagged."""
    sums = logits.sum(dim=-1, dtype=torch.float32)
    nonfinite = (torch.isnan(sums) | (sums == float("inf"))).any(dim=-1)
    if bool(nonfinite.any()):  # rare: the copy is made only then
        logits = logits.masked_fill(nonfinite[:, None, None], 0.0)
    return logits, nonfinite


def _distribution_metrics(drafts: Drafts, logits, lse, targets, known, packed: PackedSamples, chunk: Chunk, positions):
    """(log q(target), KL on the stored top-k) [a, depth] each, NaN where the target is unknown.
    logits [a, depth, V] float32; log q(v) = logit(v) - logsumexp(logits), gathered where needed:
    no [a, depth, V] log-probabilities. A proposer of tokens alone: q is a point mass on its draft,
    log q(target) 0 or -inf, and KL on the top-k undefined (NaN)."""
    nan = torch.full(targets.shape, float("nan"), device=targets.device)
    if logits is None:
        return torch.where(known, point_mass_logprob(drafts, targets), nan), nan
    target_logprob = logits.gather(-1, targets.clamp(min=0)[..., None])[..., 0] - lse
    target_logprob = torch.where(known, target_logprob, nan)
    # Stored target distribution for the token at sample position p is row p - prompt_len.
    sample_idx = chunk.sample_idx
    topk_rows = packed.topk_starts[sample_idx][:, None] + positions - packed.prompt_lens[sample_idx][:, None]
    topk_rows = topk_rows.clamp(max=packed.topk_ids.shape[0] - 1)
    support = packed.topk_ids[topk_rows].long()  # [a, depth, k]
    kl = metrics.kl_on_topk(packed.topk_logprobs[topk_rows], logits.gather(-1, support) - lse[..., None])
    return target_logprob, torch.where(known, kl, nan)
