"""One chunk of anchors through the drafter: blocks [x_t, mask, ...] embedded, the drafter's
hidden states and logits, and what the metrics need of them (draft tokens, log q of the stored
tokens, KL on the stored top-k, DDTree pop indices in a worker thread). Chunks are sized by the
memory budget (`chunk_anchors`)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from pipeline.common import timing
from scoring.drafters.attention import KEY_CHUNK
from scoring.drafters.base import DraftModel, Drafts
from scoring.replay import metrics
from scoring.replay.ddtree import NOT_IN_TREE
from scoring.replay.ddtree_kernels import tree_pops
from scoring.replay.packing import (
    PackedSamples,
    ReplayOptions,
)


def anchors_per_chunk(drafter: DraftModel, block_len: int, ctx_len: int, vocab: int, memory_bytes: int) -> int:
    """How many anchors fit the working-memory budget: logits and their float copies
    (~4 x L x V floats) plus attention scores (~3 x heads x b x (T + b) floats) per anchor."""
    cfg = drafter.config
    per_anchor = 4 * 4 * cfg.depth(block_len) * vocab
    per_anchor += 3 * 4 * cfg.num_attention_heads * block_len * (ctx_len + block_len)
    per_anchor += 8 * 4 * block_len * max(cfg.intermediate_size, cfg.hidden_size)
    return max(1, int(memory_bytes // per_anchor))


def attended_keys(options: ReplayOptions, ctx_len: int) -> int:
    """Context keys one anchor's attention holds scores for at once: all of them on the dense
    path, one key chunk on the blockwise path (the flex kernel tiles them too)."""
    return ctx_len if options.attention_backend == "dense" else min(ctx_len, KEY_CHUNK)


def chunk_anchors(drafter: DraftModel, block_len: int, ctx_len: int, vocab: int, options: ReplayOptions) -> int:
    """Anchors per chunk as `replay_anchors` runs them over a context of ctx_len keys."""
    return anchors_per_chunk(drafter, block_len, attended_keys(options, ctx_len), vocab, options.memory_bytes)


def chunk_drafts(drafter, embed, lm_head, packed: PackedSamples, sample_idx, anchors, block_len, options) -> Drafts:
    """The drafts [a, D, ...] of blocks [x_t, mask, ...] at `anchors` (each in its sample
    `sample_idx` of `packed`), under `options.conventions`, teacher-forced along the stored tokens."""
    hidden = chunk_hidden(drafter, embed, packed, sample_idx, anchors, block_len, options)  # [a, D, H]
    previous = stored_tokens(packed, sample_idx, anchors, hidden.shape[1], first=0)  # token before each draft
    return drafter.drafts(hidden, lm_head, previous, options.conventions)


def chunk_logits(drafter, embed, lm_head, packed: PackedSamples, sample_idx, anchors, block_len, options):
    """The drafter's logits [a, D, V] for blocks at `anchors` (chunk_drafts' logits)."""
    return chunk_drafts(drafter, embed, lm_head, packed, sample_idx, anchors, block_len, options).logits


def stored_tokens(packed: PackedSamples, sample_idx, anchors, depth: int, first: int = 1) -> torch.Tensor:
    """[a, depth] the stored token at sample position anchor + first + j for j < depth, clamped
    to the sample's last token where the position is past its end (such a draft is never
    verified: a caller masks it by the position's `known`)."""
    starts, lengths = packed.starts[sample_idx], packed.lengths[sample_idx]
    positions = anchors[:, None] + first + torch.arange(depth, device=anchors.device)[None, :]
    positions = torch.minimum(positions, lengths[:, None] - 1)
    return packed.ids[starts[:, None] + positions]


def chunk_hidden(drafter, embed, packed: PackedSamples, sample_idx, anchors, block_len, options):
    """The drafter's final hidden states [a, D, H] at the draft slots (D = config.depth(block_len))."""
    cfg, conventions = drafter.config, options.conventions
    starts = packed.starts[sample_idx]
    block_ids = block_tokens(cfg, packed, sample_idx, anchors, block_len)
    # The embedding may be kept in a narrower stored dtype (prepare_target_head): cast the
    # gathered rows, which gives the values of a cast table.
    embed_scale = cfg.scales(conventions)[0]
    table = drafter.embedding_table(embed)  # the target's, unless the drafter keeps its own copy (DeepSpec)
    block_embeds = torch.nn.functional.embedding(block_ids, table).to(options.dtype) * embed_scale  # [a, b, H]
    # no anchor here sees context at or past this key
    visible_ctx = int((starts + anchors).max()) + conventions.context_offset
    chunk_context = [tuple(t[:, :visible_ctx] for t in entry) for entry in packed.context]
    hidden = drafter(
        block_embeds,
        anchors,
        chunk_context,
        attention=options.attention_backend,
        ctx_starts=starts,
        conventions=conventions,
    )
    return hidden[:, cfg.first_draft_slot :]


