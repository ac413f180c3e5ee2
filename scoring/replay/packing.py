"""The replay's inputs: the stored target head on the compute device, the proposer's feature
columns, and samples packed end to end with the proposer's state over them computed once per group
(so one propose call serves anchors of several samples)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.common.sampling import Sampling
from pipeline.shards import Sample
from proposers.interface import PackedTokens, ProposeOptions, Proposer, TargetHead, serves_requests


@dataclass
class ReplayOptions(ProposeOptions):
    sampling: Sampling = Sampling()  # the shards' settings: q_j for rejection sampling at T > 0
    distribution_metrics: bool = True  # log q(target) and KL on the top-k; diagnose needs only the drafts
    # the tree methods' settings by kind (scoring/methods/registry.py): {"ddtree": budgets, "eagle-tree":
    # EagleTrees}; the chain always runs
    methods: dict = field(default_factory=lambda: {"ddtree": (256,)})
    walk_rule: str = "dflash"  # whose loop the walk follows (walk_rules.py): its tail block and counts


def prepare_target_head(head: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> TargetHead:
    """The stored target head as replay uses it, on `device`: the lm_head cast once to the
    compute dtype; the embedding kept in the narrower of its stored dtype and the compute dtype,
    because replay only gathers a block's rows and casts those (a cast is elementwise, so the
    values equal those of a cast table). With bf16 shards scored in fp32 that
    halves the embedding's memory; the caller drops the stored-dtype lm_head, so only its
    compute-dtype copy stays."""
    embed, lm_head = head["embed_tokens"], head["lm_head"]
    if embed.element_size() >= torch.empty((), dtype=dtype).element_size():
        embed = embed.to(dtype=dtype)
    final_norm = head.get("final_norm")  # the target's final norm weight [H] (MTP heads)
    return TargetHead(
        embed.to(device=device),
        lm_head.to(device=device, dtype=dtype),
        None if final_norm is None else final_norm.to(device=device),
    )


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


@dataclass(kw_only=True)
class PackedSamples(PackedTokens):
    """PackedTokens (the samples end to end, the proposer's state over them) with what the metrics
    read: the stored top-k of every response position."""

    topk_ids: torch.Tensor  # [sum (R + 1), k]
    topk_logprobs: torch.Tensor  # [sum (R + 1), k]
    topk_starts: torch.Tensor  # [S]
    # [S] first position of each sample whose proposer state held NaN/Inf (then zeroed); N when
    # none. An anchor that sees it is reported as non-finite.
    nonfinite_from: torch.Tensor | None = None


def pack_samples(
    proposer: Proposer, samples: list[Sample], feature_columns, options: ReplayOptions, target: TargetHead
) -> PackedSamples:
    """The samples end to end and the proposer's state over them (`Proposer.prepare`), each sample's
    feature columns selected as the proposer reads them (none when it needs none)."""
    device = options.device
    inputs = ((s.input_ids, feature_columns(s.features) if proposer.needs.feature_layers else None) for s in samples)
    if serves_requests(proposer):  # its state across requests: every sample served once, in replay order
        proposer.serve([(s.input_ids, s.prompt_len) for s in samples])
    state, first_bad = proposer.prepare(inputs, target, options)
    nonfinite_from = [s.input_ids.numel() if bad is None else bad for s, bad in zip(samples, first_bad)]
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
        state=state,
        nonfinite_from=torch.tensor(nonfinite_from, device=device),
    )
