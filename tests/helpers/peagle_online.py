"""P-EAGLE for the tests, from the public references' code only (tests/parity/test_peagle_parity.py):
speculators' own `PEagleDraftModel` (PyPI speculators 0.9.0: built by its own config classes,
fitted by its own training forward with its COD sampling, saved by its own save_pretrained), its
own forward run at chosen anchors (`reference_logits`), and an online loop of vLLM's parallel
drafting rule over speculators' modules on a growing cache (`propose`).

vLLM 0.33.0's rule (v1/spec_decode/llm_base_proposer.py with `parallel_drafting`: `propose`, its
input preparation kernel and `mask_hidden` through `combine_hidden_states`, 895-930 and 1403-1416): one drafter forward a step over the verified tokens shifted left
(slot s reads x_{s+1} and the target's features at s, the last one the token just sampled), then
K - 1 slots of `mask_token_id` whose hidden input is `mask_hidden` through `combine_hidden_states`
(fc), at positions last + 1 .. last + K - 1, causal; the outputs of the last verified slot and the
K - 1 mask slots give the K drafts (argmax). The mask slots' cache entries are overwritten by the
next step's verified slots, as the cache here is cut back after each verification.
"""

from __future__ import annotations

import torch
from dflash.model import _sample_probs

from tests.helpers import eagle3_online as eagle3
from tests.helpers.dspark_online import verifier_weights
from tests.helpers.eagle3_reference import decoder_config
from tests.helpers.models import seeded

MASK_TOKEN = 1  # a token id the tiny target's responses never hold (its ids 3.. are the live ones)


