"""All-anchor replay: every response position of a stored sample as a block start, in batches.

For each sample: the drafter's context keys/values of every layer are computed once from the
stored target features; then anchors are scored in chunks, each anchor's block
[x_t, mask, ..., mask] seeing only context before t. Blocks run at the length the online loop
would use there: min(block_size, prompt_len + budget - t), so the tail, where `dflash_generate`
truncates the block to the remaining max_new_tokens budget, is replayed on that truncated block
too (the drafter is bidirectional inside a block, so truncation changes its output).

The output is per-anchor tensors (`AnchorTensors`); metrics.py turns them into numbers.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pipeline.common import timing
from pipeline.common.sampling import Sampling
from pipeline.shards import Sample
from scoring.drafters.attention import KEY_CHUNK
from scoring.drafters.conventions import REFERENCE, Conventions
from scoring.drafters.dflash_model import DFlashDrafter
from scoring.replay import metrics
from scoring.replay.ddtree import NOT_IN_TREE
from scoring.replay.ddtree_kernels import tree_pops
from scoring.replay.walk import next_stop_positions, walk_finished, walk_in_rounds


@dataclass
class ReplayOptions:
    max_tree_nodes: int = 256  # largest DDTree budget (nodes); 0 disables DDTree
    memory_bytes: int = 2 << 30  # working-memory budget for one anchor chunk
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    attention: str = "auto"  # auto: flex_attention on CUDA, blockwise (chunked context keys) on CPU
    sampling: Sampling = Sampling()  # the shards' settings: q_j for rejection sampling at T > 0
    conventions: Conventions = REFERENCE  # score: always the reference; diagnose changes one switch
    distribution_metrics: bool = True  # log q(target) and KL on the top-k; diagnose needs only the drafts

    @property
    def attention_backend(self) -> str:
        if self.attention == "auto":
            return "flex" if str(self.device).startswith("cuda") else "blockwise"
        return self.attention


@dataclass
class AnchorTensors:
    """Per-anchor results of one sample; A anchors, L = block_size - 1 draft positions.
    Entries past an anchor's (possibly truncated) block or past the known response are -1
    (token ids), NaN (floats) or NOT_IN_TREE (pop indices)."""

    anchors: torch.Tensor  # [A] absolute positions of the block's first token
    block_len: torch.Tensor  # [A]
    draft_tokens: torch.Tensor  # [A, L] drafter argmax
    target_tokens: torch.Tensor  # [A, L] stored (greedy) tokens, -1 where unknown
    target_logprob: torch.Tensor  # [A, L] log q_k(y_k)
    sampled_logprob: torch.Tensor  # [A, L] log q_k(y_k) under the shards' sampling settings (NaN when greedy)
    kl_topk: torch.Tensor  # [A, L] KL(target || draft) on the stored top-k support
    tree_pop_index: torch.Tensor  # [A, L] DDTree pop index of the target-path prefix of depth k
    computed: torch.Tensor  # [A] bool: scored (all True in all-anchor mode; walk mode scores visited anchors)
    nonfinite: torch.Tensor  # [A] bool: the drafter's logits held NaN/Inf there (the sample is not scored)


def prepare_target_head(head: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The stored target head as replay uses it, on `device`: the lm_head cast once to the
    compute dtype; the embedding kept in the narrower of its stored dtype and the compute dtype,
    because replay only gathers a block's rows and casts those (a cast is elementwise, so the
    values equal those of a cast table). With bf16 shards scored in fp32 that
    halves the embedding's memory; the caller drops the stored-dtype lm_head, so only its
    compute-dtype copy stays."""
    embed, lm_head = head["embed_tokens"], head["lm_head"]
    if embed.element_size() >= torch.empty((), dtype=dtype).element_size():
        embed = embed.to(dtype=dtype)
    return {"embed_tokens": embed.to(device=device), "lm_head": lm_head.to(device=device, dtype=dtype)}