def block_tokens(cfg, packed: PackedSamples, sample_idx, anchors, block_len: int) -> torch.Tensor:
    """[a, b] the block's token ids: [x_t, mask, ...], or for a family whose slots read the draft
    before them (`teacher_forced_block`) the stored tokens [x_t, y_{t+1}, ...]: a draft is verified
    only while every earlier one equalled the stored token, so the stored tokens are the drafts
    that matter (docs/sampling.md#drafters-whose-drafts-depend-on-earlier-drafts)."""
    if cfg.teacher_forced_block:
        return stored_tokens(packed, sample_idx, anchors, block_len, first=0)
    block_ids = torch.full((anchors.numel(), block_len), cfg.mask_token_id, dtype=torch.long, device=anchors.device)
    block_ids[:, 0] = packed.ids[packed.starts[sample_idx] + anchors]
    return block_ids


def score_chunk(drafter, packed: PackedSamples, sample_idx, anchors, options, drafts: Drafts) -> dict:
    """From the drafts of a chunk of anchors (each in its sample of `packed`; logits [a, depth,
    V]): per-anchor draft tokens, target tokens, log q(target), KL on the stored top-k, DDTree
    pop indices (a Future: computed in the worker thread)."""
    device = anchors.device
    depth = drafts.logits.shape[1]
    starts, lengths = packed.starts[sample_idx], packed.lengths[sample_idx]
    logits, nonfinite = finite_logits(drafts.logits)
    if packed.nonfinite_from is not None:  # anchor t sees context 0 .. t - 1 + context_offset
        sees_bad = anchors + options.conventions.context_offset > packed.nonfinite_from[sample_idx]
        nonfinite = nonfinite | sees_bad
    draft = logits.argmax(dim=-1) if drafts.tokens is None else drafts.tokens

    positions = anchors[:, None] + torch.arange(1, depth + 1, device=device)[None, :]  # within the sample
    known = positions < lengths[:, None]
    flat = (starts[:, None] + positions).clamp(max=packed.ids.numel() - 1)
    targets = torch.where(known, packed.ids[flat], torch.full_like(positions, -1))
    unknown = torch.full(targets.shape, float("nan"), device=device)
    target_logprob, kl = unknown, unknown
    lse = scores = None
    if options.distribution_metrics or options.max_tree_nodes > 0:
        scores = logits.float()  # [a, depth, V]: one fp32 copy for the metrics and DDTree (none in fp32)
        with timing.stage("logsumexp"):  # once, for log q(target), KL and DDTree's log-probs
            lse = logsumexp_rows(scores)  # [a, depth]
    if options.distribution_metrics:
        target_logprob, kl = _distribution_metrics(scores, lse, targets, known, packed, sample_idx, positions)
    sampled = unknown
    if not options.sampling.greedy:  # log q_j(y_j), the family's rule (docs/sampling.md)
        sampled = torch.where(known, drafter.draft_logprob(logits, targets, options.sampling), sampled)
    if drafts.limit is not None:  # drafts past a confidence head's cut are never proposed
        cut = torch.arange(depth, device=device)[None, :] >= drafts.limit[:, None]
        draft = draft.masked_fill(cut, NOT_PROPOSED)
        sampled = sampled.masked_fill(cut & known, float("-inf"))

    pops = torch.full((anchors.numel(), depth), NOT_IN_TREE, dtype=torch.long)
    if options.max_tree_nodes > 0:
        pops = _tree_worker().submit(_timed_tree_pops, scores, lse, targets.cpu(), known.cpu(), options.max_tree_nodes)
    return {
        "draft": draft.cpu(),
        "targets": targets.cpu(),
        "target_logprob": target_logprob.cpu(),
        "sampled_logprob": sampled.cpu(),
        "kl": kl.cpu(),
        "pops": pops,
        "nonfinite": nonfinite.cpu(),
    }


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


def _distribution_metrics(logits, lse, targets, known, packed: PackedSamples, sample_idx, positions):
    """(log q(target), KL on the stored top-k) [a, depth] each, NaN where the target is unknown.
    logits [a, depth, V] float32; log q(v) = logit(v) - logsumexp(logits), gathered where needed:
    no [a, depth, V] log-probabilities."""
    target_logprob = logits.gather(-1, targets.clamp(min=0)[..., None])[..., 0] - lse
    target_logprob = torch.where(known, target_logprob, torch.full_like(target_logprob, float("nan")))
    # Stored target distribution for the token at sample position p is row p - prompt_len.
    topk_rows = packed.topk_starts[sample_idx][:, None] + positions - packed.prompt_lens[sample_idx][:, None]
    topk_rows = topk_rows.clamp(max=packed.topk_ids.shape[0] - 1)
    support = packed.topk_ids[topk_rows].long()  # [a, depth, k]
    kl = metrics.kl_on_topk(packed.topk_logprobs[topk_rows], logits.gather(-1, support) - lse[..., None])
    return target_logprob, torch.where(known, kl, torch.full_like(kl, float("nan")))


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
    started = time.perf_counter()
    pops = tree_pops(logits, lse, targets, known, max_nodes)
    return pops, time.perf_counter() - started, int(targets.shape[0])
