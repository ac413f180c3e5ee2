"""PARD (parallel draft models) as vLLM 0.33.0 runs a standalone draft model with
`"parallel_drafting": true` (method "draft_model"; on the V1 model runner, to which vLLM falls
back: the V2 one lacks it, vllm/config/vllm.py:758-765, 3070-3076): ONE forward of the draft model
per step drafts all K = num_speculative_tokens tokens, from the last sampled token followed by
K - 1 mask tokens. Paths under vllm/; `utils` is v1/spec_decode/utils.py, `base`
v1/spec_decode/llm_base_proposer.py.

- Input of a step (base:854-954, kernel utils:428-575; a draft model shifts no input:
  draft_model.py:29, base:914, utils:468-477; K new slots a request: base:113-115): the step's
  target inputs that were accepted (the runner passes the step's target tokens and its sampled
  token, v1/worker/gpu_model_runner.py:4885-4955; rejected ones are cut: base:889-891), then the
  token the target sampled (utils:499, :525), then K - 1 mask tokens (utils:500-502, :526-528), at
  consecutive positions from the step's first (utils:535).
- The mask id is no speculative_config setting: the draft's config.json, the first of
  `dflash_config.mask_token_id`, `mask_token_id`, `dspark_noise_token_id`, `pard_token`,
  `ptd_token_id` (base:355-380); vLLM fails to start without one.
- Drafts: the argmax of the draft's logits at the sampled token's slot (draft 1) and at each mask
  slot (drafts 2..K) (utils:546-553, :570-575, base:614; one pass and `.view(-1, K)`: base:628-635;
  greedy: base:437-447, :477-479). Probabilistic drafting is refused (config.py), so q is a point mass at
  any temperature, as for the autoregressive draft model.
- KV cache: a step writes every position from its first accepted token on (rejected slots are not
  written: utils:391, :503); the last step's masks sat after its sampled token, which is this step's
  first token, so they are overwritten before any query reads them: a query at position q reads
  keys 0..q (seq_lens + K, utils:416). The cache holds accepted tokens only, plus the step's own masks.

Hence, teacher-forced and exact: draft j at anchor t (x_t the last accepted token) is the argmax at
position t + j - 1 of one causal pass over x_0 .. x_t and K - 1 masks at t + 1 .. t + K - 1: a
function of the stored prefix alone, so every anchor's drafts are the online loop's at that anchor.
Unlike the autoregressive draft model (proposer.py) draft j does not see drafts 1..j-1, so each
anchor has masks of its own: one pass per sample (or chunk of anchors) over its context and, per
anchor, its K - 1 masks, an attention mask letting them see x_0 .. x_t and their own earlier masks.
"""

from __future__ import annotations

import math

import torch

from pipeline.common import timing
from pipeline.common.errors import UserError
from proposers.draft.checks import model_config
from proposers.draft.proposer import UNPROPOSED, DraftModelProposer, greedy_rows
from proposers.draft.vocab_mapping import VocabMapping
from proposers.interface import Chunk, Drafts, PackedTokens

MASK_FIELDS = ("dflash_config.mask_token_id", "mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")
ATTENTION_TYPES = {"full_attention", "sliding_attention"}  # layers whose keys a mask selects


def _configured_mask(hf_config) -> tuple[str, object] | None:
    """(field, value) of the mask token in vLLM's order (base:355-380: dflash_config's, then a
    non-null mask_token_id, then the first of the others present); None when none is."""
    nested = getattr(hf_config, "dflash_config", None)
    if isinstance(nested, dict) and "mask_token_id" in nested:
        return MASK_FIELDS[0], nested["mask_token_id"]
    if getattr(hf_config, "mask_token_id", None) is not None:
        return "mask_token_id", hf_config.mask_token_id
    return next(((name, getattr(hf_config, name)) for name in MASK_FIELDS[2:] if hasattr(hf_config, name)), None)


def mask_token_id(hf_config, where: str) -> int:
    """The draft's mask token id, or one UserError naming the field and the fix."""
    found, vocab = _configured_mask(hf_config), int(hf_config.vocab_size)
    if found is None:
        raise UserError(
            f"{where}: 'parallel_drafting' is true, but the draft model's config.json names no mask token; vLLM "
            f"reads the first of {', '.join(MASK_FIELDS)}: add the id the draft was trained with, e.g. 'pard_token': ID"
        )
    field, value = found
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
        raise UserError(
            f"{where}: the draft model's config.json field {field!r} is {value!r}: the mask token of parallel "
            f"drafting must be a token id of the draft's vocabulary, 0 .. {vocab - 1}; set it to the id it was trained with"
        )
    layer_types = set(getattr(hf_config, "layer_types", None) or ()) - ATTENTION_TYPES
    if layer_types:  # a recurrent layer would carry one anchor's masks into the next anchor's
        raise UserError(
            f"{where}: the draft model has {sorted(layer_types)} layers: parallel drafting is replayed for "
            "attention-only draft models"
        )
    return value