def select_feature_columns(
    features: torch.Tensor, stored_layer_ids: list[int], drafter_layer_ids: list[int]
) -> torch.Tensor:
    """Stored features are concatenated per layer in manifest order; pick the drafter's layers
    in the drafter's order. [N, n_stored*H] -> [N, n_drafter*H]."""
    if list(stored_layer_ids) == list(drafter_layer_ids):
        return features
    n = len(stored_layer_ids)
    per_layer = features.view(features.shape[0], n, -1)
    index = torch.tensor([stored_layer_ids.index(i) for i in drafter_layer_ids])
    return per_layer[:, index].reshape(features.shape[0], -1)


def anchors_per_chunk(drafter: DFlashDrafter, block_len: int, ctx_len: int, vocab: int, memory_bytes: int) -> int:
    """How many anchors fit the working-memory budget: logits and their float copies
    (~4 x L x V floats) plus attention scores (~3 x heads x b x (T + b) floats) per anchor."""
    cfg = drafter.config
    per_anchor = 4 * 4 * (block_len - 1) * vocab
    per_anchor += 3 * 4 * cfg.num_attention_heads * block_len * (ctx_len + block_len)
    per_anchor += 8 * 4 * block_len * max(cfg.intermediate_size, cfg.hidden_size)
    return max(1, int(memory_bytes // per_anchor))


def attended_keys(options: ReplayOptions, ctx_len: int) -> int:
    """Context keys one anchor's attention holds scores for at once: all of them on the dense
    path, one key chunk on the blockwise path (the flex kernel tiles them too)."""
    return ctx_len if options.attention_backend == "dense" else min(ctx_len, KEY_CHUNK)


def chunk_anchors(drafter: DFlashDrafter, block_len: int, ctx_len: int, vocab: int, options: ReplayOptions) -> int:
    """Anchors per chunk as `replay_anchors` runs them over a context of ctx_len keys."""
    return anchors_per_chunk(drafter, block_len, attended_keys(options, ctx_len), vocab, options.memory_bytes)


@dataclass
class PackedSamples:
    """Samples laid end to end, so one drafter call can serve anchors of several samples
    (walk replay batches the current anchor of many samples). Sample s occupies positions
    starts[s] .. starts[s] + lengths[s] - 1 of the token ids and of the drafter context."""

    ids: torch.Tensor  # [sum N] token ids
    starts: torch.Tensor  # [S]
    lengths: torch.Tensor  # [S]
    prompt_lens: torch.Tensor  # [S]
    topk_ids: torch.Tensor  # [sum (R + 1), k]
    topk_logprobs: torch.Tensor  # [sum (R + 1), k]
    topk_starts: torch.Tensor  # [S]
    context: list  # per drafter layer (k, v) [kv_heads, sum N, d]
    # [S] first position of each sample whose context keys/values held NaN/Inf (then zeroed, see
    # finite_context); N when none. An anchor that sees it is reported as non-finite.
    nonfinite_from: torch.Tensor | None = None


MIN_CONTEXT_ROWS = 512
# A budget-sized step (~2.7k positions at 27B widths in fp32) made the pass's working set depend
# on T below that size: a 2048-token sample ran in one step, an 8192-token one in steps of 2.7k
# (bench section `memory`); smaller steps cost little, the pass being ~1% of scoring (section `gemm`).
MAX_CONTEXT_ROWS = 1024


def context_rows(drafter: DFlashDrafter, feature_width: int, dtype: torch.dtype, memory_bytes: int) -> int:
    """Positions per step of the context pass (`DFlashDrafter.context_kv`), so that one step's
    features cast to the compute dtype, fc / hidden_norm outputs and a layer's keys / values
    before RoPE (~feature_width + 4 x hidden + 4 x kv width values a position) take at most a
    quarter of the memory budget: a long sample never holds a compute-dtype copy of all its
    features (at 27B shapes in fp32, 100 KiB a token, twice the bf16 features themselves). At
    least MIN_CONTEXT_ROWS, so the GEMMs keep large shapes, and at most MAX_CONTEXT_ROWS."""
    cfg = drafter.config
    values = feature_width + 4 * cfg.hidden_size + 4 * cfg.num_key_value_heads * cfg.head_dim
    per_row = torch.empty((), dtype=dtype).element_size() * values
    return min(MAX_CONTEXT_ROWS, max(MIN_CONTEXT_ROWS, int(memory_bytes // 4 // per_row)))


def pack_samples(
    drafter: DFlashDrafter, samples: list[Sample], feature_columns, options: ReplayOptions
) -> PackedSamples:
    """Context keys/values of every layer, computed once per sample (RoPE on positions within
    the sample) and concatenated."""
    device, dtype = options.device, options.dtype
    contexts, nonfinite_from = [], []
    for s in samples:
        features = feature_columns(s.features)
        rows = context_rows(drafter, features.shape[-1], dtype, options.memory_bytes)
        with timing.stage("context keys/values", tokens=features.shape[0]):
            context, first_bad = finite_context(drafter.context_kv(features, dtype=dtype, chunk_rows=rows))
        contexts.append(context)
        nonfinite_from.append(s.input_ids.numel() if first_bad is None else first_bad)
    context = []
    for layer in range(len(drafter.layers)):  # contiguous [kv_heads, sum N, d]; each input freed once used
        parts = [c[layer] for c in contexts]
        for c in contexts:
            c[layer] = None
        context.append(
            tuple(
                torch.cat([p[i] for p in parts], dim=1) if len(parts) > 1 else parts[0][i].contiguous() for i in (0, 1)
            )
        )
        del parts
    lengths = torch.tensor([s.input_ids.numel() for s in samples], device=device)
    rows = torch.tensor([s.topk_ids.shape[0] for s in samples], device=device)
    return PackedSamples(
        ids=torch.cat([s.input_ids for s in samples]).to(device, non_blocking=True),
        starts=torch.cumsum(lengths, 0) - lengths,
        lengths=lengths,
        prompt_lens=torch.tensor([s.prompt_len for s in samples], device=device),
        topk_ids=torch.cat([s.topk_ids for s in samples]).to(device, non_blocking=True),
        topk_logprobs=torch.cat([s.topk_logprobs for s in samples]).to(device, non_blocking=True),
        topk_starts=torch.cumsum(rows, 0) - rows,
        context=context,
        nonfinite_from=torch.tensor(nonfinite_from, device=device),
    )


def finite_context(context: list) -> tuple[list, int | None]:
    """(context, first bad position or None): one sample's per-layer (k, v) [kv_heads, N, d] with
    the positions holding NaN/Inf (a drafter whose fc or norms overflow on these features)
    zeroed. Attention weighs a masked NaN value by zero, which is NaN, so left in place they
    would spoil anchors that never see them, other samples' too when samples are packed
    together (walk mode); zeroed, only the anchors that see them are reported (their logits are
    NaN in any exact computation). One reduction per layer; a copy only when something is bad."""
    bad = None
    for pair in context:
        for t in pair:
            rows = ~torch.isfinite(t.sum(dim=(0, 2), dtype=torch.float32))  # [N]; NaN/Inf anywhere in the row
            bad = rows if bad is None else bad | rows
    if bad is None or not bool(bad.any()):
        return context, None
    keep = bad[None, :, None]
    zeroed = [tuple(t.masked_fill(keep, 0) for t in pair) for pair in context]
    return zeroed, int(bad.nonzero()[0, 0])


def empty_anchor_tensors(sample: Sample, max_new_tokens: int, block_size: int) -> AnchorTensors:
    """Per-anchor tensors for every anchor of a sample, nothing computed yet."""
    anchors = torch.arange(sample.prompt_len, sample.input_ids.numel() - 1)
    A, L = anchors.numel(), block_size - 1
    return AnchorTensors(
        anchors=anchors,
        block_len=torch.clamp(sample.prompt_len + max_new_tokens - anchors, max=block_size),
        draft_tokens=torch.full((A, L), -1, dtype=torch.long),
        target_tokens=torch.full((A, L), -1, dtype=torch.long),
        target_logprob=torch.full((A, L), float("nan")),
        sampled_logprob=torch.full((A, L), float("nan")),
        kl_topk=torch.full((A, L), float("nan")),
        tree_pop_index=torch.full((A, L), NOT_IN_TREE, dtype=torch.long),
        computed=torch.zeros(A, dtype=torch.bool),
        nonfinite=torch.zeros(A, dtype=torch.bool),
    )


@torch.inference_mode()
def replay_anchors(
    drafter: DFlashDrafter,
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
    chunks = []  # (positions in `wanted`, block length)
    for block_len in block_lens.unique().tolist():
        group = torch.nonzero(block_lens == block_len).flatten()
        size = chunk_anchors(drafter, block_len, ctx_len, vocab, options)
        chunks += [(group[begin : begin + size], block_len) for begin in range(0, group.numel(), size)]
    # A sample's tail (the last block_size - 1 anchors, one block length each) makes chunks of
    # a few rows; alone, each would read the whole lm_head for them. They share one GEMM.
    is_small = [part.numel() * (block_len - 1) < SMALL_CHUNK_ROWS for part, block_len in chunks]
    batches = [[c] for c, small in zip(chunks, is_small) if not small]
    batches += _batches_of([c for c, small in zip(chunks, is_small) if small], SMALL_CHUNK_ROWS * 4)
    previous = None  # the last chunk, written once its DDTree pops are in (computed meanwhile)
    for batch in batches:
        on_device = [(sample_idx[p].to(options.device), anchors[p].to(options.device), b) for p, b in batch]
        logits = _batch_logits(drafter, embed, lm_head, packed, on_device, options)
        for (part, block_len), (idx, at, _), chunk_logits_ in zip(batch, on_device, logits):
            scored = _score_chunk(drafter, packed, idx, at, block_len, options, chunk_logits_)
            if previous is not None:
                _write_chunk(results, *previous)
            previous = (sample_idx[part], rows[part], block_len - 1, scored)
    if previous is not None:
        _write_chunk(results, *previous)


def _batches_of(chunks: list, rows: int) -> list[list]:
    """Consecutive runs of `chunks` holding about `rows` block rows each."""
    batches, current, count = [], [], 0
    for part, block_len in chunks:
        current.append((part, block_len))
        count += part.numel() * (block_len - 1)
        if count >= rows:
            batches, current, count = batches + [current], [], 0
    return batches + ([current] if current else [])


def _batch_logits(drafter, embed, lm_head, packed, chunks, options) -> list[torch.Tensor]:
    """Logits [a, block_len - 1, V] of each chunk (sample_idx, anchors, block_len): the drafter
    per chunk, then one lm_head GEMM over all their rows."""
    hidden = [chunk_hidden(drafter, embed, packed, idx, at, b, options) for idx, at, b in chunks]  # [a, d, H] each
    if len(hidden) == 1:
        return [drafter.logits(hidden[0], lm_head, options.conventions)]
    flat = torch.cat([h.reshape(-1, h.shape[-1]) for h in hidden])  # [sum a*d, H]
    logits = drafter.logits(flat[None], lm_head, options.conventions)[0]  # [sum a*d, V]
    sizes = [h.shape[0] * h.shape[1] for h in hidden]
    return [part.view(h.shape[0], h.shape[1], -1) for part, h in zip(logits.split(sizes), hidden)]


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
        out.nonfinite[r] = scored["nonfinite"][mine]
        out.computed[r] = True


def replay_sample(
    drafter: DFlashDrafter,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    sample: Sample,
    feature_columns,
    max_new_tokens: int,
    options: ReplayOptions,
) -> AnchorTensors:
    """Score every anchor of one sample (all-anchor mode). `feature_columns(features)` selects
    the drafter's layers; `max_new_tokens` is the max_new_tokens the online loop would run with."""
    result = empty_anchor_tensors(sample, max_new_tokens, drafter.config.block_size)
    if result.anchors.numel():
        packed = pack_samples(drafter, [sample], feature_columns, options)
        replay_anchors(
            drafter, embed, lm_head, packed, [result], [(0, r) for r in range(result.anchors.numel())], options
        )
    return result


def replay_walks(
    drafter: DFlashDrafter,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    samples: list[Sample],
    feature_columns,
    max_new_tokens: list[int],
    tree_nodes: list[int | None],
    is_stop: list[torch.Tensor],
    options: ReplayOptions,
) -> list[AnchorTensors]:
    """Walk-only mode: score just the anchors the simulated walks visit. One walk per (sample,
    method), a method being the chain (None) or a DDTree of n nodes; each round batches the
    current anchor of every unfinished walk (anchors shared between methods scored once)."""
    block_size = drafter.config.block_size
    results = [empty_anchor_tensors(s, b, block_size) for s, b in zip(samples, max_new_tokens)]
    packed = pack_samples(drafter, samples, feature_columns, options)
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
        accepted = metrics.accepted_len(out.draft_tokens[r], out.target_tokens[r], out.tree_pop_index[r], tree_nodes[m])
        anchor = out.anchors[r]
        return int(metrics.produced_tokens(accepted, anchor, samples[s].input_ids.numel(), next_stop[s][anchor])[0])

    starts = {(s, m): sample.prompt_len for s, sample in enumerate(samples) for m in range(len(tree_nodes))}
    walk_in_rounds(starts, lambda key, position: walk_finished(position, is_stop[key[0]]), score, produced)
    return results


def chunk_logits(drafter, embed, lm_head, packed: PackedSamples, sample_idx, anchors, block_len, options):
    """The drafter's logits [a, block_len - 1, V] for blocks [x_t, mask, ...] at `anchors` (each
    in its sample `sample_idx` of `packed`), under `options.conventions`."""
    hidden = chunk_hidden(drafter, embed, packed, sample_idx, anchors, block_len, options)
    return drafter.logits(hidden, lm_head, options.conventions)  # [a, depth, V]


def chunk_hidden(drafter, embed, packed: PackedSamples, sample_idx, anchors, block_len, options):
    """The drafter's final hidden states [a, block_len - 1, H] at the draft positions."""
    cfg, conventions = drafter.config, options.conventions
    starts = packed.starts[sample_idx]
    block_ids = torch.full((anchors.numel(), block_len), cfg.mask_token_id, dtype=torch.long, device=anchors.device)
    block_ids[:, 0] = packed.ids[starts + anchors]
    # The embedding may be kept in a narrower stored dtype (prepare_target_head): cast the
    # gathered rows, which gives the values of a cast table.
    embed_scale = cfg.scales(conventions)[0]
    block_embeds = torch.nn.functional.embedding(block_ids, embed).to(options.dtype) * embed_scale  # [a, b, H]
    # no anchor here sees context at or past this key
    visible_ctx = int((starts + anchors).max()) + conventions.context_offset
    chunk_context = [(k[:, :visible_ctx], v[:, :visible_ctx]) for k, v in packed.context]
    hidden = drafter(
        block_embeds,
        anchors,
        chunk_context,
        attention=options.attention_backend,
        ctx_starts=starts,
        conventions=conventions,
    )
    return hidden[:, 1:]


def _score_chunk(drafter, packed: PackedSamples, sample_idx, anchors, block_len, options, logits) -> dict:
    """From the drafter's logits [a, depth, V] of a chunk of anchors (each in its sample of
    `packed`): per-anchor draft tokens, target tokens, log q(target), KL on the stored top-k,
    DDTree pop indices (a Future: computed in the worker thread)."""
    device = anchors.device
    depth = block_len - 1
    starts, lengths = packed.starts[sample_idx], packed.lengths[sample_idx]
    logits, nonfinite = finite_logits(logits)
    if packed.nonfinite_from is not None:  # anchor t sees context 0 .. t - 1 + context_offset
        sees_bad = anchors + options.conventions.context_offset > packed.nonfinite_from[sample_idx]
        nonfinite = nonfinite | sees_bad
    draft = logits.argmax(dim=-1)

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

    One reduction over the chunk, allocating [a, L] only: a row's float32 sum is non-finite when
    the row holds NaN/Inf (also when finite logits sum past 3.4e38, ~2e33 each over 150k tokens:
    a drafter that far gone is worth the same report)."""
    nonfinite = ~torch.isfinite(logits.sum(dim=-1, dtype=torch.float32)).all(dim=-1)
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
