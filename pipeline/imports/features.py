"""One captured sample -> the tensors a shard row stores, exactly as extract stores them
(pipeline/extract/capture.py has the table): features [N, n*H] in the stored ids' order (with fp8,
features_scale [N, n]), and the next-token top-k and argmax mismatches from the final hidden state
after the norm, through the target's own lm_head."""

from __future__ import annotations

import torch

from pipeline.common.dtypes import FP8, STORAGE_DTYPES
from pipeline.imports.checkpoint import TargetHead
from pipeline.imports.layers import POST, source_for
from pipeline.imports.reader import Captured
from pipeline.shards import quantize_fp8

FP8_DTYPE = torch.float8_e4m3fn


def compute_dtype(capture_dtype: torch.dtype) -> torch.dtype:
    """The dtype the norm and lm_head run in: the capture's (the engine's), fp32 for fp8 captures."""
    return torch.float32 if capture_dtype == FP8_DTYPE else capture_dtype


def column(captured: Captured, j: int) -> torch.Tensor:
    """Layer j of the block as values [N, H] (an fp8 block dequantized in float32: q * scale)."""
    values = captured.block[:, j, :]
    if captured.scale is None:
        return values
    return values.float() * captured.scale[:, None]


def final_post(captured: Captured, keys: list, head: TargetHead) -> torch.Tensor:
    """The final hidden state after the norm [N, H]: stored, or the norm of the one before it."""
    if captured.final is not None:
        return captured.final
    return head.post(column(captured, keys.index(head.num_layers)))


def stored_layer(captured: Captured, keys: list, layer_id: int, head: TargetHead, post: torch.Tensor):
    """(values [N, H], raw fp8 [N, H] or None) of one stored id: raw fp8 is kept only when the
    block itself is fp8, so an fp8 capture stored as fp8 keeps its exact bytes and scale."""
    source = source_for(layer_id, head.num_layers, head.ties_norm)
    if source == POST:
        return post, None
    j = keys.index(source)
    raw = captured.block[:, j, :] if captured.scale is not None else None
    return column(captured, j), raw


def features(captured: Captured, keys: list, layer_ids: list[int], head: TargetHead, storage: str, post) -> dict:
    """{"features": [N, n*H] (, "features_scale": [N, n])} in the storage dtype."""
    tokens, hidden = post.shape
    out = torch.empty(tokens, len(layer_ids) * hidden, dtype=STORAGE_DTYPES[storage])
    scale = torch.empty(tokens, len(layer_ids), dtype=torch.float32) if storage == FP8 else None
    for j, layer_id in enumerate(layer_ids):
        values, raw = stored_layer(captured, keys, layer_id, head, post)
        columns = slice(j * hidden, (j + 1) * hidden)
        if scale is None:
            out[:, columns] = values
        elif raw is not None:
            out[:, columns], scale[:, j] = raw, captured.scale
        else:
            q, s = quantize_fp8(values)
            out[:, columns], scale[:, j] = q, s[:, 0]
    return {"features": out} if scale is None else {"features": out, "features_scale": scale}


def sample_tensors(
    captured: Captured,
    keys: list,
    layer_ids: list[int],
    head: TargetHead,
    storage: str,
    prompt_len: int,
    top_k: int,
    budget: int,
) -> dict[str, torch.Tensor]:
    """Everything one shard row stores of a captured sample."""
    post = final_post(captured, keys, head)
    tensors = features(captured, keys, layer_ids, head, storage, post)
    tensors.update(head.distribution(post, captured.input_ids, prompt_len, top_k, budget))
    return tensors
