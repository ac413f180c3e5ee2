"""An online EAGLE-3 decoding loop written from the public reference's modules, with a real growing
KV cache one step at a time as vLLM's EagleProposer runs it, and speculators' training forward to
fit the drafter it drives (tests/parity/test_eagle3_parity.py).

The drafter is speculators' `Eagle3DraftModel` (PyPI speculators 0.9.0): its `fc`, its first
decoder layer (`layers[0]`, q/k/v over [input_layernorm(embedding) ; hidden_norm(hidden)]), its
`norm`, `lm_head`, `d2t` and `rotary_emb`, called on a transformers `DynamicCache`. vLLM's rule
(v1/spec_decode/eagle.py `propose`, models/llama_eagle3.py): draft KV slot s holds (embed(x_{s+1}),
fc(g_s)) at position s, written from the target's features g of verified positions only; at anchor
t (x_t the last committed token) the slots up to t - 1 are written (the ones not yet in the cache),
slot t - 1's last hidden state h_1 gives draft 1; step j > 1 appends (embed(d_{j-1}), h_{j-1}) at
position t + j - 2 (h pre-norm, post-norm with `norm_output`) and drafts from it; logits
lm_head(norm(h)) over the draft vocabulary, mapped through d2t. After verification the cache is
cut back to the slots below t (the draft slots go) and the newly verified slots are written from
the target's features, as vLLM overwrites them. Greedy: argmax drafts, the leading ones equal to
the target's argmax accepted. Sampled: d_j ~ softmax(logits / T) over the draft vocabulary, z-lab's
`_rejection_sample`. Steps, the budget and stop tokens follow z-lab's `dflash_generate` as in
tests/helpers/dspark_online.py, whose tiny target and feature capture this loop shares. Nothing here
imports specreplay's code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from dflash.model import _rejection_sample, _sample_probs, sample

from tests.helpers.dspark_online import commit, target_states, verifier_weights
from tests.helpers.eagle3_reference import speculators_eagle3
from tests.helpers.masks import broadcast_masks
from tests.helpers.models import seeded

# ---------------------------------------------------------------------------------------------
# speculators' Eagle3DraftModel: build, fit with its own training forward


def new_drafter(target, *, aux_ids, steps: int, draft_vocab: torch.Tensor | None = None, seed: int = 0):
    """speculators' Eagle3DraftModel for the target's widths (Llama layers, speculators' own init),
    the target's embedding, lm_head (its draft-vocabulary rows) and final norm in the weights its
    training reads from the verifier, frozen as its load_verifier_weights leaves them."""
    config = target.config
    model = speculators_eagle3(
        vocab=config.vocab_size,
        hidden=config.hidden_size,
        aux_ids=aux_ids,
        steps=steps,
        kind="llama",
        draft_vocab=draft_vocab,
        std=None,
        seed=seed,
    )
    return verifier_weights(model, target, None if draft_vocab is None else target.lm_head.weight[draft_vocab])


def training_documents(target, sequences: list[torch.Tensor], prompt_lens: list[int]) -> list[dict]:
    """Per sequence, speculators' training fields (training_document) from the target's states."""
    documents = []
    for ids, prompt_len in zip(sequences, prompt_lens):
        _, features, pre_norm = target_states(target, ids)
        documents.append(training_document(ids, prompt_len, features, pre_norm))
    return documents


def training_document(ids: torch.Tensor, prompt_len: int, features: torch.Tensor, pre_norm: torch.Tensor) -> dict:
    """speculators' training fields of one sequence after its `shift_batch` (index i: x_{i+1}, g_i,
    the verifier's pre-norm state at i + 1, position i + 1), the loss on response anchors."""
    loss_mask = (torch.arange(ids.numel()) >= prompt_len).long()
    return dict(
        hidden_states=features[:-1],
        input_ids=ids[1:],
        verifier_last_hidden_states=pre_norm[1:],
        loss_mask=loss_mask[1:],
        position_ids=torch.arange(1, ids.numel()),
    )


def packed_batch(documents: list[dict]) -> dict:
    """Documents packed as speculators' trainer collates them: batch dim 1, one document id each."""
    batch = {key: torch.cat([d[key] for d in documents])[None] for key in documents[0]}
    batch["document_ids"] = torch.cat([torch.full((d["input_ids"].numel(),), i) for i, d in enumerate(documents)])[None]
    return batch


def fit(
    model, documents: list[dict], *, steps: int, lr: float = 3e-3, per_step: int = 4, seed: int = 0, kwargs=None
) -> list[float]:
    """`steps` AdamW steps of the model's own training forward (kl_div over its TTT steps, eager;
    `kwargs` another family's training arguments, P-EAGLE's) on `per_step` random documents
    packed; returns the losses."""
    ttt = model.config.speculators_config.proposal_methods[0].speculative_tokens
    kwargs = (
        kwargs
        or type(model).get_trainer_kwargs(
            loss_fn="kl_div", loss_implementation="eager", ttt_steps=ttt, ttt_step_loss_decay=1.0
        )[0]
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    model.train()
    with seeded(seed), broadcast_masks():
        for _ in range(steps):
            chosen = torch.randperm(len(documents))[:per_step].tolist()
            _, loss, _ = model(**packed_batch([documents[i] for i in chosen]), **kwargs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
    model.eval()
    return losses


# ---------------------------------------------------------------------------------------------
# the drafter on a growing cache


class GrowingCache:
    """A drafter's transformers cache for one sequence, grown slot by slot and cut back (`cache`)."""

    cache = None

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def crop(self, length: int) -> None:
        """Keep slots 0..length - 1 (transformers 5 crops by the number of slots removed)."""
        self.cache.crop(length - self.length)


class DraftCache(GrowingCache):
    """The drafter's KV cache for one sequence and the rows it writes (speculators' first layer)."""

    def __init__(self, model):
        from transformers import DynamicCache

        self.model, self.cache = model, DynamicCache()
        self.feed = model.norm if model.config.norm_output else (lambda h: h)

    @torch.no_grad()
    def append(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Write slots length.. from embeddings and hidden inputs [n, H] (causal among themselves,
        seeing every cached slot); returns the last layer's output [n, H] (pre-norm)."""
        n, start = embeds.shape[0], self.length
        x = torch.cat([embeds, hidden], dim=-1)[None]
        positions = torch.arange(start, start + n)[None]
        mask = torch.zeros(1, 1, n, start + n)
        mask.masked_fill_(torch.arange(start + n)[None, :] > (start + torch.arange(n))[:, None], float("-inf"))
        embeddings = self.model.rotary_emb(x, positions)
        h = x
        for layer in self.model.layers:
            h = layer(
                h,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=self.cache,
                cache_position=positions[0],
                position_embeddings=embeddings,
            )
        return h[0]

    def slots(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The target-written slots length.. from the tokens they read [n] and the target's
        features [n, n*H]; the last layer's output [n, H]."""
        return self.append(self.model.embed_tokens(tokens), self.model.fc(features))

    def step(self, token: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """One draft step: the token [1] and the previous step's output h [1, H] fed back."""
        return self.append(self.model.embed_tokens(token.reshape(1)), self.feed(h))

    def draft_probs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q over the draft vocabulary after the step whose output is h [1, H] (sglang's probs),
        the target id of each entry)."""
        model = self.model
        q = torch.softmax(model.lm_head(model.norm(h)).float()[0], dim=-1)
        return q, torch.arange(q.numel()) + (model.d2t if model.d2t is not None else 0)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[n, V] draft logits over the target's vocabulary, -inf outside the draft vocabulary."""
        draft = self.model.lm_head(self.model.norm(h)).float()
        if self.model.d2t is None:
            return draft
        out = draft.new_full((h.shape[0], self.model.config.transformer_layer_config.vocab_size), float("-inf"))
        out[:, torch.arange(draft.shape[-1]) + self.model.d2t] = draft
        return out


@dataclass
class Proposal:
    drafts: torch.Tensor  # [n]
    probs: torch.Tensor | None  # [n, V] q of each draft (T > 0)
    margins: list[float]  # greedy: each draft's logit minus the runner-up's (a near-tie flips)


@torch.no_grad()
def propose(draft: DraftCache, features, seq, start: int, count: int, temperature: float) -> Proposal:
    """`count` drafts at anchor `start`: the target-written slots up to start - 1 appended (their
    features `features` [>= start, n*H]), then one step at a time on the growing cache."""
    written = draft.length
    h = draft.slots(seq[written + 1 : start + 1], features[written:start])[-1:]  # slot s reads x_{s+1}
    drafts, probs, margins = [], [], []
    for j in range(count):
        logits = draft.logits(h)[0]
        top2 = logits.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        if temperature > 0:
            q = torch.softmax(logits / temperature, dim=-1)
            token = _sample_probs(q[None])[0]
            probs.append(q)
        else:
            token = logits.argmax()
        drafts.append(token)
        if j + 1 < count:
            h = draft.step(token, h)
    stacked = torch.stack(drafts) if drafts else torch.zeros(0, dtype=torch.long)
    return Proposal(stacked, torch.stack(probs) if probs else None, margins)


# ---------------------------------------------------------------------------------------------
# the online loop

# What the loops call on a drafter: speculators' models here; another reference (the EAGLE
# repository's, tests/helpers/eagle1_online.py) brings its own cache, target states and step count


def cache_for(model):
    return model.new_cache() if hasattr(model, "new_cache") else DraftCache(model)


def states_for(model):
    """(target, ids) -> (logits, the drafter's features, the pre-norm last hidden state)."""
    return getattr(model, "states", target_states)


def steps_of(model) -> int:
    steps = getattr(model, "steps", None)
    return steps if isinstance(steps, int) else model.config.speculators_config.proposal_methods[0].speculative_tokens


@dataclass
class OnlineRun:
    output_ids: torch.Tensor  # prompt + response
    produced: list[int] = field(default_factory=list)  # tokens each step produced
    accepted: list[int] = field(default_factory=list)  # drafts each step accepted
    drafts: list[list[int]] = field(default_factory=list)  # each step's drafts
    margins: list[list[float]] = field(default_factory=list)  # each step's drafts' logit margins

    @property
    def tau(self) -> float | None:
        return sum(self.produced) / len(self.produced) if self.produced else None


def verify(target_logits: torch.Tensor, proposal: Proposal, temperature: float) -> tuple[int, torch.Tensor]:
    """(accepted drafts, the token after them) from the target's logits [n + 1, V] at
    [x_start, d_1..d_n]: greedy, the leading drafts equal to its argmax; sampled, z-lab's
    `_rejection_sample`."""
    drafts = proposal.drafts
    if temperature <= 0:
        posterior = target_logits.argmax(dim=-1)
        accepted = int((drafts == posterior[: drafts.numel()]).long().cumprod(0).sum())
        return accepted, posterior[accepted]
    if drafts.numel() == 0:
        return 0, sample(target_logits[-1:], temperature)[0]
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    accepted, bonus = _rejection_sample(drafts[None], p[None], proposal.probs[None])
    return int(accepted), bonus


@torch.no_grad()
def online_eagle3(
    model, target, prompt, max_new_tokens: int, stop_ids, temperature: float = 0.0, proposer=None
) -> OnlineRun:
    """The loop (module docstring) for `prompt` [P]; sampled steps draw from torch's global
    generator (seed it). The target runs from scratch over the committed tokens and the drafts at
    each verification. `proposer`: another family's proposal with `propose`'s arguments (P-EAGLE's
    parallel drafting), the loop around it unchanged."""
    proposer, states = proposer or propose, states_for(model)
    steps = steps_of(model)
    prompt_len = prompt.numel()
    max_length = prompt_len + max_new_tokens
    logits, features, _ = states(target, prompt)
    first = logits[-1].argmax() if temperature <= 0 else sample(logits[-1:], temperature)[0]
    seq = torch.cat([prompt, first.reshape(1)])
    run, draft = OnlineRun(seq), cache_for(model)
    start, stopped = prompt_len, int(first) in stop_ids
    while start + 1 < max_length and not stopped:
        proposal = proposer(draft, features, seq, start, min(steps, max_length - start - 1), temperature)
        draft.crop(start)  # the draft slots go; the verified ones are rewritten from target features
        candidate = torch.cat([seq[: start + 1], proposal.drafts])
        logits, candidate_features, _ = states(target, candidate)
        accepted, bonus = verify(logits[start:], proposal, temperature)
        new_tokens = torch.cat([proposal.drafts[:accepted], bonus.reshape(1)])
        seq, features, produced, stopped = commit(
            seq, features, candidate_features, start, new_tokens, max_length, stop_ids
        )
        start += produced
        run.produced.append(produced)
        run.accepted.append(accepted)
        run.drafts.append(proposal.drafts.tolist())
        run.margins.append(proposal.margins)
    run.output_ids = seq[: min(start + 1, max_length)]
    return run
