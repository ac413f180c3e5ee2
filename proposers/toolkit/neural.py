"""A trained drafter over the target's features behind the proposer interface (proposers/interface.py).

Every neural family's model (a block drafter, a step chain) is driven the same way: its context
keys/values computed once per sample from the stored features (`prepare`), then per chunk of
anchors its block inputs embedded (`[x_t, mask, ...]`, or the stored tokens for a family whose
slots read the draft before them), its hidden states and its Drafts (`propose`). Chunks are sized
by the memory budget (`anchors_per_chunk`); chunks of a few rows share one lm_head GEMM when the
family's drafts are its logits row by row.
"""

from __future__ import annotations

import torch

from pipeline.common import timing
from pipeline.common.sampling import Sampling
from proposers.interface import Chunk, Drafts, Needs, PackedTokens, ProposeOptions, TargetHead, TreeCandidates
from proposers.registry import family
from proposers.toolkit.attention import KEY_CHUNK

MIN_CONTEXT_ROWS = 512
# A budget-sized step (~2.7k positions at 27B widths in fp32) made the pass's working set depend
# on T below that size: a 2048-token sample ran in one step, an 8192-token one in steps of 2.7k
# (bench section `memory`); smaller steps cost little, the pass being ~1% of scoring (section `gemm`).
MAX_CONTEXT_ROWS = 1024


