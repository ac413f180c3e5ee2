"""The DSpark drafter: the block drafter (proposers/toolkit/block_drafter.py, DFlash's weights and
names) plus a
Markov head that biases each block slot's logits by the token before it, and an optional
confidence head that cuts the proposal short.

Extra weights, named as in all three public implementations (speculators
models/dspark/model_definitions.py, DeepSpec modeling/dspark/markov_head.py, SpecForge
modeling/draft/dspark.py):
`markov_head.markov_w1.weight` [V, r] (an embedding of the previous target token),
`markov_head.markov_w2.weight` [Vo, r] (r -> logits over the drafter's output vocabulary Vo),
gated: `markov_head.gate_proj.{weight [r, H + r], bias}`, rnn: `markov_head.joint_proj.{weight
[3r, 2r + H], bias}`, `confidence_head.proj.{weight [1, H (+ r)], bias}`. A reduced draft
vocabulary (speculators) adds `lm_head.weight` [Vd, H], `d2t`, `t2d` (vocab.py); DeepSpec saves
its own copies of the target's `embed_tokens.weight` and `lm_head.weight` and uses them.

Per draft slot k with post-norm hidden h_k and predecessor token prev_k (the token before the
one slot k proposes; along an accepted prefix the sampled draft equals the stored token, so
teacher forcing is exact), e_k = W1[prev_k]:
  vanilla  bias_k = W2 e_k
  gated    bias_k = W2 (sigmoid(gate_proj([h_k ; e_k])) * e_k)
  rnn      s_{-1} = 0; [a, c, o] = chunk3(joint_proj([s_{k-1} ; e_k ; h_k]));
           s_k = sigmoid(a) s_{k-1} + (1 - sigmoid(a)) tanh(c); bias_k = W2 tanh(o)
  logits_k = lm_head(h_k) + bias_k; greedy draft argmax; confidence c_k = proj([h_k ; e_k]) (or h_k);
  DeepSpec proposes the slots before the first with sigmoid(c_k) < threshold (threshold <= 0: all).
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.common import timing
from pipeline.common.sampling import Sampling
from proposers.interface import Drafts
from proposers.toolkit.block_drafter import BlockDrafter
from proposers.toolkit.config import DrafterConfig
from proposers.toolkit.conventions import REFERENCE, Conventions
from proposers.toolkit.vocab import target_ids

# Early SpecForge DSpark checkpoints saved the heads under a `logit_head.` container; SpecForge
# maps them back on load (specforge/modeling/draft/dflash.py:296-332), and so does this model.
LEGACY_PREFIXES = {"logit_head.markov_head.": "markov_head.", "logit_head.confidence_head.": "confidence_head."}
# layouts whose checkpoint may carry the target's embedding and lm_head (DeepSpec saves copies; vLLM
# loads a Qwen3-Omni drafter's when present, else shares the target's: qwen3_dspark.py:325-365)
OWN_COPIES = ("deepspec", "qwen3-omni")
GREEDY_BELOW = 1e-5  # DeepSpec samples greedily (one-hot q) below this temperature (utils/sampling.py)


def current_name(name: str) -> str:
    """A weight name with SpecForge's old `logit_head.*` head prefix mapped to the current one."""
    old = next((p for p in LEGACY_PREFIXES if name.startswith(p)), None)
    return LEGACY_PREFIXES[old] + name[len(old) :] if old else name


