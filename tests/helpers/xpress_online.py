"""speculators' XPress drafter built, fitted and run online from its own modules, for the end-to-end
parity test (tests/parity/test_xpress_parity.py). Nothing here imports specreplay's code.

The drafter is speculators' `XPressDraftModel` (PyPI speculators 0.9.0) at the tiny target's shapes
(tests/helpers/dspark_online.py), fitted by its own training forward (a teacher-forced refine pass,
consistency rounds, the base-logits anchor term). speculators ships no XPress inference loop; its
rule is the one its forward's consistency rounds run and its config calls inference-time Jacobi
decoding (models/xpress/core.py, config.py `num_jacobi_passes`): at anchor `start` the backbone's
block [x_start, mask, ...] (`_backbone_forward`, here through dspark_online.block_hidden), pred = the
base logits' argmax, then K times: slot 0 of pred set to the anchor, prev = [x_{start-1},
pred_0..pred_{B-2}], pred = argmax(base + refiner_head.block_bias(prev, hcache)). The drafts are
pred at slots 1..B-1. The online loop verifies them with the real target as dspark_online's does
(greedy: the leading drafts equal to its argmax), the block always B slots (the refiner's mixer is
B x B), the budget and stop tokens cutting what a step commits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tests.helpers.dspark_online import (
    OnlineRun,
    Proposal,
    block_hidden,
    commit,
    target_states,
    verifier_weights,
    verify,
)
from tests.helpers.dspark_reference import AUX_IDS, MASK, decoder_config
from tests.helpers.models import seeded


@dataclass
class XPressRun(OnlineRun):
    accepted: list[int] = field(default_factory=list)  # drafts the target accepted each step (before the budget)


def speculators_config(decoder, *, vocab: int, aux_ids, block_size: int, passes: int, rank: int):
    """speculators' XPressSpeculatorConfig: `decoder` (a Qwen3Config), the whole vocabulary, the
    fill-in layout (its default), B - 1 speculative tokens, MASK as the mask token."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.xpress import XPressSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    return XPressSpeculatorConfig(
        transformer_layer_config=decoder,
        draft_vocab_size=vocab,
        block_size=block_size,
        aux_hidden_state_layer_ids=list(aux_ids),
        mask_token_id=MASK,
        xpress_rank=rank,
        num_jacobi_passes=passes,
        speculators_config=SpeculatorsConfig(
            algorithm="xpress",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block_size - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )


def new_drafter(target, *, block_size: int, passes: int, rank: int = 16, seed: int = 0):
    """speculators' XPressDraftModel for the target's shapes (eager attention), default init, the
    target's embedding, lm_head and final norm where its load_verifier_weights puts them."""
    from speculators.models.xpress import XPressDraftModel

    vocab = target.config.vocab_size
    config = speculators_config(
        decoder_config(), vocab=vocab, aux_ids=AUX_IDS, block_size=block_size, passes=passes, rank=rank
    )
    with seeded(seed):
        model = XPressDraftModel(config)
    return verifier_weights(model, target)


def random_xpress(save_dir, *, vocab: int, hidden: int, aux_ids, block_size: int = 4, passes: int = 2, std=0.2):
    """speculators' XPressDraftModel of one Qwen3 layer at the given widths, every weight drawn
    N(0, std), saved by its own save_pretrained (which leaves out the verifier's embedding and head)."""
    from speculators.models.xpress import XPressDraftModel
    from transformers import Qwen3Config

    decoder = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
    )
    decoder._attn_implementation = "eager"
    config = speculators_config(decoder, vocab=vocab, aux_ids=aux_ids, block_size=block_size, passes=passes, rank=8)
    with seeded(0), torch.no_grad():
        model = XPressDraftModel(config)
        for parameter in model.parameters():
            parameter.normal_(0.0, std)
    model.save_pretrained(str(save_dir))
    return str(save_dir)


@torch.no_grad()
def jacobi_drafts(model, hidden, base, before: int, anchor: int, passes: int) -> torch.Tensor:
    """[B - 1] drafts of one block (hidden [B, H], base logits [B, V]) after `passes` Jacobi rounds
    of speculators' refiner (the recurrence of its forward's consistency rounds)."""
    head = model.refiner_head
    hcache = head.hidden_cache(hidden[None].to(head.down_h.weight.dtype))
    pred = base.argmax(dim=-1)[None]
    for _ in range(passes):
        pred[:, 0] = anchor  # slot 0 is the anchor, not predicted
        prev = torch.cat([torch.tensor([[before]]), pred[:, :-1]], dim=1)
        pred = (base[None] + head.block_bias(prev, hcache=hcache)).argmax(dim=-1)
    return pred[0, 1:]


def anchor_drafts(model, features, ids, start: int) -> torch.Tensor:
    """[B - 1] speculators' drafts at anchor `start` of `ids` (features of positions < start read);
    x_{start-1} is the anchor itself at start 0, as its training reads it."""
    hidden, base = block_hidden(model, features, ids, start, model.config.block_size)
    before = int(ids[start - 1]) if start > 0 else int(ids[start])
    return jacobi_drafts(model, hidden, base, before, int(ids[start]), model.config.num_jacobi_passes)


@torch.no_grad()
def online_xpress(model, target, prompt: torch.Tensor, max_new_tokens: int, stop_ids) -> XPressRun:
    """The greedy online loop (module docstring) for `prompt` [P]."""
    prompt_len = prompt.numel()
    max_length = prompt_len + max_new_tokens
    logits, features, _ = target_states(target, prompt)
    seq = torch.cat([prompt, logits[-1].argmax().reshape(1)])
    run = XPressRun(seq)
    start, stopped = prompt_len, int(seq[-1]) in stop_ids
    while start + 1 < max_length and not stopped:
        drafts = anchor_drafts(model, features, seq, start)
        proposal = Proposal(drafts, None, None)
        logits, candidate_features, _ = target_states(target, torch.cat([seq[: start + 1], drafts]))
        accepted, bonus = verify(logits[start:], proposal, 0.0)
        new_tokens = torch.cat([drafts[:accepted], bonus.reshape(1)])
        seq, features, produced, stopped = commit(
            seq, features, candidate_features, start, new_tokens, max_length, stop_ids
        )
        start += produced
        run.produced.append(produced)
        run.accepted.append(accepted)
        run.drafts.append(drafts.tolist())
        run.queries.append(model.config.block_size)
    run.output_ids = seq[: min(start + 1, max_length)]
    return run