def packed_layout(anchors: torch.Tensor, context: int, masks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [T], visible [T, T]) of `context` stored tokens then `masks` mask tokens per anchor:
    a stored token sees the stored tokens up to itself, anchor t's masks (at t + 1 ..) the stored
    tokens up to t and its own masks up to themselves."""
    device = anchors.device
    stored = torch.arange(context, device=device)
    anchor_of_mask = torch.arange(anchors.numel(), device=device).repeat_interleave(masks)
    owner = torch.cat([torch.full_like(stored, -1), anchor_of_mask])  # -1: a stored token
    positions = torch.cat([stored, (anchors[:, None] + 1 + torch.arange(masks, device=device)).flatten()])
    last_stored = torch.where(owner < 0, positions, anchors[owner.clamp(min=0)])  # the last stored token a row sees
    is_stored = owner < 0
    sees_stored = is_stored[None, :] & (positions[None, :] <= last_stored[:, None])
    sees_mask = ~is_stored[None, :] & (owner[None, :] == owner[:, None]) & (positions[None, :] <= positions[:, None])
    return positions, sees_stored | sees_mask


def _attention_mask(hf_config, visible: torch.Tensor, positions: torch.Tensor):
    """The 4D boolean mask transformers' sdpa layers take as given; sliding-window layers see the last
    `sliding_window` positions only (a dict per layer type where the model mixes both)."""
    window = getattr(hf_config, "sliding_window", None)
    types = set(getattr(hf_config, "layer_types", None) or ())
    if not window or (types and "sliding_attention" not in types):
        return visible[None, None]
    windowed = (visible & (positions[:, None] - positions[None, :] < window))[None, None]
    return {"full_attention": visible[None, None], "sliding_attention": windowed} if types else windowed


@torch.no_grad()
def parallel_drafts(
    model, tokens: torch.Tensor, anchors: torch.Tensor, k: int, mask_id: int, mapping: VocabMapping | None = None
) -> torch.Tensor:
    """[a, k] the K drafts at each of `anchors` of one sample's stored `tokens` [N]: draft 1 read at
    the anchor's own token, draft j at its mask j - 1 (module docstring). `mapping`: vLLM's
    heterogeneous vocabulary (vocab_mapping.py): the stored tokens mapped target -> draft before the
    draft's own mask id is appended (base:827-832 then utils:500-528), the drafts the constrained
    argmax mapped back (base:614-626, :441-446)."""
    masks, context = k - 1, int(anchors.max()) + 1
    stored = tokens[:context] if mapping is None else mapping.to_draft(tokens[:context])
    ids = torch.cat([stored, tokens.new_full((anchors.numel() * masks,), mask_id)])
    positions, visible = packed_layout(anchors, context, masks)
    attention = _attention_mask(model.config, visible, positions)
    with timing.stage("draft model parallel forward", tokens=ids.numel()):
        out = model.base_model(ids[None], position_ids=positions[None], attention_mask=attention)
    hidden = out.last_hidden_state[0]  # [T, H] after the final norm
    mask_rows = context + torch.arange(anchors.numel() * masks, device=ids.device).view(-1, masks)
    rows = torch.cat([anchors[:, None], mask_rows], dim=1).flatten()  # [a * k] request-major, as base:635
    return greedy_rows(model, hidden[rows], mapping).view(-1, k)


class PardProposer(DraftModelProposer):
    """vLLM's draft_model with parallel_drafting: K drafts per anchor from one pass (module docstring)."""

    attention = "sdpa"  # the boolean 4D mask is taken as given

    def __init__(self, config):
        super().__init__(config)
        self.mask_id = None

    def load(self, dtype: torch.dtype, device: str) -> dict:
        """The draft model; its weights and mask id (hashed)."""
        self.mask_id = mask_token_id(model_config(self.config), f"draft model {self.config.model_dir}")
        weights = super().load(dtype, device)
        return {**weights, "parallel_drafting.mask_token_id": torch.tensor([self.mask_id])}

    def prepare(self, samples, target, options):
        """Nothing ahead: each anchor's masks are its own, run where `propose` asks for them."""
        return None, [None for _ in samples]

    def _anchors_per_pass(self, context: int, k: int, options) -> int:
        """Anchors one pass may take: its T x T masks (and on CPU the fp32 scores and probabilities of
        every head, sdpa's math path) within the memory budget."""
        heads = getattr(self.model.config, "num_attention_heads", 1) if self.model is not None else 1
        per_pair = 16 if str(options.device).startswith("cuda") else 8 * heads + 16
        longest = math.isqrt(max(1, options.memory_bytes // per_pair))
        return max(1, (longest - context) // max(1, k - 1))

    def propose(self, packed: PackedTokens, chunks: list[Chunk], target, options) -> list[Drafts]:
        return [self._parallel(packed, chunk, options) for chunk in chunks]

    def _parallel(self, packed: PackedTokens, chunk: Chunk, options) -> Drafts:
        """Drafts [a, K] of a chunk, one pass per sample and part; unknown past the stored sequence."""
        k = chunk.block_len
        drafts = torch.full((chunk.anchors.numel(), k), UNPROPOSED, dtype=torch.long, device=chunk.anchors.device)
        for s in chunk.sample_idx.unique().tolist():
            where = torch.nonzero(chunk.sample_idx == s).flatten()
            start, length = int(packed.starts[s]), int(packed.lengths[s])
            tokens = packed.ids[start : start + length]
            size = self._anchors_per_pass(int(chunk.anchors[where].max()) + 1, k, options)
            for part in where.split(size):
                drafts[part] = parallel_drafts(self.model, tokens, chunk.anchors[part], k, self.mask_id, self.mapping)
        positions = chunk.anchors[:, None] + torch.arange(k, device=drafts.device)[None, :]  # draft j read at t + j - 1
        known = positions < packed.lengths[chunk.sample_idx][:, None]
        return Drafts(None, torch.where(known, drafts, torch.full_like(drafts, UNPROPOSED)))
