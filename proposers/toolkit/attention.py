"""The drafter's attention over [context ; block], three ways with one result.

- dense: explicit boolean masks (`block_masks`), the reference path and the others' yardstick;
- blockwise (CPU): context keys in chunks with a running softmax, only the key tiles an anchor
  can see (`blockwise_plan`, `blockwise_attention`);
- flex (CUDA): block-sparse flex_attention (`flex_block_mask`, `flex_block_attention`).

Shapes: queries q [A, heads, b, d] and block keys/values k, v [A, kv_heads, b, d] per anchor;
context keys/values ctx_k, ctx_v [kv_heads, T, d] shared by every anchor. Visibility is the
reference's `_attention_mask` over absolute positions (docs/anchors-and-blocks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class DenseMask(NamedTuple):
    ctx_visible: torch.Tensor  # [A, b, T] bool
    block_visible: torch.Tensor  # [b, m] bool: block query i sees block key k (m = b, or with_block_keys')


def block_masks(
    anchors: torch.Tensor,
    block_len: int,
    ctx_len: int,
    is_causal: bool,
    window: int | None,
    ctx_starts: torch.Tensor | None = None,
    context_offset: int = 0,
    both_ways: bool = True,
) -> DenseMask:
    """Visibility for blocks starting at `anchors` (positions within their sample) over a
    context of ctx_len keys, in which each anchor's sample starts at `ctx_starts` (0 when the
    context holds one sample; several samples are packed end to end for walk replay).

    As the reference's `_attention_mask` over absolute positions: context key at sample
    position p is visible to the query at q = anchor + i iff p < anchor (the drafter only sees
    context before its block) and, for sliding layers, q - p < window. Inside the block,
    full-attention layers are bidirectional; causal layers see k <= i; windowed layers
    |i - k| < window (or i - k when causal, or when not `both_ways`: llama.cpp's window). `context_offset`
    (Conventions) moves the context's end, and so the queries' place in the key sequence, to anchor + context_offset.
    """
    device = anchors.device
    i = torch.arange(block_len, device=device)
    starts = torch.zeros_like(anchors) if ctx_starts is None else ctx_starts
    ends = anchors + context_offset  # [A] first invisible context position
    pos = torch.arange(ctx_len, device=device)[None, None, :] - starts[:, None, None]  # key's sample position
    ctx_visible = (pos >= 0) & (pos < ends[:, None, None])
    if window is not None:
        query_pos = ends[:, None] + i[None, :]
        ctx_visible = ctx_visible & ((query_pos[:, :, None] - pos) < window)
    else:
        ctx_visible = ctx_visible.expand(len(anchors), block_len, ctx_len)
    return DenseMask(ctx_visible, block_visibility(block_len, is_causal, window, device, both_ways))


def block_visibility(
    block_len: int, is_causal: bool, window: int | None, device=None, both_ways: bool = True
) -> torch.Tensor:
    """[b, b] bool: block query i sees block key k (see `block_masks`); the diagonal always."""
    i = torch.arange(block_len, device=device)
    block_visible = torch.ones(block_len, block_len, dtype=torch.bool, device=device)
    rel = i[:, None] - i[None, :]  # query index - key index
    if is_causal:
        block_visible &= rel >= 0
    if window is not None:
        block_visible &= rel < window
        if not is_causal and both_ways:
            block_visible &= -rel < window
    return block_visible


def flex_block_mask(
    anchors: torch.Tensor,
    block_len: int,
    ctx_len: int,
    is_causal: bool,
    window: int | None,
    ctx_starts: torch.Tensor | None = None,
    context_offset: int = 0,
    both_ways: bool = True,
):
    """The same visibility as `block_masks` as one block-sparse flex_attention mask.

    All blocks of a chunk are laid out as one query sequence (anchor a, block index i at
    query a * b + i) over keys [context 0..T-1 ; every block's own keys]; a query sees the
    context before its anchor and its own block only, so most tiles are skipped.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    b, T = block_len, ctx_len
    W = window if window is not None else 1 << 30
    later = W if both_ways else 1 << 30  # how far past the query a bidirectional block key stays visible
    starts = torch.zeros_like(anchors) if ctx_starts is None else ctx_starts

    def visible(_batch, _head, q_idx, kv_idx):
        a, i = q_idx // b, q_idx % b
        t = anchors[a] + context_offset
        p = kv_idx - starts[a]  # the key's position within the anchor's sample
        ctx_ok = (p >= 0) & (p < t) & (t + i - p < W)
        j = kv_idx - T
        k = j % b
        blk_ok = (j // b == a) & (i - k < W)
        blk_ok = blk_ok & (k <= i) if is_causal else blk_ok & (k - i < later)
        return torch.where(kv_idx < T, ctx_ok, blk_ok)

    n = anchors.numel() * b
    return create_block_mask(
        visible, None, None, n, T + n, device=anchors.device, _compile=anchors.device.type == "cuda"
    )


_COMPILED_FLEX = None


def flex_block_attention(q, k, v, ctx_k, ctx_v, block_mask, scale):
    """Attention of every block of a chunk in one flex_attention call (GQA native).
    q [A, h, b, d]; k/v [A, kv, b, d]; ctx_k/ctx_v [kv, T, d] -> [A, h, b, d]."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    A, h, b, d = q.shape
    kv = k.shape[1]

    def flat(x):  # [A, n, b, d] -> [n, A*b, d]
        return x.transpose(0, 1).reshape(x.shape[1], A * b, d)

    keys = torch.cat([ctx_k, flat(k)], dim=1)[None]
    values = torch.cat([ctx_v, flat(v)], dim=1)[None]
    attend = flex_attention
    if q.is_cuda:  # the fused kernel needs compiling; eager flex (CPU tests) is a reference path
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
        attend = _COMPILED_FLEX
    out = attend(flat(q)[None], keys, values, block_mask=block_mask, scale=scale, enable_gqa=kv != h)
    return out[0].view(h, A, b, d).transpose(0, 1)


KEY_CHUNK = 1024  # at most this many context keys per step


TILE_ANCHORS = 32  # anchors per tile: rows = TILE_ANCHORS x (heads / kv_heads) x b per kv head


class KeyChunk(NamedTuple):
    c0: int  # keys [c0, c1) in sample positions
    c1: int
    hidden: torch.Tensor | None  # [a, 1, b or 1, c1 - c0] bool: keys a query does not see; None: it sees all


class ContextTile(NamedTuple):
    """The context attention of a few anchors of one sample (see `blockwise_plan`)."""

    rows: torch.Tensor  # [a] the anchors' indices in the chunk
    start: int  # the sample's first key in the (packed) context
    chunks: list[KeyChunk]


class BlockwisePlan(NamedTuple):
    tiles: list[ContextTile]  # anchors that see no context key are in none
    block_visible: torch.Tensor  # [b, m] bool: block query i sees block key k (m = b, or with_block_keys')


def blockwise_plan(
    anchors: torch.Tensor,
    block_len: int,
    ctx_len: int,
    is_causal: bool,
    window: int | None,
    ctx_starts: torch.Tensor | None = None,
    context_offset: int = 0,
    both_ways: bool = True,
    *,
    key_chunk: int = KEY_CHUNK,
    tile_anchors: int = TILE_ANCHORS,
) -> BlockwisePlan:
    """The same visibility as `block_masks` as work for `blockwise_attention`: the anchors,
    grouped by sample and sorted, in tiles of `tile_anchors`; per tile the chunks of at most
    `key_chunk` keys of its sample that some query of the tile sees (windowed layers: only the
    window's), each with its mask unless every query of the tile sees all of it. Masks are made
    here once per layer kind, not in every layer's attention."""
    starts = [0] * anchors.numel() if ctx_starts is None else ctx_starts.tolist()
    ends = (anchors + context_offset).tolist()  # first invisible context position per anchor
    tiles = []
    for rows in _anchor_runs(starts, ends, tile_anchors):
        start = starts[rows[0]]
        span = _TileSpan([ends[r] for r in rows], block_len, window, ctx_len - start)
        chunks = span.key_chunks(key_chunk)
        if chunks:
            tiles.append(_context_tile(rows, start, span, chunks, anchors.device))
    return BlockwisePlan(tiles, block_visibility(block_len, is_causal, window, anchors.device, both_ways))


def _anchor_runs(starts: list[int], ends: list[int], size: int) -> list[list[int]]:
    """Chunk rows grouped by sample and sorted by position, cut into runs of at most `size`:
    neighbouring anchors of one sample see nearly the same keys."""
    order = sorted(range(len(starts)), key=lambda r: (starts[r], ends[r]))
    runs: list[list[int]] = []
    for r in order:
        if runs and len(runs[-1]) < size and starts[runs[-1][0]] == starts[r]:
            runs[-1].append(r)
        else:
            runs.append([r])
    return runs


@dataclass
class _TileSpan:
    """The context keys (sample positions) the queries of one tile see: query i of an anchor
    ending at e sees e + i - window < p < e, and p >= 0 (`block_masks`)."""

    ends: list[int]
    block_len: int
    window: int | None
    limit: int  # keys of the sample in the context

    def first(self, end: int) -> int:
        """The lowest position any query of the anchor sees (its query 0's)."""
        return 0 if self.window is None else max(0, end - self.window + 1)

    def seen(self, c0: int, c1: int) -> bool:
        return any(self.first(e) < c1 and c0 < e for e in self.ends)

    def key_chunks(self, key_chunk: int) -> list[tuple[int, int, bool]]:
        """The keys some query sees in as few chunks of at most `key_chunk` as they need, of
        equal length (each chunk is a dozen tensor ops whatever its length), the unseen skipped;
        a chunk needs the mask unless every query of the tile sees all of it."""
        lo, hi = min(self.first(e) for e in self.ends), min(max(self.ends), self.limit)
        if hi <= lo:
            return []
        every_lo = 0 if self.window is None else max(self.ends) + self.block_len - self.window
        every_hi = min(self.ends)
        size = -(-(hi - lo) // -(-(hi - lo) // key_chunk))  # ceil(keys / ceil(keys / key_chunk))
        chunks = []
        for c0 in range(lo, hi, size):
            c1 = min(hi, c0 + size)
            if self.seen(c0, c1):
                chunks.append((c0, c1, not every_lo <= c0 < c1 <= every_hi))
        return chunks


def _context_tile(rows: list[int], start: int, span: _TileSpan, chunks, device) -> ContextTile:
    ends = torch.tensor(span.ends, device=device)
    keys = [KeyChunk(c0, c1, _hidden_keys(span, ends, c0, c1) if partial else None) for c0, c1, partial in chunks]
    return ContextTile(torch.tensor(rows, device=device), start, keys)


def _hidden_keys(span: _TileSpan, ends: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
    """[a, 1, b or 1, c]: key p of [c0, c1) is hidden from query i of the anchor ending at e
    unless e + i - window < p < e (as `block_masks`); the 1 broadcasts over grouped heads."""
    p = torch.arange(c0, c1, device=ends.device)[None, None, :]  # the keys' sample positions
    visible = p < ends[:, None, None]  # [a, 1, c]
    if span.window is not None:
        i = torch.arange(span.block_len, device=ends.device)[None, :, None]
        visible = visible & (ends[:, None, None] + i - p < span.window)  # [a, b, c]
    return ~visible[:, None]


def blockwise_attention(q, k, v, ctx_k, ctx_v, plan: BlockwisePlan, scale: float) -> torch.Tensor:
    """Attention of every block of a chunk to [its visible context ; its own block], as `_dense`
    computes it, planned by `blockwise_plan`.
    q [A, h, b, d]; k/v [A, kv, b, d]; ctx_k/ctx_v [kv, T, d] -> [A, h, b, d]."""
    A, h, b, d = q.shape
    kv = k.shape[1]
    # Grouped-query attention as in `_dense`: the query heads of one kv group stacked along the
    # query axis (n = groups x b rows per kv head), no repeated keys.
    q = q.contiguous().view(A, kv, h // kv * b, d) * scale
    state = _context_state(q, ctx_k, ctx_v, plan, b)
    block_scores = (q @ k.transpose(-1, -2)).float()  # [A, kv, n, m]: m block keys (b, or with_block_keys')
    block_scores.view(A, kv, h // kv, b, -1).masked_fill_(~plan.block_visible, float("-inf"))
    # every query sees its own block position, so the total is > 0
    state = state.add(block_scores, v)
    return (state.acc / state.total[..., None]).to(q.dtype).view(A, h, b, d)


class _RunningSoftmax(NamedTuple):
    """A softmax per query over the keys added so far, in fp32: the highest score, the sum of
    exp(score - highest) and the values weighted by it; (-inf, 0, 0) before any key."""

    peak: torch.Tensor  # [..., rows]
    total: torch.Tensor  # [..., rows]
    acc: torch.Tensor  # [..., rows, d]

    @classmethod
    def empty(cls, rows: tuple[int, ...], d: int, device) -> _RunningSoftmax:
        like = {"dtype": torch.float32, "device": device}
        return cls(torch.full(rows, float("-inf"), **like), torch.zeros(rows, **like), torch.zeros(*rows, d, **like))

    @classmethod
    def of(cls, scores: torch.Tensor, values: torch.Tensor) -> _RunningSoftmax:
        """The state of keys with `scores` [..., rows, c] (fp32, overwritten) and `values` [..., c, d]
        alone: `empty().add(...)` in fewer tensor ops."""
        peak = scores.amax(-1)
        probs = _exp_below(scores, peak)
        return cls(peak, probs.sum(-1), _weighted(probs, values))

    def add(self, scores: torch.Tensor, values: torch.Tensor) -> _RunningSoftmax:
        """The state after more keys, as in `of`."""
        peak = torch.maximum(self.peak, scores.amax(-1))
        probs = _exp_below(scores, peak)
        decay = torch.exp(self.peak - _finite(peak))
        return _RunningSoftmax(
            peak, self.total * decay + probs.sum(-1), self.acc * decay[..., None] + _weighted(probs, values)
        )


def _finite(peak: torch.Tensor) -> torch.Tensor:
    """The shift of a row's scores: its peak, or the lowest finite float for a row that has seen
    no key yet (peak -inf), so that its exp() stay 0 rather than NaN (-inf - -inf)."""
    return peak.clamp(min=torch.finfo(peak.dtype).min)


def _exp_below(scores: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """exp(scores - peak) in place (scores [..., rows, c], peak [..., rows])."""
    return scores.sub_(_finite(peak)[..., None]).exp_()


def _weighted(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return (probs.to(values.dtype) @ values).float()


def _context_state(q, ctx_k, ctx_v, plan: BlockwisePlan, b: int) -> _RunningSoftmax:
    """The running softmax of every query q [A, kv, n, d] over its visible context keys, tile
    by tile; empty for a query that sees none."""
    A, kv, n, d = q.shape
    state = _RunningSoftmax.empty((A, kv, n), d, q.device)
    for tile in plan.tiles:
        for whole, part in zip(state, _tile_softmax(q[tile.rows], ctx_k, ctx_v, tile, b)):
            whole[tile.rows] = part
    return state


def _tile_softmax(q, ctx_k, ctx_v, tile: ContextTile, b: int) -> _RunningSoftmax:
    """`_context_state` of one tile's queries q [a, kv, n, d], chunk by chunk of its keys."""
    a, kv, n, d = q.shape
    rows = q.transpose(0, 1).reshape(kv, a * n, d)  # one query matrix per kv head
    state = None
    for c0, c1, hidden in tile.chunks:
        keys = slice(tile.start + c0, tile.start + c1)
        scores = (rows @ ctx_k[:, keys].transpose(-1, -2)).float()  # [kv, a * n, c]
        if hidden is not None:  # [kv, a * n, c] -> [kv, a, groups, b, c], broadcast with hidden
            scores.view(kv, a, n // b, b, c1 - c0).masked_fill_(hidden, float("-inf"))
        state = _RunningSoftmax.of(scores, ctx_v[:, keys]) if state is None else state.add(scores, ctx_v[:, keys])
    # [kv, a * n, ...] -> [a, kv, n, ...]
    return _RunningSoftmax(*(x.view(kv, a, n, *x.shape[2:]).transpose(0, 1) for x in state))


def dense_attention(q, k, v, ctx_k, ctx_v, mask: DenseMask, scale: float) -> torch.Tensor:
    """Softmax attention under explicit masks -> [A, heads, b, d]."""
    A, heads, b, d = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    q = q.contiguous().view(A, kv_heads, groups * b, d)
    ctx_visible, block_visible = mask
    # Grouped-query attention without materialising repeated keys: the query heads of
    # one kv group are stacked along the query axis.
    scores = torch.cat([q @ ctx_k.transpose(-1, -2), q @ k.transpose(-1, -2)], dim=-1) * scale
    visible = torch.cat([ctx_visible, block_visible.expand(A, *block_visible.shape)], dim=-1)  # [A, b, T+m]
    visible = visible[:, None, None].expand(A, 1, groups, b, visible.shape[-1]).reshape(A, 1, groups * b, -1)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    T = ctx_k.shape[-2]
    out = probs[..., :T] @ ctx_v + probs[..., T:] @ v  # [A, kv_heads, groups*b, d]
    return out.view(A, heads, b, d)


def attend(q, k, v, ctx_k, ctx_v, mask, scale: float) -> torch.Tensor:
    """The backend the mask was built for: a DenseMask, a BlockwisePlan or a flex BlockMask."""
    if isinstance(mask, DenseMask):
        return dense_attention(q, k, v, ctx_k, ctx_v, mask, scale)
    if isinstance(mask, BlockwisePlan):
        return blockwise_attention(q, k, v, ctx_k, ctx_v, mask, scale)
    return flex_block_attention(q, k, v, ctx_k, ctx_v, mask, scale)


def with_block_keys(mask: DenseMask | BlockwisePlan, keys: int) -> DenseMask | BlockwisePlan:
    """`mask`, built for blocks of one query, with `keys` block keys per anchor that the query sees
    all of: an autoregressive step attending to its own earlier steps at the same anchor beside the
    context (EAGLE-3's chain, the diagonal extension of speculators' training-time-test mask)."""
    rows = mask.block_visible.shape[0]
    return mask._replace(block_visible=torch.ones(rows, keys, dtype=torch.bool, device=mask.block_visible.device))


# --attention name -> the mask (or plan) its backend takes, built once per layer kind.
MASK_BUILDERS = {"dense": block_masks, "flex": flex_block_mask, "blockwise": blockwise_plan}