def speculators_config(vocab: int, hidden: int, aux_ids, steps: int, shapes: dict | None = None):
    """speculators' PEagleSpeculatorConfig: one Llama layer (the tiny widths, or `shapes`: heads,
    kv_heads, head_dim, mlp), the whole vocabulary, `aux_ids` before-layer ids, `steps` speculative
    tokens (its num_depths), MASK_TOKEN."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.peagle import PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    return PEagleSpeculatorConfig(
        transformer_layer_config=decoder_config("llama", vocab=vocab, hidden=hidden, **(shapes or {})),
        draft_vocab_size=vocab,
        eagle_aux_hidden_state_layer_ids=list(aux_ids),
        mask_token_id=MASK_TOKEN,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )


def new_drafter(target, *, aux_ids, steps: int, seed: int = 0):
    """speculators' PEagleDraftModel for the target's widths (Llama layers, its own init), the
    target's embedding, lm_head and final norm copied where its training reads the verifier's; the
    embedding stays trainable as P-EAGLE trains it (`embed_requires_grad`), the heads frozen."""
    from speculators.models.peagle.core import PEagleDraftModel

    width = target.config
    with seeded(seed):
        model = PEagleDraftModel(speculators_config(width.vocab_size, width.hidden_size, aux_ids, steps))
    return verifier_weights(model, target, train_embedding=True)


def fit(model, documents: list[dict], *, steps: int, lr: float = 5e-3, seed: int = 0) -> list[float]:
    """`steps` AdamW steps of the model's own training forward (kl_div, eager, its COD sampling over
    `num_depths` = its speculative tokens) on 4 random documents packed (eagle3_online's loop)."""
    depths = model.config.speculators_config.proposal_methods[0].speculative_tokens
    kwargs = type(model).get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager")[0] | {"num_depths": depths}
    return eagle3.fit(model, documents, steps=steps, lr=lr, seed=seed, kwargs=kwargs)


@torch.no_grad()
def reference_logits(model, features: torch.Tensor, ids: torch.Tensor, anchors: list[int], monkeypatch) -> list:
    """Per anchor of `anchors` (this project's t: x_t the last committed token), speculators' own
    training forward's draft logits [k, V] there, for one sequence (features [T, n*H], ids [T]) fed
    as its data pipeline shifts them (row i: x_{i+1}, g_i): its COD sampler replaced by the rows
    wanted, every row at depth 0 and depths 1..k-1 at row t - 1 (k = K, fewer where a depth would
    run past the sequence, which its indexing refuses); its lm_head's output read."""
    import speculators.models.peagle.core as core

    depths = model.config.speculators_config.proposal_methods[0].speculative_tokens
    rows = ids.numel() - 1
    ks = [min(depths, rows - t + 1) for t in anchors]
    anchor_pos = torch.cat([torch.arange(rows)] + [torch.full((k - 1,), t - 1) for t, k in zip(anchors, ks)])
    depth = torch.cat([torch.zeros(rows, dtype=torch.long)] + [torch.arange(1, k) for k in ks])
    monkeypatch.setattr(core, "generate_cod_sample_indices", lambda **_: (anchor_pos, depth))
    captured = []
    hook = model.lm_head.register_forward_hook(lambda _m, _args, out: captured.append(out[0].float()))
    kwargs = type(model).get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager")[0] | {"num_depths": depths}
    try:
        model(
            hidden_states=features[:-1][None],
            input_ids=ids[1:][None],
            document_ids=torch.zeros(1, rows, dtype=torch.long),
            verifier_last_hidden_states=torch.zeros(1, rows, model.config.transformer_layer_config.hidden_size),
            **kwargs,
        )
    finally:
        hook.remove()
        monkeypatch.undo()
    masks = captured[0][rows:].split([k - 1 for k in ks])
    return [torch.cat([captured[0][t - 1 : t], rest]) for t, rest in zip(anchors, masks)]


@torch.no_grad()
def propose(draft: eagle3.DraftCache, features, seq, start: int, count: int, temperature: float) -> eagle3.Proposal:
    """`count` drafts at anchor `start` by vLLM's parallel drafting rule (module docstring): the
    verified slots up to start - 1 appended, then count - 1 mask slots in the same pass. Greedy:
    each slot's argmax (vLLM's); T > 0: each slot's draft drawn from softmax(logits / T), the slots
    independently (no slot reads another's draft), as specreplay scores every family with logits."""
    model, written = draft.model, draft.length
    nxt = seq[written + 1 : start + 1]  # slot s reads x_{s+1}
    masks = count - 1
    embeds = model.embed_tokens(torch.cat([nxt, torch.full((masks,), model.mask_token_id)]))
    hidden = torch.cat([model.fc(features[written:start]), model.fc(model.mask_hidden[0]).expand(masks, -1)])
    logits = draft.logits(draft.append(embeds, hidden)[-count:])
    top2 = logits.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    if temperature <= 0:
        return eagle3.Proposal(logits.argmax(dim=-1), None, margins)
    q = torch.softmax(logits / temperature, dim=-1)
    return eagle3.Proposal(_sample_probs(q), q, margins)


def online_peagle(model, target, prompt, max_new_tokens: int, stop_ids, temperature: float = 0.0):
    """The online loop (eagle3_online's: its budget, verification, z-lab's rejection sampling at
    T > 0 and stop rules) with parallel drafting's proposals."""
    return eagle3.online_eagle3(model, target, prompt, max_new_tokens, stop_ids, temperature, proposer=propose)


def random_peagle(
    save_dir, *, vocab: int, hidden: int, aux_ids, steps: int = 4, seed: int = 0, std: float = 0.2, shapes=None
) -> str:
    """speculators' PEagleDraftModel with every weight drawn N(0, std) (its embedding and lm_head
    included, which its own init leaves to the verifier's), saved by its own save_pretrained."""
    from speculators.models.peagle.core import PEagleDraftModel

    with seeded(seed), torch.no_grad():
        model = PEagleDraftModel(speculators_config(vocab, hidden, aux_ids, steps, shapes))
        for parameter in model.parameters():
            parameter.normal_(0.0, std)
    model.save_pretrained(str(save_dir))
    return str(save_dir)
