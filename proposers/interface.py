"""The proposer interface: what the replay (scoring/replay/) asks of every way of drafting.

A proposer is what a serving engine calls to get draft tokens for a request: a trained drafter
over the target's hidden states (DFlash, EAGLE-3, MTP heads...), or one that reads only the
tokens (an n-gram lookup). Offline, the replay asks it the same question at every anchor t of a
stored response at once, teacher-forced along that response: "which drafts would you propose at
t, given the stored tokens up to t and that drafts 1..j-1 were the stored tokens?" (the only case
in which draft j is ever verified, docs/anchors-and-blocks.md). Verification (chain, DDTree,
EAGLE's dynamic tree: scoring/methods/) is not the proposer's business; it reads the drafts.

The life of a proposer in one replay:

    needs                    which feature layers (none: tokens only) and target tensors it reads
    prepare(samples)         once per group of samples: its own state over their stored tokens
                             (a drafter's context keys/values; nothing for an n-gram lookup)
    anchors_per_chunk(...)   how many anchors one `propose` call may take within the memory budget
    propose(chunks)          per chunk of anchors, its Drafts: a chain of `depth` drafts per anchor
    draft_logprob(...)       log q of given drafts at T > 0, under its own sampling rule
    tree_candidates(...)     optional: its own tree proposals (EAGLE-3's dynamic tree)
    begin(...), accept(...)  optional: a proposer with state along the online loop (ServerStateful)
    serve(samples)           optional: a proposer with state across requests alone (RequestStateful)

Geometry: at an anchor with `remaining` positions left in the generation budget a proposer runs
`block_len(remaining)` queries (the anchors table's `block_len`) and proposes `depth(block_len)`
drafts; `max_drafts` is the depth of a full block (K of a chain).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from pipeline.common.sampling import Sampling
from pipeline.common.sizes import DEFAULT_MEMORY_BYTES
from proposers.toolkit.conventions import REFERENCE, Conventions


@dataclass(frozen=True)
class Needs:
    """What a proposer reads from the shards beside the stored tokens."""

    feature_layers: tuple[int, ...] = ()  # this project's layer ids (docs/layer-numbering.md); () = tokens only
    target_embedding: bool = False  # the target's input embedding (block inputs, a chain's token embeddings)
    target_lm_head: bool = False  # the target's lm_head (draft logits over its vocabulary)
    final_norm: bool = False  # the target's final norm weight (MTP heads: the post-norm hidden state)


@dataclass(frozen=True)
class TargetHead:
    """The target tensors the shards store beside the samples, on the compute device."""

    embed: torch.Tensor  # [V, H] input embedding (maybe in a narrower stored dtype: gathered rows are cast)
    lm_head: torch.Tensor  # [V, H] in the compute dtype
    final_norm: torch.Tensor | None = None  # [H] the final norm's weight (stored with layer id L)


@dataclass
class ProposeOptions:
    """How proposers compute: where, in what dtype, within what memory, under which conventions."""

    memory_bytes: int = DEFAULT_MEMORY_BYTES  # working-memory budget for one anchor chunk
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    attention: str = "auto"  # auto: flex_attention on CUDA, blockwise (chunked context keys) on CPU
    conventions: Conventions = REFERENCE  # score: the walk rule's (WalkRule.conventions); diagnose changes one switch

    @property
    def attention_backend(self) -> str:
        if self.attention == "auto":
            return "flex" if str(self.device).startswith("cuda") else "blockwise"
        return self.attention


@dataclass
class PackedTokens:
    """Samples laid end to end, so one propose call can serve anchors of several samples. Sample s
    occupies positions starts[s] .. starts[s] + lengths[s] - 1; `state` is the proposer's own
    (`prepare`), opaque to the replay."""

    ids: torch.Tensor  # [sum N] token ids (prompt + stored response of each sample)
    starts: torch.Tensor  # [S]
    lengths: torch.Tensor  # [S]
    prompt_lens: torch.Tensor  # [S]
    state: Any = None

    def stored(self, sample_idx: torch.Tensor, anchors: torch.Tensor, depth: int, first: int = 1) -> torch.Tensor:
        """[a, depth] the stored token at sample position anchor + first + j for j < depth, clamped
        to the sample's last token where the position is past its end (such a draft is never
        verified: a caller masks it by whether the position is known), and to its first token where it
        is before the start (first -1 at anchor 0: speculators' XPress reads the anchor there)."""
        starts, lengths = self.starts[sample_idx], self.lengths[sample_idx]
        positions = anchors[:, None] + first + torch.arange(depth, device=anchors.device)[None, :]
        positions = torch.minimum(positions.clamp(min=0), lengths[:, None] - 1)
        return self.ids[starts[:, None] + positions]


@dataclass(frozen=True)
class Chunk:
    """Anchors one propose call drafts at: anchor positions within their samples of a PackedTokens."""

    sample_idx: torch.Tensor  # [a]
    anchors: torch.Tensor  # [a]
    block_len: int  # queries of every anchor's block (the same for a chunk)
    # [a] drafts the online loop can verify at each anchor (llama-server's n_draft_max; none: it asks
    # for no draft there); None: not told. Read by a ServerStateful proposer, whose state a draft
    # call changes.
    room: torch.Tensor | None = None


@dataclass
class Drafts:
    """What a proposer proposes at a chunk of anchors, teacher-forced along the stored response:
    draft j (1-based) at anchor t proposes the token at t + j, given that drafts 1..j-1 were the
    stored tokens. A proposer with a draft distribution gives its logits (and `tokens` only when
    its greedy draft is not their argmax); one that proposes tokens alone (an n-gram lookup) gives
    `tokens` and no logits: its q is a point mass on them."""

    logits: (
        torch.Tensor | None
    )  # [a, D, V] scores of the draft distribution over the target vocabulary (-inf: never proposed)
    tokens: torch.Tensor | None = None  # [a, D] greedy drafts when the proposer's tie rule is not argmax over logits
    limit: torch.Tensor | None = (
        None  # [a] drafts actually proposed (a confidence head's cut, a short match); None: all D
    )
    # [a] drafts the loop proposes when that differs from `limit` past the first rejected draft (a
    # cut reading the drafter's own drafts there: DSpark's confidence head); None: `limit`
    drafted: torch.Tensor | None = None


@dataclass
class TreeCandidates:
    """Every candidate node of a proposer's own trees at a chunk of `a` anchors, in the proposer's
    order (a node's parent always comes before it): C candidates per anchor."""

    scores: torch.Tensor  # [a, C] float32 path score (the tree keeps the best)
    tokens: torch.Tensor  # [a, C] target token ids
    parents: torch.Tensor  # [a, C] the parent's candidate index, ROOT at depth 1
    topk: int

    def size(self, depth: int) -> int:
        """Candidates of depth <= `depth` (topk at depth 1, topk^2 at each deeper one)."""
        return self.topk + (depth - 1) * self.topk**2


ROOT = -1  # TreeCandidates.parents of a depth-1 candidate


@runtime_checkable
class Proposer(Protocol):
    """Every way of drafting, as the replay drives it (module docstring)."""

    family: str  # the registry's name (proposers/registry.py)
    layout: str  # whose config layout it was read from
    needs: Needs
    independent_drafts: bool  # drafts independent given the block: DDTree's per-position marginals apply
    max_drafts: int

    def block_len(self, remaining: torch.Tensor) -> torch.Tensor:
        """[A] queries of the block at anchors with `remaining` positions left in the budget."""

    def depth(self, block_len: int) -> int:
        """Drafts a block of `block_len` queries proposes."""

    def prepare(
        self, samples: Iterable[tuple[torch.Tensor, torch.Tensor | None]], target: TargetHead, options: ProposeOptions
    ) -> tuple[Any, list[int | None]]:
        """(its state over these samples laid end to end, per sample the first position whose state
        is not finite or None). Each sample is (its token ids [N], the columns of
        `needs.feature_layers` [N, n*H] or None when it needs none), produced as it is consumed."""

    def anchors_per_chunk(self, block_len: int, ctx_len: int, vocab: int, options: ProposeOptions) -> int:
        """Anchors one propose call may take within options.memory_bytes."""

    def propose(
        self, packed: PackedTokens, chunks: list[Chunk], target: TargetHead, options: ProposeOptions
    ) -> list[Drafts]:
        """The Drafts of each chunk [a, depth(block_len), ...], teacher-forced along the stored tokens."""

    def draft_logprob(self, drafts: Drafts, tokens: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """[a, D] log q_j(tokens): the probability the proposer proposes `tokens` when sampling (T > 0),
        under its own sampling rule, from its `drafts` of the chunk (logits made finite)."""


def point_mass_logprob(drafts: Drafts, tokens: torch.Tensor, sampling: Sampling | None = None) -> torch.Tensor:
    """[a, D] log q(tokens) of a proposer that proposes its draft tokens alone: 0 where the token is
    the draft, -inf elsewhere, whatever the temperature (an n-gram lookup samples nothing)."""
    hit = drafts.tokens == tokens
    return torch.zeros(hit.shape, dtype=torch.float32, device=hit.device).masked_fill(~hit, float("-inf"))


@runtime_checkable
class TreeProposer(Proposer, Protocol):
    """A proposer that drafts its own trees (EAGLE-3's dynamic tree, scoring/methods/eagle_tree.py)."""

    def tree_candidates(
        self, packed: PackedTokens, chunk: Chunk, topk: int, depth: int, target: TargetHead, options: ProposeOptions
    ) -> TreeCandidates:
        """The candidates of a `depth`-level beam of `topk` at the chunk's anchors."""


@runtime_checkable
class ServerStateful(Proposer, Protocol):
    """A proposer whose drafts depend on its own earlier steps and on earlier requests (llama-server's
    ngram-map-k, ngram-map-k4v, ngram-mod: proposers/ngram/), so its drafts exist only along the online
    loop's own path. The replay calls it as the server does, one request at a time in the replay's
    order, one step at a time along the walk (scoring/replay/anchors.py replay_walks):

        begin(packed, s)         the request's prompt is in (also when no step follows)
        propose(one anchor)      the step's draft call; Chunk.room <= 0: the server makes none
        accept(accepted)         after the step: the drafts the server counted as accepted
    """

    def begin(self, packed: PackedTokens, sample_idx: int) -> None:
        """Start the request of sample `sample_idx` of `packed` (its prompt: packed.prompt_lens)."""

    def accept(self, accepted: int) -> None:
        """The last step's verification: `accepted` drafts (ignored after a step without a draft)."""


def is_stateful(proposer: Proposer) -> bool:
    """Whether the proposer keeps state along the online loop (ServerStateful)."""
    return isinstance(proposer, ServerStateful)


@runtime_checkable
class RequestStateful(Proposer, Protocol):
    """A proposer whose drafts depend on the requests served before, not on its own drafts (vLLM's
    suffix decoding: a global tree of earlier responses, proposers/suffix/): teacher-forced at every
    anchor like any other, given the samples before it. The replay serves it every sample once, one
    at a time, in the replay's order, each group before its `prepare` (scoring/replay/packing.py),
    a sample without an anchor too; run.json's `requests` says so (scoring/score/steps.py)."""

    requests: str  # what the requests before a sample change, for run.json

    def serve(self, requests: list[tuple[torch.Tensor, int]]) -> None:
        """The next samples (token ids [N], prompt length), in order, after those served before."""


def serves_requests(proposer: Proposer) -> bool:
    """Whether the proposer's drafts depend on the samples served before (RequestStateful)."""
    return isinstance(proposer, RequestStateful)


def drafts_trees(proposer: Proposer) -> bool:
    """Whether the proposer drafts its own trees (declares TreeProposer's method)."""
    return isinstance(proposer, TreeProposer)
