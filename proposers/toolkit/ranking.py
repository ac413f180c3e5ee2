"""Top-k ids with one tie rule for every tree: equal values go to the lower id (a step's lower
token id, the earlier candidate among candidates), where torch.topk leaves ties unspecified, so a
tree is the same on every device (docs/ddtree.md, docs/eagle-tree.md)."""

from __future__ import annotations

import torch


def top_k_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the k largest logits per row, largest first, equal logits by lower id.
    [..., V] float32 -> [..., k] int64. torch.topk of k + 1, re-sorted by (logit, id): exact
    wherever the k-th and (k + 1)-th logits differ (the top k are then one set), and without the
    whole row's int64 keys; the rows where they tie (the tie may reach past k + 1) or hold NaN
    take `ids_by_keys`, the definition."""
    vocab = logits.shape[-1]
    k = min(k, vocab)
    if k == vocab:
        return ids_by_keys(logits, k)
    values, ids = torch.topk(logits.float(), k + 1, dim=-1)  # [..., k + 1]
    ids, by_id = ids.sort(dim=-1)
    values = values.gather(-1, by_id) + 0.0  # + 0.0: -0.0 equals 0.0, as in ids_by_keys
    values, by_value = values.sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, by_value[..., :k])  # [..., k], contiguous
    tied = (values[..., k - 1] == values[..., k]) | values.isnan().any(-1)  # [...]
    if bool(tied.any()):
        ids[tied] = ids_by_keys(logits[tied], k)
    return ids


def ids_by_keys(logits: torch.Tensor, k: int) -> torch.Tensor:
    """`top_k_ids` by its definition, over the whole row. Each (logit, id) pair becomes one int64
    whose order is that order (float bits made monotone in the high half, V - 1 - id in the low
    half), so torch.topk over distinct keys has one answer on every device."""
    vocab = logits.shape[-1]
    bits = (logits.float() + 0.0).view(torch.int32).long()  # [..., V]; + 0.0 makes -0.0 equal 0.0
    monotone = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # float order as signed int order
    keys = (monotone << 32) | (vocab - 1 - torch.arange(vocab, device=logits.device))
    return vocab - 1 - (torch.topk(keys, k=min(k, vocab), dim=-1).values & 0xFFFFFFFF)
