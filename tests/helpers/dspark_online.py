"""An online DSpark decoding loop written from the public references' modules, and what the
end-to-end parity tests (tests/parity/test_dspark_parity.py) need around it.

The drafter is speculators' `DSparkDraftModel` (PyPI speculators 0.9.0). At each step with
x_start committed, its own `_backbone_forward` gives the block's hidden states at anchor
`start` from the target's features of positions < start; its `markov_head` and
`confidence_head` then draft slot by slot as DeepSpec's evaluator does
(deepspec/eval/dspark/draft_ops.py `build_dspark_proposal`): prev_0 = x_start, prev_k = the
previous draft, greedy argmax or a sample from softmax((base + bias) / T), the proposal cut at
the first slot with sigmoid(c_k) < threshold. The real target verifies [x_start, d_1..d_q]:
greedy, the leading drafts equal to its argmax; sampled, z-lab's `_rejection_sample`. Steps,
the budget and stop tokens follow z-lab's `dflash_generate` (dflash/model.py:179-330): the
block has min(block_size, max_length - start - 1) queries (no draft past the budget; the
reference's `block_size` attribute is set to that for the call), `produced` = accepted + 1
capped by the budget and cut after the first stop token. The target runs from scratch over the
committed tokens and the proposal at every step (no cache to roll back).

Also here: the tiny target, and speculators' own training forward to fit the drafter on the
target's real features. Nothing here imports specreplay's code: the loop is what it is
compared against.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from dflash.model import _rejection_sample, _sample_probs, sample

from tests.helpers.dspark_reference import AUX_IDS, MASK, TARGET_LAYERS, decoder_config, qwen3_config
from tests.helpers.masks import broadcast_masks
from tests.helpers.models import IM_END_ID, save_target, seeded

# ---------------------------------------------------------------------------------------------
# the target


def build_target(save_dir, *, seed: int = 0, logit_scale: float = 3.0) -> str:
    """A tiny random Qwen3ForCausalLM with the shapes of tests/helpers/dspark_reference.py
    (vocab 64, hidden 32, 6 layers: DeepSpec's drafter config is a copy of it), its lm_head
    scaled so next-token distributions are peaked enough for drafts to be accepted at T > 0.
    A large init std: with 0.02 a tiny random model's greedy output repeats one token."""
    from transformers import Qwen3ForCausalLM

    config = qwen3_config(TARGET_LAYERS)
    config.initializer_range = 0.5
    config.tie_word_embeddings = False
    config.eos_token_id = config.pad_token_id = IM_END_ID
    with seeded(seed):
        model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return save_target(model, save_dir)


@torch.no_grad()
def target_states(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [T, V], the drafter's features [T, n*H], the last layer's output before the final
    norm [T, H]) for the sequence `ids` [T]. speculators' aux_hidden_state_layer_ids are
    "before layer i" ids: transformers' hidden_states[i] (speculators convert/dflash/converter.py)."""
    captured = {}
    hook = target.model.norm.register_forward_hook(lambda _m, args, _out: captured.update(pre_norm=args[0]))
    try:
        out = target(ids[None], output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    features = torch.cat([out.hidden_states[i] for i in AUX_IDS], dim=-1)[0]
    return out.logits[0].float(), features, captured["pre_norm"][0]


# ---------------------------------------------------------------------------------------------
# speculators' DSparkDraftModel: build, fit with its own training forward


def new_drafter(target, *, head_type: str, block_size: int = 4, rank: int = 16, seed: int = 0):
    """speculators' DSparkDraftModel for the target's shapes (eager attention, full-attention
    layers, confidence head with the Markov embedding), default init, the target's embedding,
    lm_head and final norm in the weights its training reads from the verifier."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark.config import DSparkSpeculatorConfig
    from speculators.models.dspark.core import DSparkDraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    config = DSparkSpeculatorConfig(
        transformer_layer_config=decoder_config(),
        draft_vocab_size=target.config.vocab_size,
        block_size=block_size,
        aux_hidden_state_layer_ids=list(AUX_IDS),
        mask_token_id=MASK,
        sample_from_anchor=True,
        markov_rank=rank,
        markov_head_type=head_type,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block_size)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )
    with seeded(seed):
        model = DSparkDraftModel(config)
    return verifier_weights(model, target)


@torch.no_grad()
def verifier_weights(model, target, head: torch.Tensor | None = None, train_embedding: bool = False):
    """What a speculators drafter's load_verifier_weights copies from a verifier checkpoint, taken
    from the loaded target: its embedding, its lm_head (`head`: the draft vocabulary's rows) as the
    drafter's and the verifier's, its final norm; frozen as it leaves them (the embedding trainable
    for a family that trains its own, P-EAGLE). Returns the model."""
    head = target.lm_head.weight if head is None else head
    model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    model.lm_head.weight.copy_(head)
    model.verifier_lm_head.weight.copy_(head)
    model.verifier_norm.weight.copy_(target.model.norm.weight)
    frozen = (model.lm_head, model.verifier_lm_head, model.verifier_norm)
    for module in frozen if train_embedding else (model.embed_tokens, *frozen):
        module.requires_grad_(False)
    return model


def training_documents(target, sequences: list[torch.Tensor], prompt_lens: list[int]) -> list[dict]:
    """Per sequence, the fields of speculators' training batch: the target's features and
    pre-norm last hidden states, the loss on response positions (where the online loop anchors)."""
    documents = []
    for ids, prompt_len in zip(sequences, prompt_lens):
        _, features, pre_norm = target_states(target, ids)
        loss_mask = (torch.arange(ids.numel()) >= prompt_len).long()
        documents.append(dict(hidden_states=features, input_ids=ids, loss_mask=loss_mask, verifier=pre_norm))
    return documents


def packed_batch(documents: list[dict]) -> dict:
    """Documents packed as speculators' trainer collates them: batch dim 1, document ids,
    positions restarting at each document."""
    cat = {key: torch.cat([d[key] for d in documents])[None] for key in documents[0]}
    return dict(
        hidden_states=cat["hidden_states"],
        input_ids=cat["input_ids"],
        loss_mask=cat["loss_mask"],
        verifier_last_hidden_states=cat["verifier"],
        document_ids=torch.cat([torch.full((d["input_ids"].numel(),), i) for i, d in enumerate(documents)])[None],
        position_ids=torch.cat([torch.arange(d["input_ids"].numel()) for d in documents])[None],
    )


def fit(model, documents: list[dict], *, steps: int, lr=3e-3, per_step: int = 4, anchors: int = 32, seed=0, **knobs):
    """`steps` AdamW steps of the model's own training forward (kl_div and its confidence loss,
    eager implementations), each on `per_step` random documents packed, `anchors` random
    anchors among their response positions; `knobs` more of its get_trainer_kwargs' arguments
    (XPress's base_anchor_weight); returns the losses."""
    kwargs, _ = type(model).get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", max_anchors=anchors, **knobs
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    model.train()
    with seeded(seed), broadcast_masks():  # the document draw and select_anchors use the global generator
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
# one block through the reference's backbone


@contextlib.contextmanager
def block_of(model, queries: int):
    """The model's blocks `queries` long for the calls inside (`_backbone_forward`, its anchor
    selection and its mask read the instance's block_size), and its `_build_attention_mask`
    memoized: the mask is a function of the loss mask, the length and the block size alone
    (one document; select_anchors keeps every valid anchor when max_anchors allows, in order),
    and building it (flex attention's vmap over a mask function) costs more than the forward."""
    saved = model.block_size
    model.block_size = queries
    cache = model.__dict__.setdefault("_online_masks", {})
    build = type(model)._build_attention_mask

    def memoized(loss_mask, max_anchors, document_ids, device):
        assert not document_ids.any(), "one document"
        key = (loss_mask.shape[1], tuple(loss_mask[0].nonzero().flatten().tolist()), max_anchors, queries)
        if key not in cache:
            cache[key] = build(model, loss_mask, max_anchors, document_ids, device)
        return cache[key]

    model.__dict__["_build_attention_mask"] = memoized
    try:
        yield
    finally:
        model.block_size = saved
        del model.__dict__["_build_attention_mask"]


@torch.no_grad()
def block_hidden(model, features: torch.Tensor, ids: torch.Tensor, start: int, queries: int, every_anchor=False):
    """(post-norm hidden [queries, H], base logits lm_head(h) [queries, V]) of the block
    [ids[start], mask, ...] of `queries` queries at anchor `start`, from `features` of positions
    < start, through the reference's `_backbone_forward`: the sequence up to `start` padded with
    `queries` dummy positions (select_anchors never anchors in the last block_size positions),
    the loss mask only at `start` (max_anchors 1), or with `every_anchor` on every position
    (max_anchors = length: all of them in order, that block picked)."""
    length = start + 1 + queries
    hidden_size = model.config.transformer_layer_config.hidden_size
    padded = torch.zeros(1, length, features.shape[-1])
    padded[0, :start] = features[:start]
    tokens = torch.full((1, length), model.mask_token_id, dtype=torch.long)
    tokens[0, : start + 1] = ids[: start + 1]
    loss_mask = torch.ones(1, length, dtype=torch.long)
    if not every_anchor:
        loss_mask = torch.zeros_like(loss_mask)
        loss_mask[0, start] = 1
    anchors = length if every_anchor else 1
    with block_of(model, queries):
        hidden, logits, *_ = model._backbone_forward(
            padded,
            tokens,
            loss_mask,
            torch.zeros(1, length, hidden_size),  # only the training targets read it
            torch.zeros(1, length, dtype=torch.long),
            max_anchors=anchors,
        )
    pick = start if every_anchor else 0
    rows = slice(pick * queries, (pick + 1) * queries)
    return hidden[0, rows], logits[0, rows].float()


# ---------------------------------------------------------------------------------------------
# a proposal: slot by slot with the Markov head, cut by the confidence head


@dataclass
class Proposal:
    drafts: torch.Tensor  # [n] proposed draft tokens (n <= queries)
    probs: torch.Tensor | None  # [n, V] the drafter's q at each proposed slot (T > 0)
    confidence: torch.Tensor | None  # [queries] sigmoid(c_k) of every slot


@torch.no_grad()
def propose(model, hidden, base, anchor_token: int, temperature: float, threshold: float) -> Proposal:
    """DeepSpec's proposal (draft_ops.py `build_dspark_proposal`, markov_head.py
    `sample_draft_tokens`) on the reference's modules: slot k's logits are base_k plus the
    Markov bias given prev_k (x_start, then the previous draft; the rnn state runs over the
    block's slots, so the bias of slot k is the last of `block_bias` over slots 0..k), the
    draft their argmax or a sample from softmax(logits / T); the confidence head reads
    [h_k ; W1[prev_k]]; the proposal is the drafts before the first slot with sigmoid < threshold
    (all when threshold <= 0)."""
    queries = hidden.shape[0]
    previous = [anchor_token]
    drafts, probs = [], []
    for k in range(queries):
        prev = torch.tensor([previous])
        bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden[None, : k + 1])[0, k]
        logits = base[k] + bias.float()
        if temperature > 0:
            q = torch.softmax(logits / temperature, dim=-1)
            token = int(_sample_probs(q[None])[0])
            probs.append(q)
        else:
            token = int(logits.argmax())
        drafts.append(token)
        previous.append(token)
    prev = torch.tensor([previous[:queries]])
    features = torch.cat([hidden[None], model.markov_head.prev_embeddings(prev).to(hidden.dtype)], dim=-1)
    confidence = torch.sigmoid(model.confidence_head(features)[0].float())
    count = queries
    below = torch.nonzero(confidence < threshold).flatten()
    if threshold > 0 and below.numel():
        count = int(below[0])
    return Proposal(
        torch.tensor(drafts[:count], dtype=torch.long),
        torch.stack(probs[:count]) if temperature > 0 and count else None,
        confidence,
    )


# ---------------------------------------------------------------------------------------------
# the online loop


@dataclass
class OnlineRun:
    output_ids: torch.Tensor  # prompt + response
    produced: list[int] = field(default_factory=list)  # tokens each step produced
    drafts: list[list[int]] = field(default_factory=list)  # each step's proposed drafts
    queries: list[int] = field(default_factory=list)  # block queries each step
    confidence: list[torch.Tensor] = field(default_factory=list)  # each step's sigmoid(c_k)

    @property
    def tau(self) -> float | None:
        """Tokens per step; None when the first response token was already a stop token."""
        return sum(self.produced) / len(self.produced) if self.produced else None


@torch.no_grad()
def verify(target_logits: torch.Tensor, proposal: Proposal, temperature: float) -> tuple[int, torch.Tensor]:
    """(accepted drafts, the token after them) given the target's logits [n + 1, V] at
    [x_start, d_1..d_n]: greedy, the leading drafts equal to its argmax, the bonus its argmax
    after them; sampled, z-lab's `_rejection_sample` (accept with prob min(1, p/q), residual)."""
    drafts = proposal.drafts
    if temperature <= 0:
        posterior = target_logits.argmax(dim=-1)
        accepted = int((drafts == posterior[: drafts.numel()]).long().cumprod(0).sum())
        return accepted, posterior[accepted]
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    if drafts.numel() == 0:
        return 0, sample(target_logits[-1:], temperature)[0]
    accepted, bonus = _rejection_sample(drafts[None], p[None], proposal.probs[None])
    return int(accepted), bonus


def commit(seq, features, candidate_features, start: int, new_tokens, max_length: int, stop_ids):
    """One verified step committed, as dflash_generate commits it: the accepted drafts and the
    bonus (`new_tokens`), cut by the budget and at the first stop token; the target features of
    x_start and the accepted drafts (the committed positions before the next start) kept.
    Returns (seq, features, produced, stopped)."""
    produced = min(len(new_tokens), max_length - start - 1)
    stops = [i for i, t in enumerate(new_tokens[:produced].tolist()) if t in stop_ids]
    if stops:
        produced = stops[0] + 1
    seq = torch.cat([seq[: start + 1], new_tokens[:produced]])
    features = torch.cat([features[:start], candidate_features[start : start + produced]])
    return seq, features, produced, bool(stops)


@torch.no_grad()
def online_dspark(
    model, target, prompt: torch.Tensor, max_new_tokens: int, stop_ids, temperature: float = 0.0, threshold=0.0
) -> OnlineRun:
    """The online loop (module docstring) for `prompt` [P]; sampled steps draw from torch's
    global generator (seed it). The target runs from scratch over the committed tokens and the
    proposal at each verification: its features of the committed positions are those of the
    causal forward, as dflash_generate keeps them."""
    prompt_len = prompt.numel()
    max_length = prompt_len + max_new_tokens
    logits, features, _ = target_states(target, prompt)
    first = logits[-1].argmax() if temperature <= 0 else sample(logits[-1:], temperature)[0]
    seq = torch.cat([prompt, first.reshape(1)])
    run = OnlineRun(seq)
    start, stopped = prompt_len, int(first) in stop_ids
    while start + 1 < max_length and not stopped:
        queries = min(model.config.block_size, max_length - start - 1)
        hidden, base = block_hidden(model, features, seq, start, queries)
        proposal = propose(model, hidden, base, int(seq[start]), temperature, threshold)
        candidate = torch.cat([seq[: start + 1], proposal.drafts])
        logits, candidate_features, _ = target_states(target, candidate)
        accepted, bonus = verify(logits[start:], proposal, temperature)
        new_tokens = torch.cat([proposal.drafts[:accepted], bonus.reshape(1)])
        seq, features, produced, stopped = commit(
            seq, features, candidate_features, start, new_tokens, max_length, stop_ids
        )
        start += produced
        run.produced.append(produced)
        run.drafts.append(proposal.drafts.tolist())
        run.queries.append(queries)
        run.confidence.append(proposal.confidence)
    run.output_ids = seq[: min(start + 1, max_length)]
    return run