def rename_legacy_keys(state: dict) -> dict:
    """`state` with SpecForge's old head names mapped to the current ones."""
    return {current_name(name): tensor for name, tensor in state.items()}


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, out_vocab: int, rank: int, hidden: int, kind: str):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, out_vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def prev_embeddings(self, previous: torch.Tensor) -> torch.Tensor:
        """[a, D, r] W1 rows of the predecessor tokens (an unknown token, -1, reads row 0: such a
        slot is past the stored response and never verified)."""
        return self.markov_w1(previous.long().clamp(min=0))

    def latent(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """[a, D, r]: what W2 maps to the bias of each slot."""
        e = self.prev_embeddings(previous).to(self.markov_w2.weight.dtype)
        if self.kind == "vanilla":
            return e
        hidden = hidden.to(e.dtype)
        if self.kind == "gated":
            return self._gated(hidden, e)
        return self._recurrent(hidden, e)

    def _gated(self, hidden: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1))) * e

    def _rnn_step(self, state: torch.Tensor, e: torch.Tensor, hidden: torch.Tensor):
        """(tanh(o_k), the next state) of the rnn head at one slot: [a, r], [a, r], [a, H]."""
        gate, candidate, output = self.joint_proj(torch.cat([state, e, hidden], dim=-1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        return torch.tanh(output), gate * state + (1.0 - gate) * torch.tanh(candidate)

    def _recurrent(self, hidden: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The rnn head's outputs tanh(o_k): sequential over the slots, all anchors at once; the
        state starts at zero at the block's first slot."""
        state = e.new_zeros(e.shape[0], self.rank)
        outputs = []
        for k in range(e.shape[1]):
            output, state = self._rnn_step(state, e[:, k], hidden[:, k])
            outputs.append(output)
        return torch.stack(outputs, dim=1) if outputs else e

    @torch.no_grad()
    def own_predecessors(self, hidden: torch.Tensor, base: torch.Tensor, first: torch.Tensor, ids=None):
        """[a, D] each slot's predecessor along the drafter's own greedy chain: prev_0 = `first`
        (the anchor token), prev_k = argmax(base_{k-1} + bias_{k-1}) given prev_{k-1}, as DeepSpec's
        proposal and llama.cpp's in-graph chain (src/models/dflash.cpp:383-385) take them. Past the
        first rejected draft they are not the stored tokens, and the confidence cut there decides how
        many drafts the loop proposes. `base` [a, D, Vo] over the output vocabulary, `ids` its target ids."""
        previous = first.new_empty(base.shape[:2])
        previous[:, 0] = first
        state = base.new_zeros(base.shape[0], self.rank, dtype=self.markov_w2.weight.dtype)
        for k in range(base.shape[1] - 1):
            e = self.prev_embeddings(previous[:, k]).to(self.markov_w2.weight.dtype)
            h = hidden[:, k].to(e.dtype)
            if self.kind == "gated":
                e = self._gated(h, e)
            elif self.kind == "rnn":
                e, state = self._rnn_step(state, e, h)
            best = (base[:, k] + self.markov_w2(e).to(base.dtype)).argmax(dim=-1)
            previous[:, k + 1] = best if ids is None else ids[best]
        return previous

    def forward(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """[a, D, Vo] logit bias."""
        return self.markov_w2(self.latent(hidden, previous))


class ConfidenceHead(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.proj = nn.Linear(features, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDrafter(BlockDrafter):
    rowwise_drafts = False  # each draft depends on its predecessor (the Markov head)
    canonical_names = staticmethod(rename_legacy_keys)

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        options, hidden = config.family_options, config.hidden_size
        out_vocab = config.draft_vocab_size or config.vocab_size
        rank = options["markov_rank"]
        self.markov_head = (
            MarkovHead(config.vocab_size, out_vocab, rank, hidden, options["markov_head_type"]) if rank else None
        )
        with_markov = options["confidence_head_with_markov"]
        self.confidence_head = ConfidenceHead(hidden + rank * with_markov) if options["confidence_head"] else None
        self.embed_tokens = None
        if config.draft_vocab_size is None and config.layout in OWN_COPIES:  # its own copies of the target's
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden)  # (qwen3/modeling.py:227-246)
            self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.register_load_state_dict_pre_hook(_rename_legacy_heads)

    # -- weights the replay takes from the target unless the checkpoint has its own ----------

    @property
    def optional_weights(self) -> tuple[str, ...]:
        """Weights a checkpoint may leave out, the target's then used in their place (DeepSpec's
        frozen copies of the target's embedding and lm_head)."""
        return ("embed_tokens.weight", "lm_head.weight") if self.config.layout in OWN_COPIES else ()

    def markov_bias(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        """[a, D, Vo] bias over the output vocabulary, None without a Markov head."""
        if self.markov_head is None:
            return None
        with timing.stage("markov head", rows=hidden.shape[0] * hidden.shape[1]):
            return self.markov_head(hidden, previous)

    def confidence(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        """[a, D] float32 confidence logits (sigmoid: predicted acceptance), None without the head."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.config.family_options["confidence_head_with_markov"]:
            e = self.markov_head.prev_embeddings(previous).to(hidden.dtype)
            features = torch.cat([hidden, e], dim=-1)
        return self.confidence_head(features).float()

    def proposal_limit(self, confidence: torch.Tensor | None) -> torch.Tensor | None:
        """[a] drafts proposed: the slots before the first whose sigmoid(confidence) is below the
        threshold (DeepSpec eval/dspark/draft_ops.py:82-93; llama.cpp common/speculative.cpp:
        1268-1276 with --spec-draft-p-min); None when nothing is cut."""
        if confidence is None or self.config.family_options["confidence_threshold"] <= 0.0:
            return None
        return first_cut(self.below_threshold(confidence))

    def below_threshold(self, confidence: torch.Tensor) -> torch.Tensor:
        """[a, D] bool: the slots the cut stops at, strictly below the threshold (a slot at it is proposed)."""
        return torch.sigmoid(confidence) < self.config.family_options["confidence_threshold"]

    def drafts(self, hidden, lm_head, previous, conventions: Conventions = REFERENCE) -> Drafts:
        """Teacher-forced drafts at the draft slots `hidden` [a, D, H], `previous` [a, D] the
        token before each draft's target: logits base + Markov bias over the target vocabulary
        (greedy draft = their argmax, as DeepSpec's), and the confidence head's cut: along the
        stored tokens (`limit`, what acceptance sees) and along the drafter's own greedy chain
        (`drafted`, what the loop proposes: they differ past the first rejected draft)."""
        scores = self.head_logits(hidden, self.head_weight(lm_head), conventions)
        own = None
        if self.cuts_by_previous:
            ids = None if self.d2t is None else target_ids(self.d2t)
            own = self.markov_head.own_predecessors(hidden, scores, previous[:, 0], ids)
        bias = self.markov_bias(hidden, previous)
        if bias is not None:
            scores = scores.add_(bias.to(scores.dtype))
        limit = self.proposal_limit(self.confidence(hidden, previous))
        drafted = None if own is None else self.proposal_limit(self.confidence(hidden, own))
        return Drafts(self.to_target(scores), limit=limit, drafted=drafted)

    @property
    def cuts_by_previous(self) -> bool:
        """Whether the confidence cut reads each slot's predecessor (a head over [h ; W1[prev]] and
        a threshold above 0)."""
        options = self.config.family_options
        with_markov = self.confidence_head is not None and options["confidence_head_with_markov"]
        return with_markov and options["confidence_threshold"] > 0.0

    def draft_logprob(self, logits: torch.Tensor, tokens: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """log q_k(tokens) as DeepSpec samples: softmax((base + bias) / T), temperature only
        (no top-k/top-p; utils/sampling.py:6-27). vllm_draft_logprob is vLLM's rule."""
        tokens = tokens.long().clamp(min=0)[..., None]
        if sampling.temperature < GREEDY_BELOW:  # one-hot at the argmax
            hit = logits.argmax(dim=-1, keepdim=True) == tokens
            return torch.where(hit, 0.0, float("-inf"))[..., 0]
        scores = logits.float() / sampling.temperature
        return scores.gather(-1, tokens)[..., 0] - torch.logsumexp(scores, dim=-1)


def first_cut(below: torch.Tensor) -> torch.Tensor:
    """[a] the index of each row's first True in `below` [a, D] (D where none): the drafts kept
    before it."""
    if below.shape[-1] == 0:  # a block with no draft slot left
        return torch.zeros(below.shape[:-1], dtype=torch.long, device=below.device)
    first = below.to(torch.int8).argmax(dim=-1)
    return torch.where(below.any(dim=-1), first, torch.full_like(first, below.shape[-1]))


def _rename_legacy_heads(module, state_dict, prefix, *_):
    """load_state_dict pre-hook: old SpecForge head names load as the current ones."""
    for name in [n for n in state_dict if n.startswith(prefix)]:
        new = prefix + current_name(name[len(prefix) :])
        if new != name:
            state_dict[new] = state_dict.pop(name)


# ---------------------------------------------------------------------------------------------
# the vLLM variant of q (not the reference's)


def vllm_top_k_top_p(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's `apply_top_k_top_p` (v1/sample/ops/topk_topp_sampler.py, the sort path) on [..., V]
    temperature-scaled scores: top-k keeps every score >= the k-th largest (ties kept); top-p
    sorts ascending and drops the scores whose cumulative probability is <= 1 - p, always
    keeping the largest. Dropped scores become -inf."""
    if top_k <= 0 and top_p >= 1.0:
        return scores
    flat = scores.reshape(-1, scores.shape[-1])
    ordered, order = flat.sort(dim=-1)
    if top_k > 0:
        kth = ordered[:, max(ordered.shape[-1] - top_k, 0)][:, None]
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    if top_p < 1.0:
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
        drop[:, -1] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(flat).scatter_(-1, order, ordered).view_as(scores)


def vllm_draft_logprob(logits: torch.Tensor, tokens: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """log q_k(tokens) as vLLM's DSpark sampler computes its draft probabilities
    (v1/spec_decode/dspark_sampling.py `_sample_from_logits`): (base + bias) / T, then vLLM's
    top-k/top-p, then softmax. A variant: DeepSpec, the reference, applies neither filter."""
    tokens = tokens.long().clamp(min=0)[..., None]
    scores = vllm_top_k_top_p(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    return scores.gather(-1, tokens)[..., 0] - torch.logsumexp(scores, dim=-1)