class NeuralProposer:
    """A drafter model (its `config` a proposers.toolkit.config.DrafterConfig) as a Proposer."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.config = model.config
        record = family(self.config.family)
        self.family, self.layout = record.name, self.config.layout
        self.independent_drafts = record.independent_drafts
        self.needs = Needs(
            feature_layers=tuple(self.config.target_layer_ids),
            target_embedding=True,
            target_lm_head=True,
            final_norm=self.config.reads_final_norm,
        )

    # -- geometry -------------------------------------------------------------------------------

    @property
    def max_drafts(self) -> int:
        return self.config.max_drafts

    def block_len(self, remaining: torch.Tensor) -> torch.Tensor:
        return self.config.block_len(remaining)

    def depth(self, block_len: int) -> int:
        return self.config.depth(block_len)

    # -- the replay's calls ---------------------------------------------------------------------

    def prepare(self, samples, target: TargetHead, options: ProposeOptions):
        """Context keys/values of every layer, computed once per sample (RoPE on positions within
        the sample) and concatenated [kv_heads, sum N, d]; per sample its first non-finite position."""
        self.model.attach_target_head(target)
        contexts, first_bad = [], []
        for tokens, features in samples:
            context, bad = sample_context(self.model, tokens, features, target, options)
            contexts.append(context)
            first_bad.append(bad)
        return concatenated(contexts), first_bad

    def anchors_per_chunk(self, block_len: int, ctx_len: int, vocab: int, options: ProposeOptions) -> int:
        """How many anchors fit the working-memory budget: logits and their float copies
        (~4 x L x V floats) plus attention scores (~3 x heads x b x (T + b) floats) per anchor."""
        cfg, keys = self.config, attended_keys(options, ctx_len)
        per_anchor = 4 * 4 * cfg.depth(block_len) * vocab
        per_anchor += 3 * 4 * cfg.num_attention_heads * block_len * (keys + block_len)
        per_anchor += 8 * 4 * block_len * max(cfg.intermediate_size, cfg.hidden_size)
        return max(1, int(options.memory_bytes // per_anchor))

    def propose(
        self, packed: PackedTokens, chunks: list[Chunk], target: TargetHead, options: ProposeOptions
    ) -> list[Drafts]:
        """Drafts of each chunk: the drafter per chunk; for a family whose drafts are its logits row
        by row (DFlash), one lm_head GEMM over all the chunks' rows."""
        model = self.model
        if len(chunks) == 1 or not model.rowwise_drafts:
            return [self.chunk_drafts(packed, chunk, target, options) for chunk in chunks]
        hidden = [chunk_hidden(model, packed, chunk, target, options) for chunk in chunks]  # [a, d, H] each
        flat = torch.cat([h.reshape(-1, h.shape[-1]) for h in hidden])  # [sum a*d, H]
        logits = model.logits(flat[None], target.lm_head, options.conventions)[0]  # [sum a*d, V]
        sizes = [h.shape[0] * h.shape[1] for h in hidden]
        return [Drafts(part.view(h.shape[0], h.shape[1], -1)) for part, h in zip(logits.split(sizes), hidden)]

    def chunk_drafts(self, packed: PackedTokens, chunk: Chunk, target: TargetHead, options: ProposeOptions) -> Drafts:
        """The drafts [a, D, ...] of one chunk, under `options.conventions`."""
        hidden = chunk_hidden(self.model, packed, chunk, target, options)  # [a, D, H]; whole_block: [a, b, H]
        # the token before each draft; before each block slot (x_{t-1} first) for a whole_block family
        first = -1 if self.config.whole_block else 0
        previous = packed.stored(chunk.sample_idx, chunk.anchors, hidden.shape[1], first=first)
        return self.model.drafts(hidden, target.lm_head, previous, options.conventions)

    def draft_logprob(self, drafts: Drafts, tokens: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        return self.model.draft_logprob(drafts.logits, tokens, sampling)


class NeuralTreeProposer(NeuralProposer):
    """A drafter that also drafts its own trees (its family's `tree`: EAGLE-3's dynamic tree)."""

    def tree_candidates(
        self, packed: PackedTokens, chunk: Chunk, topk: int, depth: int, target: TargetHead, options: ProposeOptions
    ) -> TreeCandidates:
        return family(self.family).tree(self.model, packed, chunk, topk, depth, target, options)


def neural_proposer(model: torch.nn.Module) -> NeuralProposer:
    """The proposer of a loaded drafter model: with its own trees when its family drafts some."""
    kind = NeuralTreeProposer if family(model.config.family).tree is not None else NeuralProposer
    return kind(model)


# -- the context: once per sample ------------------------------------------------------------------


def context_rows(model, feature_width: int, dtype: torch.dtype, memory_bytes: int) -> int:
    """Positions per step of the context pass (`context_kv`), so that one step's features cast to
    the compute dtype, fc / hidden_norm outputs and a layer's keys / values before RoPE
    (~feature_width + 4 x hidden + 4 x kv width values a position) take at most a quarter of the
    memory budget: a long sample never holds a compute-dtype copy of all its features (at 27B
    shapes in fp32, 100 KiB a token, twice the bf16 features themselves). At least
    MIN_CONTEXT_ROWS, so the GEMMs keep large shapes, and at most MAX_CONTEXT_ROWS."""
    cfg = model.config
    values = feature_width + 4 * cfg.hidden_size + 4 * cfg.num_key_value_heads * cfg.head_dim
    per_row = torch.empty((), dtype=dtype).element_size() * values
    return min(MAX_CONTEXT_ROWS, max(MIN_CONTEXT_ROWS, int(memory_bytes // 4 // per_row)))


def sample_context(model, tokens, features, target: TargetHead, options: ProposeOptions):
    """(one sample's context, its first non-finite position or None)."""
    rows = context_rows(model, features.shape[-1], options.dtype, options.memory_bytes)
    with timing.stage("context keys/values", tokens=features.shape[0]):
        kv = model.context_kv(
            features,
            dtype=options.dtype,
            chunk_rows=rows,
            tokens=tokens,
            embed=target.embed,
            attention=options.attention_backend,
            conventions=options.conventions,
        )
        return finite_context(kv)


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


def concatenated(contexts: list[list]) -> list:
    """Per layer, the samples' contexts end to end [kv_heads, sum N, d], contiguous; each input
    freed once used."""
    context = []
    for layer in range(len(contexts[0])):
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
    return context


def attended_keys(options: ProposeOptions, ctx_len: int) -> int:
    """Context keys one anchor's attention holds scores for at once: all of them on the dense
    path, one key chunk on the blockwise path (the flex kernel tiles them too)."""
    return ctx_len if options.attention_backend == "dense" else min(ctx_len, KEY_CHUNK)


# -- a chunk of anchors ----------------------------------------------------------------------------


def chunk_hidden(model, packed: PackedTokens, chunk: Chunk, target: TargetHead, options: ProposeOptions):
    """The drafter's final hidden states [a, D, H] at the draft slots (D = config.depth(block_len)); a
    `whole_block` family's at every block slot [a, b, H] (its drafts read the anchor's slot too)."""
    cfg, conventions = model.config, options.conventions
    starts = packed.starts[chunk.sample_idx]
    block_ids = block_tokens(cfg, packed, chunk)
    # The embedding may be kept in a narrower stored dtype (prepare_target_head): cast the
    # gathered rows, which gives the values of a cast table.
    embed_scale = cfg.scales(conventions)[0]
    table = model.embedding_table(target.embed)  # the target's, unless the drafter keeps its own copy (DeepSpec)
    block_embeds = torch.nn.functional.embedding(block_ids, table).to(options.dtype) * embed_scale  # [a, b, H]
    # no anchor here sees context at or past this key
    visible_ctx = int((starts + chunk.anchors).max()) + conventions.visible_offset
    chunk_context = [tuple(t[:, :visible_ctx] for t in entry) for entry in packed.state]
    hidden = model(
        block_embeds,
        chunk.anchors,
        chunk_context,
        attention=options.attention_backend,
        ctx_starts=starts,
        conventions=conventions,
    )
    return hidden if cfg.whole_block else hidden[:, cfg.first_draft_slot :]


def block_tokens(cfg, packed: PackedTokens, chunk: Chunk) -> torch.Tensor:
    """[a, b] the block's token ids: [x_t, mask, ...], or for a family whose slots read the draft
    before them (`teacher_forced_block`) the stored tokens [x_t, y_{t+1}, ...]: a draft is verified
    only while every earlier one equalled the stored token, so the stored tokens are the drafts
    that matter (docs/sampling.md#drafters-whose-drafts-depend-on-earlier-drafts)."""
    anchors, block_len = chunk.anchors, chunk.block_len
    if cfg.teacher_forced_block:
        return packed.stored(chunk.sample_idx, anchors, block_len, first=0)
    block_ids = torch.full((anchors.numel(), block_len), cfg.mask_token_id, dtype=torch.long, device=anchors.device)
    block_ids[:, 0] = packed.ids[packed.starts[chunk.sample_idx] + anchors]
    return block_ids
