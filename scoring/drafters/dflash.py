"""The DFlash drafter (z-lab `DFlashDraftModel` semantics), written for batched replay.

Same weights and key names as the reference: `fc`, `hidden_norm`, `norm`,
`layers.{i}.self_attn.{q,k,v,o}_proj`, `layers.{i}.self_attn.{q,k}_norm`,
`layers.{i}.mlp.{gate,up,down}_proj`, `layers.{i}.{input,post_attention}_layernorm`.

The drafter has no embedding and no lm_head of its own: block inputs are the target's input
embeddings (times `input_embedding_scale`), logits come from the target's lm_head (times
`output_multiplier`, then optional tanh soft-capping).

Why a re-implementation instead of calling the reference module: the reference runs one block
at a time against a growing KV cache. Replay scores every response position as an anchor, so
here the context keys/values (a function of the target features alone: `k_proj(hidden_norm(
fc(features)))` per layer) are computed once per sample and shared by a batch of anchors, each
of which sees only the context before it. Norms, MLP and RoPE are transformers' Qwen3 modules,
the same ones the reference uses, so the arithmetic matches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from pipeline.common import timing
from pipeline.common.errors import UserError
from pipeline.common.layer_ids import build_target_layer_ids
from scoring.drafters.conventions import REFERENCE, Conventions

# Fields the DFlash family uses that this implementation does not; a config carrying any of
# them is a variant we refuse by name rather than score wrong.
UNSUPPORTED_VARIANT_FIELDS = {
    "conv_kernel_size": "DFlash2 (grouped dynamic convolutions)",
    "conv_group_size": "DFlash2 (grouped dynamic convolutions)",
    "selector_rank": "DFlash2 (candidate selector)",
    "selector_top_k": "DFlash2 (candidate selector)",
}
SUPPORTED_ARCHITECTURES = {"DFlashDraftModel"}


class DrafterConfigError(UserError):
    """A drafter config this implementation cannot score exactly."""


@dataclass
class DrafterConfig:
    """What the replay needs to know about a drafter (parsed from its config.json)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None
    layer_types: list[str]
    sliding_window: int | None
    is_causal: bool | None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    attention_bias: bool = False
    raw: dict = field(default_factory=dict, repr=False)

    def layer_is_causal(self, index: int) -> bool:
        """As the reference: sliding layers are causal unless `is_causal` overrides all layers."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[index] == "sliding_attention"

    def layer_window(self, index: int) -> int | None:
        return self.sliding_window if self.layer_types[index] == "sliding_attention" else None

    def layer_mask_kind(self, index: int, conventions: Conventions = REFERENCE) -> tuple[bool, int | None]:
        """(causal inside the block, sliding window or None) of layer `index` under `conventions`."""
        window = {"configured": self.layer_window(index), "none": None, "everywhere": self.sliding_window}
        return self.layer_is_causal(index) or conventions.causal_block, window[conventions.window]

    def scales(self, conventions: Conventions = REFERENCE) -> tuple[float, float, float | None]:
        """(input_embedding_scale, output_multiplier, final_logit_softcapping) under `conventions`."""
        if conventions.neutral_scales:
            return 1.0, 1.0, None
        return self.input_embedding_scale, self.output_multiplier, self.final_logit_softcapping

    @property
    def has_scales(self) -> bool:
        """Whether any scale differs from its neutral value (the `scales` diagnose variant)."""
        return self.scales() != (1.0, 1.0, None)


def _dflash_value(raw: dict, name: str, default=None):
    """The reference reads `dflash_config[name]` first, then the top-level field."""
    return (raw.get("dflash_config") or {}).get(name, raw.get(name, default))


def check_supported(raw: dict, source: str) -> None:
    """Refuse architectures and variants this implementation would score wrong, and configs
    missing the fields every DFlash drafter has."""
    for arch in raw.get("architectures") or ["DFlashDraftModel"]:
        if arch not in SUPPORTED_ARCHITECTURES:
            raise DrafterConfigError(
                f"{source}: architecture {arch!r} is not supported (specreplay implements "
                f"{sorted(SUPPORTED_ARCHITECTURES)}); refusing rather than scoring it wrong"
            )
    for name, variant in UNSUPPORTED_VARIANT_FIELDS.items():
        if _dflash_value(raw, name) is not None:
            raise DrafterConfigError(
                f"{source}: field {name!r} belongs to the {variant} variant, which specreplay does not "
                f"implement; refusing rather than scoring it wrong"
            )
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if name not in raw:
            raise DrafterConfigError(f"{source}: missing field {name!r}; is this a DFlash drafter config.json?")
    if _dflash_value(raw, "mask_token_id") is None:
        raise DrafterConfigError(f"{source}: missing dflash_config.mask_token_id")


def feature_layer_ids(raw: dict, source: str) -> list[int]:
    """dflash_config.target_layer_ids, else the DFlash formula over num_target_layers."""
    layer_ids = _dflash_value(raw, "target_layer_ids")
    if layer_ids is not None:
        return [int(i) for i in layer_ids]
    if raw.get("num_target_layers") is None:
        raise DrafterConfigError(
            f"{source}: neither dflash_config.target_layer_ids nor num_target_layers is set, so the "
            f"feature layers are unknown"
        )
    return build_target_layer_ids(int(raw["num_target_layers"]), int(raw["num_hidden_layers"]))


def attention_layout(raw: dict, source: str) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) as the reference sees them: through Qwen3Config, which
    drops `sliding_window` unless `use_sliding_window` is true and derives missing layer_types."""
    num_layers = int(raw["num_hidden_layers"])
    try:
        hf = _hf_config_from_raw(raw)
    except (TypeError, ValueError) as error:
        raise DrafterConfigError(f"{source}: not a valid Qwen3-style config ({error})") from error
    layer_types = list(hf.layer_types or ["full_attention"] * num_layers)
    if len(layer_types) != num_layers:
        raise DrafterConfigError(f"{source}: layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise DrafterConfigError(f"{source}: layer_types {unknown} not supported (full_attention, sliding_attention)")
    if "sliding_attention" in layer_types and not hf.sliding_window:
        raise DrafterConfigError(
            f"{source}: layer_types has sliding_attention but the effective sliding_window is unset "
            f"(sliding_window={raw.get('sliding_window')!r}, use_sliding_window={raw.get('use_sliding_window')!r}; "
            f"Qwen3Config drops the window unless use_sliding_window is true, and the reference cannot run "
            f"such a drafter). Set use_sliding_window: true and sliding_window in config.json"
        )
    return layer_types, None if hf.sliding_window is None else int(hf.sliding_window)


def parse_drafter_config(raw: dict, source: str = "config") -> DrafterConfig:
    """Validate and parse a z-lab DFlash config dict; errors name the field and the file."""
    check_supported(raw, source)
    layer_types, sliding_window = attention_layout(raw, source)
    softcap = _dflash_value(raw, "final_logit_softcapping")
    heads = int(raw["num_attention_heads"])
    num_target_layers = raw.get("num_target_layers")
    return DrafterConfig(
        hidden_size=int(raw["hidden_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        intermediate_size=int(raw["intermediate_size"]),
        vocab_size=int(raw["vocab_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        block_size=int(_dflash_value(raw, "block_size", 16)),
        mask_token_id=int(_dflash_value(raw, "mask_token_id")),
        target_layer_ids=feature_layer_ids(raw, source),
        num_target_layers=None if num_target_layers is None else int(num_target_layers),
        layer_types=layer_types,
        sliding_window=sliding_window,
        is_causal=raw.get("is_causal"),
        input_embedding_scale=float(_dflash_value(raw, "input_embedding_scale", 1.0)),
        output_multiplier=float(_dflash_value(raw, "output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap is None or float(softcap) <= 0 else float(softcap),
        attention_bias=bool(raw.get("attention_bias", False)),
        raw=raw,
    )


def _hf_config_from_raw(raw: dict) -> Qwen3Config:
    """The Qwen3Config the reference builds from config.json (drives RoPE, the MLP activation,
    the effective sliding window and default layer types)."""
    return Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "dflash_config")})


def _hf_config(config: DrafterConfig) -> Qwen3Config:
    hf = _hf_config_from_raw(config.raw)
    hf.head_dim = config.head_dim
    return hf


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, T, d] with cos/sin [..., T, d] (broadcast over heads)."""
    return x * cos.unsqueeze(-3) + rotate_half(x) * sin.unsqueeze(-3)


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        d, bias = config.head_dim, config.attention_bias
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(config.hidden_size, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., T, H] -> roped, normed keys and values [..., kv_heads, T, d]."""
        shape = (*x.shape[:-1], self.kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(-2, -3)
        v = self.v_proj(x).view(shape).transpose(-2, -3)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """Block queries attend to [context ; block].

        x [A, b, H]; cos/sin [A, b, d]; ctx_k/ctx_v [kv_heads, T, d] shared by all anchors;
        mask is a `DenseMask` (explicit boolean masks, the reference path), a `BlockwisePlan`
        (context keys in chunks, CPU) or a flex_attention BlockMask (CUDA).
        """
        A, b, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(A, b, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)  # [A, kv_heads, b, d]
        with timing.stage("attention"):
            if isinstance(mask, DenseMask):
                out = self._dense(q, k, v, ctx_k, ctx_v, mask)
            elif isinstance(mask, BlockwisePlan):
                out = blockwise_attention(q, k, v, ctx_k, ctx_v, mask, self.head_dim**-0.5)
            else:
                out = flex_block_attention(q, k, v, ctx_k, ctx_v, mask, self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(A, b, -1))

    def _dense(self, q, k, v, ctx_k, ctx_v, mask: "DenseMask"):
        A, _, b, _ = q.shape
        groups = self.heads // self.kv_heads
        q = q.contiguous().view(A, self.kv_heads, groups * b, self.head_dim)
        ctx_visible, block_visible = mask
        scale = self.head_dim**-0.5
        # Grouped-query attention without materialising repeated keys: the query heads of
        # one kv group are stacked along the query axis.
        scores = torch.cat([q @ ctx_k.transpose(-1, -2), q @ k.transpose(-1, -2)], dim=-1) * scale
        visible = torch.cat([ctx_visible, block_visible.expand(A, b, b)], dim=-1)  # [A, b, T+b]
        visible = visible[:, None, None].expand(A, 1, groups, b, visible.shape[-1]).reshape(A, 1, groups * b, -1)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        T = ctx_k.shape[-2]
        out = probs[..., :T] @ ctx_v + probs[..., T:] @ v  # [A, kv_heads, groups*b, d]
        return out.view(A, self.heads, b, self.head_dim)


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig, hf_config: Qwen3Config):
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = Qwen3MLP(hf_config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DenseMask(NamedTuple):
    ctx_visible: torch.Tensor  # [A, b, T] bool
    block_visible: torch.Tensor  # [b, b] bool


def block_masks(
    anchors: torch.Tensor,
    block_len: int,
    ctx_len: int,
    is_causal: bool,
    window: int | None,
    ctx_starts: torch.Tensor | None = None,
    context_offset: int = 0,
) -> DenseMask:
    """Visibility for blocks starting at `anchors` (positions within their sample) over a
    context of ctx_len keys, in which each anchor's sample starts at `ctx_starts` (0 when the
    context holds one sample; several samples are packed end to end for walk replay).

    As the reference's `_attention_mask` over absolute positions: context key at sample
    position p is visible to the query at q = anchor + i iff p < anchor (the drafter only sees
    context before its block) and, for sliding layers, q - p < window. Inside the block,
    full-attention layers are bidirectional; causal layers see k <= i; windowed layers
    |i - k| < window (or i - k when causal). `context_offset` (Conventions) moves the context's
    end, and so the queries' place in the key sequence, to anchor + context_offset.
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
    return DenseMask(ctx_visible, block_visibility(block_len, is_causal, window, device))


def block_visibility(block_len: int, is_causal: bool, window: int | None, device=None) -> torch.Tensor:
    """[b, b] bool: block query i sees block key k (see `block_masks`); the diagonal always."""
    i = torch.arange(block_len, device=device)
    block_visible = torch.ones(block_len, block_len, dtype=torch.bool, device=device)
    rel = i[:, None] - i[None, :]  # query index - key index
    if is_causal:
        block_visible &= rel >= 0
    if window is not None:
        block_visible &= rel < window
        if not is_causal:
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
):
    """The same visibility as `block_masks` as one block-sparse flex_attention mask.

    All blocks of a chunk are laid out as one query sequence (anchor a, block index i at
    query a * b + i) over keys [context 0..T-1 ; every block's own keys]; a query sees the
    context before its anchor and its own block only, so most tiles are skipped.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    b, T = block_len, ctx_len
    W = window if window is not None else 1 << 30
    starts = torch.zeros_like(anchors) if ctx_starts is None else ctx_starts

    def visible(_batch, _head, q_idx, kv_idx):
        a, i = q_idx // b, q_idx % b
        t = anchors[a] + context_offset
        p = kv_idx - starts[a]  # the key's position within the anchor's sample
        ctx_ok = (p >= 0) & (p < t) & (t + i - p < W)
        j = kv_idx - T
        k = j % b
        blk_ok = (j // b == a) & (i - k < W)
        blk_ok = blk_ok & (k <= i) if is_causal else blk_ok & (k - i < W)
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


# Blockwise attention (the CPU path): the context part of the blocks' attention is computed in
# tiles of neighbouring anchors of one sample, over chunks of only the keys they see, with a
# running softmax, then merged with each block's own keys. The dense path's masked fp32 scores
# [A, heads, b, T] over every key (and their copies) make its cost grow faster than its FLOPs
# with the context length T; here one step's scores are [kv, rows, KEY_CHUNK], a few MB.
# Sizes (bench section `length`, SmolLM2 shapes): smaller tiles and chunks keep the scores in
# cache but each chunk is a dozen tensor ops, and on a busy 2-core machine every op waits at an
# OpenMP barrier; these were the fastest of the sizes tried there, within its noise.

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
    block_visible: torch.Tensor  # [b, b] bool


def blockwise_plan(
    anchors: torch.Tensor,
    block_len: int,
    ctx_len: int,
    is_causal: bool,
    window: int | None,
    ctx_starts: torch.Tensor | None = None,
    context_offset: int = 0,
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
    return BlockwisePlan(tiles, block_visibility(block_len, is_causal, window, anchors.device))


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
    block_scores = (q @ k.transpose(-1, -2)).float()  # [A, kv, n, b]
    block_scores.view(A, kv, h // kv, b, b).masked_fill_(~plan.block_visible, float("-inf"))
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


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        hf = _hf_config(config)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config, hf) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(hf)  # buffers only, not in the state dict

    def rope(self, like: torch.Tensor, positions: torch.Tensor):
        """cos/sin [*positions.shape, d] in like's dtype."""
        flat = positions.reshape(1, -1)
        cos, sin = self.rotary(like, flat)
        return cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)

    def context_kv(
        self, features: torch.Tensor, dtype: torch.dtype | None = None, chunk_rows: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [kv_heads, T, d] of context positions 0..T-1 from target features [T, n*H].

        `features` may be in their stored dtype and on another device: they are moved and cast
        to `dtype` (default: their own) `chunk_rows` positions at a time (all at once when None
        or T <= chunk_rows), and each chunk goes through fc, hidden_norm and every layer's keys
        and values before the next, so a long sample never holds a cast copy of its features or
        its whole fc output, only the keys and values themselves. Every step acts on each
        position alone (RoPE of position p is the same in any batch), so chunking changes no
        value beyond the GEMMs' own rounding."""
        device = self.fc.weight.device
        dtype = dtype or features.dtype
        total = features.shape[0]
        if chunk_rows is None or total <= chunk_rows:
            ctx = self.hidden_norm(self.fc(features.to(device=device, dtype=dtype, non_blocking=True)))
            cos, sin = self.rope(ctx, torch.arange(total, device=device))
            return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]
        shape = (self.config.num_key_value_heads, total, self.config.head_dim)
        out = [
            (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            for _ in self.layers
        ]
        for start in range(0, total, chunk_rows):
            end = min(total, start + chunk_rows)
            ctx = self.hidden_norm(self.fc(features[start:end].to(device=device, dtype=dtype, non_blocking=True)))
            cos, sin = self.rope(ctx, torch.arange(start, end, device=device))
            for (keys, values), layer in zip(out, self.layers):
                k, v = layer.self_attn.keys_values(ctx, cos, sin)
                keys[:, start:end] = k
                values[:, start:end] = v
        return out

    def forward(
        self,
        block_embeds: torch.Tensor,
        anchors: torch.Tensor,
        context: list,
        attention: str = "dense",
        ctx_starts: torch.Tensor | None = None,
        conventions: Conventions = REFERENCE,
    ) -> torch.Tensor:
        """Drafter hidden states [A, b, H] (after the final norm) for blocks at `anchors`.

        block_embeds [A, b, H] are the (scaled) target embeddings of [x_anchor, mask, ...];
        `context` is `context_kv(features)`; each anchor sees only context before it.
        attention: "dense" (explicit boolean masks, the reference path), "blockwise" (context keys
        in chunks with a running softmax; CPU) or "flex" (block-sparse flex_attention; CUDA).
        ctx_starts: where each anchor's sample starts in a packed multi-sample context.
        conventions: the reference's (score) or one changed on purpose (diagnose).
        """
        with timing.stage("drafter layers", anchors=block_embeds.shape[0], block=block_embeds.shape[1]):
            return self._layers(block_embeds, anchors, context, attention, ctx_starts, conventions)

    def _layers(self, block_embeds, anchors, context, attention, ctx_starts, conventions) -> torch.Tensor:
        make_mask = {"dense": block_masks, "flex": flex_block_mask, "blockwise": blockwise_plan}[attention]
        A, b, _ = block_embeds.shape
        first = anchors + conventions.block_position_offset  # [A] the block's first position id
        positions = first[:, None] + torch.arange(b, device=anchors.device)[None, :]  # [A, b]
        cos, sin = self.rope(block_embeds, positions)
        ctx_len = context[0][0].shape[-2]
        masks = {}
        h = block_embeds
        for index, layer in enumerate(self.layers):
            kind = self.config.layer_mask_kind(index, conventions)
            if kind not in masks:
                with timing.stage("masks"):
                    masks[kind] = make_mask(anchors, b, ctx_len, *kind, ctx_starts, conventions.context_offset)
            ctx_k, ctx_v = context[index]
            h = layer(h, cos, sin, ctx_k, ctx_v, masks[kind])
        return self.norm(h)

    def logits(self, hidden: torch.Tensor, lm_head: torch.Tensor, conventions: Conventions = REFERENCE) -> torch.Tensor:
        """Target lm_head on drafter states, then output_multiplier and optional soft-capping."""
        # One [rows, H] x [H, V] GEMM: F.linear on a non-contiguous [a, L, H] view (the block
        # minus its first position) falls back to a slower batched matmul on CPU (bench/README.md).
        with timing.stage("lm_head", rows=hidden.shape[0] * hidden.shape[1]):
            logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]), lm_head)
        logits = logits.view(*hidden.shape[:-1], -1)
        _, multiplier, cap = self.config.scales(conventions)
        if multiplier != 1.0:
            logits = logits * multiplier
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
