"""What a stage 1 source's shards hold, by one rule for every source: the tensors and their
dtypes, and the sizes a run works in (the lm_head window, the shard chunk), from the feature
layers, top-k and memory budget. The tensors themselves: pipeline/extract/capture.py's table."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline import shards
from pipeline.common.dtypes import COMPUTE_DTYPES, FP8, FP8_NAMES, STORAGE_DTYPES, STORAGE_NAMES
from pipeline.common.errors import UserError


def parse_feature_dtype(name: str | None, model_dtype: str) -> str:
    """Storage dtype name of the features: the model dtype (lossless) unless `--feature-dtype`."""
    if name is None:
        return model_dtype
    key = str(name).lower().removeprefix("torch.")
    if key in FP8_NAMES:
        return FP8
    if key not in COMPUTE_DTYPES:
        raise UserError(
            f"--feature-dtype {name!r} is not supported; use one of {', '.join([*COMPUTE_DTYPES, *FP8_NAMES])}"
        )
    return STORAGE_NAMES[COMPUTE_DTYPES[key]]


def tensor_dtypes(feature_dtype: str | None, sampled: bool = False) -> dict[str, str]:
    """{tensor name: dtype name} of what the shards store, in their column order; no features
    when `feature_dtype` is None (no feature layers: `extract --layer-ids none`)."""
    dtypes = {"topk_ids": "int32", "topk_logprobs": "float32", "argmax_mismatch": "uint8"}
    if feature_dtype is not None:
        dtypes = {"features": feature_dtype, **dtypes}
    if feature_dtype == FP8:
        dtypes["features_scale"] = "float32"
    if sampled:
        dtypes["sample_logprob"] = "float32"
    return dtypes


def stored_bytes_per_token(dtypes: dict[str, str], n_layers: int, hidden: int, top_k: int) -> int:
    """Raw bytes the shards hold per token (features, scales, top-k, flags)."""
    width = {
        "features": n_layers * hidden,
        "features_scale": n_layers,
        "topk_ids": top_k,
        "topk_logprobs": top_k,
        "argmax_mismatch": 1,
        "sample_logprob": 1,
    }
    return sum(width[name] * STORAGE_DTYPES[dtype].itemsize for name, dtype in dtypes.items())


def raw_feature_bytes_per_token(n_layers: int, hidden: int) -> int:
    """The features of one token as raw bf16: what `totals` and `inspect` compare the shards against."""
    return n_layers * hidden * 2


def split_memory_budget(budget_bytes: int, bytes_per_token: int) -> tuple[int, int]:
    """(lm_head window bytes, tokens per shard chunk): half the budget each. The model's weights
    and one sample's own activations and stored tensors come on top (they scale with the model
    and the sample, not with anything extract chooses)."""
    return budget_bytes // 2, shards.chunk_tokens_for(budget_bytes // 2, bytes_per_token)


@dataclass(frozen=True)
class Storage:
    """What a run's shards hold and the sizes it works in; the same rules for every source."""

    layer_ids: list[int]  # stored feature layers, in stored order; [] for none (tokens and top-k only)
    feature_dtype: str | None  # storage dtype name of the features; None when no layers are stored
    top_k: int
    tensors: dict[str, str]  # {tensor name: dtype name} as stored in the shards
    head_window_bytes: int  # memory for one lm_head window over the vocabulary
    chunk_tokens: int  # tokens per shard chunk (record batch)
    raw_bytes_per_token: int  # the features as raw bf16, what `totals` compares the shards against


def plan_storage(
    layer_ids: list[int], feature_dtype: str, top_k: int, hidden: int, memory_bytes: int, sampled: bool = False
) -> Storage:
    """The Storage of `layer_ids` stored as `feature_dtype`; no features at all without layers."""
    feature_dtype = feature_dtype if layer_ids else None
    tensors = tensor_dtypes(feature_dtype, sampled)
    head_bytes, chunk_tokens = split_memory_budget(
        memory_bytes, stored_bytes_per_token(tensors, len(layer_ids), hidden, top_k)
    )
    return Storage(
        layer_ids=list(layer_ids),
        feature_dtype=feature_dtype,
        top_k=top_k,
        tensors=tensors,
        head_window_bytes=head_bytes,
        chunk_tokens=chunk_tokens,
        raw_bytes_per_token=raw_feature_bytes_per_token(len(layer_ids), hidden),
    )
