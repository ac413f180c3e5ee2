"""The replay's inputs: the stored target head on the compute device, the drafter's feature
columns, and samples packed end to end with the drafter's context keys/values computed once per
sample (so one drafter call serves anchors of several samples)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.common import timing
from pipeline.common.sampling import Sampling
from pipeline.common.sizes import DEFAULT_MEMORY_BYTES
from pipeline.shards import Sample
from scoring.drafters.base import DraftModel
from scoring.drafters.conventions import REFERENCE, Conventions


@dataclass
class ReplayOptions:
    max_tree_nodes: int = 256  # largest DDTree budget (nodes); 0 disables DDTree
    memory_bytes: int = DEFAULT_MEMORY_BYTES  # working-memory budget for one anchor chunk
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    attention: str = "auto"  # auto: flex_attention on CUDA, blockwise (chunked context keys) on CPU
    sampling: Sampling = Sampling()  # the shards' settings: q_j for rejection sampling at T > 0
    conventions: Conventions = REFERENCE  # score: always the reference; diagnose changes one switch
    distribution_metrics: bool = True  # log q(target) and KL on the top-k; diagnose needs only the drafts
    eagle_trees: tuple = ()  # results.EagleTree settings drafted at every anchor (EAGLE-3, greedy only)

    @property
    def attention_backend(self) -> str:
        if self.attention == "auto":
            return "flex" if str(self.device).startswith("cuda") else "blockwise"
        return self.attention


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
    prepared = {"embed_tokens": embed.to(device=device), "lm_head": lm_head.to(device=device, dtype=dtype)}
    if "final_norm" in head:  # the target's final norm weight [H] (MTP heads)
        prepared["final_norm"] = head["final_norm"].to(device=device)
    return prepared


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
    context: list  # per drafter layer (k, v) [kv_heads, sum N, d] (EAGLE-3: then (last hidden [1, sum N, H],))
    # [S] first position of each sample whose context keys/values held NaN/Inf (then zeroed, see
    # finite_context); N when none. An anchor that sees it is reported as non-finite.
    nonfinite_from: torch.Tensor | None = None


MIN_CONTEXT_ROWS = 512


# A budget-sized step (~2.7k positions at 27B widths in fp32) made the pass's working set depend
# on T below that size: a 2048-token sample ran in one step, an 8192-token one in steps of 2.7k
# (bench section `memory`); smaller steps cost little, the pass being ~1% of scoring (section `gemm`).
MAX_CONTEXT_ROWS = 1024


def context_rows(drafter: DraftModel, feature_width: int, dtype: torch.dtype, memory_bytes: int) -> int:
    """Positions per step of the context pass (`DraftModel.context_kv`), so that one step's
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
    drafter: DraftModel,
    samples: list[Sample],
    feature_columns,
    options: ReplayOptions,
    embed: torch.Tensor | None = None,
) -> PackedSamples:
    """Context keys/values of every layer, computed once per sample (RoPE on positions within
    the sample) and concatenated. `embed`: the target's embedding, for a family whose context
    rows read tokens (EAGLE-3)."""
    device, dtype = options.device, options.dtype
    contexts, nonfinite_from = [], []
    for s in samples:
        features = feature_columns(s.features)
        rows = context_rows(drafter, features.shape[-1], dtype, options.memory_bytes)
        with timing.stage("context keys/values", tokens=features.shape[0]):
            kv = drafter.context_kv(
                features,
                dtype=dtype,
                chunk_rows=rows,
                tokens=s.input_ids,
                embed=embed,
                attention=options.attention_backend,
                conventions=options.conventions,
            )
            context, first_bad = finite_context(kv)
        contexts.append(context)
        nonfinite_from.append(s.input_ids.numel() if first_bad is None else first_bad)
    context = []
    for layer in range(len(contexts[0])):  # contiguous [kv_heads, sum N, d]; each input freed once used
        parts = [c[layer] for c in contexts]
        for c in contexts:
            c[layer] = None
        context.append(
            tuple(
                torch.cat([p[i] for p in parts], dim=1) if len(parts) > 1 else parts[0][i].contiguous()
                for i in range(len(parts[0]))
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
