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

from dataclasses import dataclass

import torch

from pipeline.shards import Sample
from scoring.ddtree import NOT_IN_TREE, path_pop_indices, top_log_probs
from scoring.drafter import DFlashDrafter
from scoring.metrics import kl_on_topk


@dataclass
class ReplayOptions:
    max_budget: int = 256  # largest DDTree budget; 0 disables DDTree
    memory_bytes: int = 2 << 30  # working-memory budget for one anchor chunk
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    attention: str = "auto"  # auto: flex_attention on CUDA, dense explicit masks on CPU

    @property
    def attention_backend(self) -> str:
        if self.attention == "auto":
            return "flex" if str(self.device).startswith("cuda") else "dense"
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
    kl_topk: torch.Tensor  # [A, L] KL(target || draft) on the stored top-k support
    tree_pop_index: torch.Tensor  # [A, L] DDTree pop index of the target-path prefix of depth k


def select_feature_columns(features: torch.Tensor, stored_layer_ids: list[int], drafter_layer_ids: list[int]) -> torch.Tensor:
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


def _path_ranks(top_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Rank of each target token among the top-K of its depth, -1 if absent. [a, L, K], [a, L] -> [a, L]."""
    hit = top_ids == targets[..., None]
    return torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(targets, -1))


@torch.inference_mode()
def replay_sample(drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor, sample: Sample,
                  feature_columns, budget_tokens: int, options: ReplayOptions) -> AnchorTensors:
    """Score every anchor of one sample. `feature_columns(features)` selects the drafter's
    layers; `budget_tokens` is the max_new_tokens the online loop would run with."""
    cfg = drafter.config
    device, dtype = options.device, options.dtype
    ids = sample.input_ids.to(device)
    seq_len, prompt_len = ids.numel(), sample.prompt_len
    L = cfg.block_size - 1
    anchors = torch.arange(prompt_len, seq_len - 1, device=device)
    A = anchors.numel()
    out = AnchorTensors(
        anchors=anchors.cpu(),
        block_len=torch.clamp(prompt_len + budget_tokens - anchors, max=cfg.block_size).cpu(),
        draft_tokens=torch.full((A, L), -1, dtype=torch.long),
        target_tokens=torch.full((A, L), -1, dtype=torch.long),
        target_logprob=torch.full((A, L), float("nan")),
        kl_topk=torch.full((A, L), float("nan")),
        tree_pop_index=torch.full((A, L), NOT_IN_TREE, dtype=torch.long),
    )
    if A == 0:
        return out
    ctx_len = seq_len - 2  # the last anchor (seq_len - 2) sees positions 0..seq_len - 3
    features = feature_columns(sample.features[:ctx_len]).to(device=device, dtype=dtype)
    context = drafter.context_kv(features)
    topk_ids = sample.topk_ids.to(device)
    topk_logprobs = sample.topk_logprobs.to(device)
    vocab = lm_head.shape[0]

    for block_len in out.block_len.unique().tolist():
        rows = torch.nonzero(out.block_len == block_len).flatten()
        chunk = anchors_per_chunk(drafter, block_len, ctx_len, vocab, options.memory_bytes)
        for begin in range(0, rows.numel(), chunk):
            row = rows[begin:begin + chunk]
            _score_chunk(drafter, embed, lm_head, ids, anchors[row.to(device)], block_len, context,
                         topk_ids, topk_logprobs, prompt_len, options, out, row)
    return out


def _score_chunk(drafter, embed, lm_head, ids, anchors, block_len, context, topk_ids, topk_logprobs,
                 prompt_len, options, out, rows):
    cfg = drafter.config
    seq_len = ids.numel()
    depth = block_len - 1
    # Block inputs: [x_t, mask, ..., mask] through the target's input embedding.
    block_ids = torch.full((anchors.numel(), block_len), cfg.mask_token_id, dtype=torch.long, device=ids.device)
    block_ids[:, 0] = ids[anchors]
    block_embeds = torch.nn.functional.embedding(block_ids, embed) * cfg.input_embedding_scale
    visible_ctx = int(anchors.max())  # no anchor here sees context at or past this position
    chunk_context = [(k[:, :visible_ctx], v[:, :visible_ctx]) for k, v in context]
    hidden = drafter(block_embeds, anchors, chunk_context, attention=options.attention_backend)[:, 1:]
    logits = drafter.logits(hidden, lm_head)  # [a, depth, V]
    draft = logits.argmax(dim=-1)

    positions = anchors[:, None] + torch.arange(1, depth + 1, device=ids.device)[None, :]
    known = positions < seq_len
    targets = torch.where(known, ids[positions.clamp(max=seq_len - 1)], torch.full_like(positions, -1))
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_logprob = logprobs.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    target_logprob = torch.where(known, target_logprob, torch.full_like(target_logprob, float("nan")))
    # Stored target distribution for the token at position p is row p - prompt_len.
    topk_rows = (positions - prompt_len).clamp(max=topk_ids.shape[0] - 1)
    support = topk_ids[topk_rows].long()  # [a, depth, k]
    kl = kl_on_topk(topk_logprobs[topk_rows], logprobs.gather(-1, support))
    kl = torch.where(known, kl, torch.full_like(kl, float("nan")))

    cpu_rows = rows.cpu()
    out.draft_tokens[cpu_rows, :depth] = draft.cpu()
    out.target_tokens[cpu_rows, :depth] = targets.cpu()
    out.target_logprob[cpu_rows, :depth] = target_logprob.cpu()
    out.kl_topk[cpu_rows, :depth] = kl.cpu()
    del logprobs

    if options.max_budget > 0:
        top_logp, top_ids = top_log_probs(logits, options.max_budget)
        ranks = _path_ranks(top_ids, targets).cpu().numpy()
        top_logp = top_logp.cpu().numpy()
        known_depth = known.sum(dim=1).cpu().numpy()
        for i, r in enumerate(cpu_rows.tolist()):
            pops = path_pop_indices(top_logp[i], ranks[i, : known_depth[i]], options.max_budget)
            out.tree_pop_index[r, : pops.size] = torch.from_numpy(pops)
