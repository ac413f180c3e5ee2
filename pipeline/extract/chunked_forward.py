"""The capture forward over windows of positions: the target's own decoder layers run on a fixed
number of rows at a time, so the forward's working set stops growing with the sequence length.

Everything in a decoder layer is per position (norms, projections, MLP, residual adds) except
attention. While `windowed_forward` is active, each full-attention layer runs window by window:
its attention (`window_attention`, registered with transformers as ATTENTION) writes the window's
keys and values into the layer's store over all T positions and attends over all T of them under
a causal mask; the window's output then overwrites the layer's input rows (their keys and values
are stored, nothing reads them again), so the residual stream stays one [T, H] tensor. Other
layers (linear attention, mixture of experts, ...) run over all positions at once, a dense MLP in
them window by window; the final norm runs window by window in place.

What still grows with T: the residual stream [T, H], the rotary cos/sin [T, head_dim], one layer's
key/value store [kv_heads, T, head_dim] x 2 and one window's mask [rows, T].

Exact, i.e. the values equal a plain single-sequence forward bit for bit, because of two
properties of the CPU kernels (checked by tests/pipeline/extract/test_chunked_forward.py):
  - per-position work gives each row the same bits whatever the number of rows M, as long as
    M is not tiny (CPU BLAS rounds fp32 GEMMs of a few rows differently); every window therefore
    has the same size, at least MIN_WINDOW_ROWS (see row_windows);
  - CPU SDPA under a causal mask over all T keys equals its is_causal path, while over a shorter
    key range it does not: hence a store of T rows. Keys not yet computed are zeros, masked out.
CUDA kernels are chosen by shape (cuBLAS heuristics, SDPA backends), so other devices, and
targets outside these assumptions (eager attention, sliding windows), run the plain forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION = "specreplay_windows"
# CPU BLAS switches to a different kernel for GEMMs with few rows, whose float rounding then
# differs from a full forward's (the lm_head windows share this floor).
MIN_WINDOW_ROWS = 64
# The memory budget only bounds a window; beyond a few hundred rows a bigger one buys little
# GEMM speed and lets the working set keep growing with T up to its size.
MAX_FORWARD_ROWS = 512
# Children a decoder layer may have for its windows to be exact: attention is the only module
# that mixes positions, and the attention function sees every call.
_WINDOWABLE_CHILDREN = {
    "self_attn",
    "mlp",
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
}
# Keyword arguments of a decoder layer cut to a window, by the dimension that holds positions.
_POSITION_DIM = {"position_embeddings": -2, "position_ids": -1, "cache_position": -1}


def row_windows(lo: int, hi: int, total: int, rows: int) -> list[tuple[int, int, int]]:
    """(start, end, keep_from) windows that cover rows lo..hi-1 of a sequence of `total` rows.

    Every window has exactly `rows` rows (or all `total` rows when the sequence is shorter):
    the last window is shifted back to overlap its neighbour, and a short range is widened into
    the prompt. Matmuls of one fixed shape round exactly like the full forward's on CPU BLAS,
    while a 3-row tail GEMM does not; the overlap costs at most one extra window per sample.
    Rows below `keep_from` in a window were already produced and are dropped.
    """
    size = min(rows, total)
    windows, start = [], lo
    while start < hi:
        end = min(start + size, hi)
        begin = max(0, end - size) if end - start < size else start
        windows.append((begin, end, start))
        start = end
    return windows


def forward_rows(config, budget_bytes: int, itemsize: int, total: int) -> int:
    """Rows per forward window so that one window's working set fits `budget_bytes` (a rough
    upper bound per row: the MLP's gate, up and product, attention's query-sized tensors
    through norm, rotary and output, float32 norm copies of the hidden state, the mask row)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    heads_width = heads * (getattr(config, "head_dim", None) or hidden // heads)
    mlp_width = getattr(config, "intermediate_size", None) or 4 * hidden
    per_row = itemsize * (3 * mlp_width + 6 * heads_width + total) + 12 * max(hidden, heads_width)
    return int(min(MAX_FORWARD_ROWS, max(MIN_WINDOW_ROWS, budget_bytes // per_row)))


# ---------------------------------------------------------------------------------------------
# attention over windows


@dataclass
class _Window:
    """The window a windowed layer is running, and its attention modules' key/value stores."""

    total: int
    begin: int = 0
    end: int = 0
    stores: dict = field(default_factory=dict)  # attention module -> (keys, values) [B, kv_heads, T, d]

    def store(self, module, key: torch.Tensor, value: torch.Tensor):
        """Write this window's keys/values [B, kv_heads, rows, d] into the module's store."""
        if module not in self.stores:  # zeros: masked keys must stay finite (0 * NaN is NaN)
            shape = (*key.shape[:2], self.total, key.shape[-1])
            self.stores[module] = (key.new_zeros(shape), value.new_zeros((*shape[:-1], value.shape[-1])))
        keys, values = self.stores[module]
        keys[:, :, self.begin : self.end] = key
        values[:, :, self.begin : self.end] = value
        return keys, values

    def mask(self, dtype: torch.dtype, device) -> torch.Tensor:
        """[rows, T] additive causal mask: row i (position begin + i) sees keys 0..begin + i."""
        positions = torch.arange(self.begin, self.end, device=device)[:, None]
        future = torch.arange(self.total, device=device)[None, :] > positions
        return torch.zeros(future.shape, dtype=dtype, device=device).masked_fill_(future, float("-inf"))


_active: list[_Window] = []  # the window of the layer now running (at most one)


def window_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """A transformers attention function (query [B, heads, rows, d], key/value [B, kv_heads,
    rows, d]; returns [B, rows, heads, d]). Outside a window it is transformers' sdpa; inside,
    the window's queries attend over the layer's whole key store under a causal mask."""
    if not _active:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    window = _active[-1]
    keys, values = window.store(module, key, value)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        keys,
        values,
        attn_mask=window.mask(query.dtype, query.device),
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=query.shape[1] != keys.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None  # [B, heads, rows, d] -> [B, rows, heads, d]


AttentionInterface.register(ATTENTION, window_attention)


# ---------------------------------------------------------------------------------------------
# running a module over windows


def _flush(out: torch.Tensor, pending) -> None:
    if pending is not None:
        keep, rows = pending
        out[..., keep : keep + rows.shape[-2], :] = rows


def run_windows(compute, total: int, rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., total, W] from `compute(begin, end)` -> [..., end - begin, W] over row_windows.

    Each window's rows are written one window late, so `out` may be the input itself: the last
    window, which overlaps its neighbour, still reads that neighbour's input rows."""
    pending = None
    for begin, end, keep in row_windows(0, total, total, rows):
        fresh = compute(begin, end)[..., keep - begin :, :]
        if out is None:
            out = fresh.new_empty((*fresh.shape[:-2], total, fresh.shape[-1]))
        _flush(out, pending)
        pending = (keep, fresh)
    _flush(out, pending)
    return out


def _narrow(value, dim: int, begin: int, end: int, total: int):
    """`value` (a tensor or a tuple of them) cut to positions begin..end, or None if it cannot be."""
    if isinstance(value, (tuple, list)):
        parts = [_narrow(v, dim, begin, end, total) for v in value]
        return None if any(p is None for p in parts) else type(value)(parts)
    if isinstance(value, torch.Tensor) and value.dim() >= -dim and value.shape[dim] == total:
        return value.narrow(dim, begin, end - begin)
    return None


def window_kwargs(kwargs: dict, begin: int, end: int, total: int) -> dict | None:
    """A decoder layer's keyword arguments for positions begin..end, or None when one of them
    cannot be cut (a mask, a cache, anything of unknown layout): the layer then runs whole."""
    out = {}
    for name, value in kwargs.items():
        if name in _POSITION_DIM and value is not None:
            value = _narrow(value, _POSITION_DIM[name], begin, end, total)
            if value is None:
                return None
        elif value is not None and not isinstance(value, (bool, int, float, str)):
            return None
        out[name] = value
    return out


def per_position(forward, rows: int, in_place: bool = False):
    """`forward` (a per-position module's: [..., T, H] -> [..., T, W]) run window by window."""

    def windowed(x):
        total = x.shape[-2]
        if total <= rows:
            return forward(x)
        return run_windows(lambda b, e: forward(x[..., b:e, :]), total, rows, x if in_place else None)

    return windowed


def windowed_layer(forward, rows: int):
    """A full-attention decoder layer's forward, run window by window in place (see the module
    docstring); whole when the sequence fits one window or an argument cannot be cut."""

    def layer_forward(hidden_states, *args, **kwargs):
        total = hidden_states.shape[1]
        if args or total <= rows or window_kwargs(kwargs, 0, total, total) is None:
            return forward(hidden_states, *args, **kwargs)
        window = _Window(total)

        def compute(begin, end):
            window.begin, window.end = begin, end
            out = forward(hidden_states[:, begin:end], **window_kwargs(kwargs, begin, end, total))
            if not isinstance(out, torch.Tensor):  # transformers 5 layers return the hidden states alone
                raise TypeError(f"a decoder layer returned {type(out).__name__}, windows need a tensor")
            return out

        _active.append(window)
        try:
            return run_windows(compute, total, rows, hidden_states)
        finally:
            _active.remove(window)

    return layer_forward


def whole_layer(forward):
    """Another layer's forward, over all positions, its output written back into its input so
    that the decoder's first input (the embeddings) does not stay alive beside the stream."""

    def layer_forward(hidden_states, *args, **kwargs):
        out = forward(hidden_states, *args, **kwargs)
        if isinstance(out, torch.Tensor) and out.shape == hidden_states.shape and out.dtype == hidden_states.dtype:
            return hidden_states.copy_(out)
        return out

    return layer_forward


# ---------------------------------------------------------------------------------------------
# which modules, and the context manager


def dense_mlp(module) -> bool:
    """A per-position MLP: Linear layers and parameter-free activations only (not a mixture of
    experts, whose expert GEMMs change size with the window)."""
    if module is None:
        return False
    # a child without parameters (next(), not any(): any() would ask each weight tensor for its truth)
    return all(isinstance(c, torch.nn.Linear) or next(c.parameters(), None) is None for c in module.children())


def attention_layer(layer, kind: str) -> bool:
    """Whether windows of `layer` are exact: full causal attention is the only position mixer."""
    children = {name for name, _ in layer.named_children()}
    attention = getattr(layer, "self_attn", None)
    return (
        kind == "full_attention"
        and children <= _WINDOWABLE_CHILDREN
        and attention is not None
        and getattr(attention, "sliding_window", None) is None
        and dense_mlp(getattr(layer, "mlp", None))
    )


def windowable(decoder, device: torch.device) -> bool:
    """The model-wide conditions: CPU kernels, sdpa attention, no sliding-window layer."""
    config = decoder.config
    kinds = getattr(config, "layer_types", None) or []
    return (
        device.type == "cpu"
        and config._attn_implementation == "sdpa"
        and "sliding_attention" not in kinds
        and not any(getattr(m, "sliding_window", None) for m in decoder.modules())
    )


def layer_forwards(decoder, layers, rows: int) -> dict:
    """{module: its windowed forward} for every layer, the dense MLPs of layers that run whole,
    and the final norm."""
    kinds = getattr(decoder.config, "layer_types", None) or ["full_attention"] * len(layers)
    out = {}
    for layer, kind in zip(layers, kinds):
        if attention_layer(layer, kind):
            out[layer] = windowed_layer(layer.forward, rows)
            continue
        out[layer] = whole_layer(layer.forward)
        mlp = getattr(layer, "mlp", None)
        if dense_mlp(mlp):
            out[mlp] = per_position(mlp.forward, rows)
    norm = getattr(decoder, "norm", None)
    if isinstance(norm, torch.nn.Module):
        out[norm] = per_position(norm.forward, rows, in_place=True)
    return out


@contextmanager
def windowed_forward(decoder, layers, rows: int, device: torch.device):
    """While active, `decoder(...)` over one unpadded sequence longer than `rows` runs its layers
    over windows of `rows` positions (see the module docstring); rows 0: the plain forward.

    Replaces the modules' `forward` attributes and the text config's attention implementation,
    and restores both on exit, error or not."""
    if rows <= 0 or not windowable(decoder, device):
        yield
        return
    config = decoder.config
    replaced = layer_forwards(decoder, layers, rows)
    saved = {module: module.__dict__.get("forward") for module in replaced}  # accelerate hooks set one
    implementation = config._attn_implementation
    try:
        for module, forward in replaced.items():
            module.forward = forward
        config._attn_implementation = ATTENTION
        yield
    finally:
        config._attn_implementation = implementation
        for module, forward in saved.items():
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
