"""Online speculative-decoding loops that recompute the target from scratch every step.

The reference `dflash_generate` keeps a KV cache it crops after each step, which cannot roll
back the recurrent state of linear-attention (hybrid) targets. These loops follow the same
greedy semantics (block truncated to the remaining budget, `produced` capped and cut at the
first stop token) but run the target over the whole sequence each step, so they are valid
for any target. They use the public reference drafter (`dflash.model.DFlashDraftModel`) on
its uncached path. Slow, tiny models only.
"""

from __future__ import annotations

import torch
from dflash.model import extract_context_feature

from tests.helpers.trees import brute_force_tree


@torch.inference_mode()
def _target_forward(target, ids: torch.Tensor):
    out = target(ids[None], output_hidden_states=True, use_cache=False)
    return out.logits[0], out.hidden_states


def _draft_logits(draft, target_embed, lm_head, features, block_ids, start):
    emb = torch.nn.functional.embedding(block_ids[None], target_embed)
    hidden = draft(
        target_hidden=features[None, :start],
        noise_embedding=emb,
        position_ids=torch.arange(start + block_ids.numel())[None],
    )
    return draft.compute_logits(hidden[:, 1:], lambda h: torch.nn.functional.linear(h, lm_head))[0]


def _block_logits(draft, target, target_embed, lm_head, seq, start: int, verify: int):
    """The drafter's logits [verify - 1, V] for the block [seq[start], mask, ...] at `start`,
    with the target's features of seq[:start] recomputed from scratch."""
    _, hidden_states = _target_forward(target, seq[:start])
    features = extract_context_feature(hidden_states, draft.target_layer_ids)[0]
    block = torch.full((verify,), draft.mask_token_id, dtype=torch.long)
    block[0] = seq[start]
    return _draft_logits(draft, target_embed, lm_head, features, block, start)


def _online_loop(prompt: torch.Tensor, first: torch.Tensor, max_new_tokens: int, stop_token_ids, block_size, step):
    """The loop both online references share: from the prefill token `first`, each step at
    `start` verifies a block of min(block_size, remaining) and `step(seq, start, verify)` returns
    (accepted draft tokens, the tokens the target emits after seq[start]); `produced` = accepted
    + 1, capped by the budget and cut after the first stop token. Returns (output_ids, produced list)."""
    P = prompt.numel()
    max_length = P + max_new_tokens
    seq = torch.cat([prompt, first.reshape(1)])
    produced_list, start = [], P
    stopped = int(seq[start]) in stop_token_ids
    while start + 1 < max_length and not stopped:
        verify = min(block_size, max_length - start)
        accepted, new_tokens = step(seq, start, verify)
        produced = min(accepted + 1, max_length - start - 1)
        stops = [i for i, t in enumerate(new_tokens[:produced].tolist()) if t in stop_token_ids]
        if stops:
            produced = stops[0] + 1
            stopped = True
        seq = torch.cat([seq[: start + 1], new_tokens[:produced]])
        start += produced
        produced_list.append(produced)
    return seq[: min(start + 1, max_length)], produced_list


@torch.inference_mode()
def online_generate(
    draft,
    target,
    target_embed,
    lm_head,
    prompt: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: list[int],
    tree_budget: int | None = None,
    drafts: list | None = None,
):
    """Returns (output_ids, acceptance_lengths). Chain when tree_budget is None, else DDTree
    with a brute-force tree of `tree_budget` most probable prefixes (small vocabularies only).
    `drafts`, when given, receives each chain step's draft block (the drafter's argmax at block
    positions 1..verify-1)."""

    def step(seq, start, verify):
        dl = _block_logits(draft, target, target_embed, lm_head, seq, start, verify)
        # the target's greedy continuation after seq[:start + 1], long enough to verify the block
        cont = seq[: start + 1].clone()
        for _ in range(verify):
            cont = torch.cat([cont, _target_forward(target, cont)[0][-1].argmax()[None]])
        target_next = cont[start + 1 :]  # target argmax after each block position
        if tree_budget is None:
            guesses = dl.argmax(-1)
            if drafts is not None:
                drafts.append(guesses.tolist())
            return int((guesses == target_next[: verify - 1]).long().cumprod(0).sum()), target_next
        tree = brute_force_tree(torch.log_softmax(dl.float(), -1), tree_budget)
        accepted = 0
        while accepted < verify - 1 and tuple(target_next[: accepted + 1].tolist()) in tree:
            accepted += 1
        return accepted, target_next

    first = _target_forward(target, prompt)[0][-1].argmax()
    return _online_loop(prompt, first, max_new_tokens, stop_token_ids, draft.block_size, step)


@torch.inference_mode()
def online_tree_sampled(
    draft,
    target,
    target_embed,
    lm_head,
    prompt: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: list[int],
    tree_budget: int,
    temperature: float,
    generator: torch.Generator,
):
    """DDTree at T > 0 as liranringel/ddtree's loop runs it (SPEC §1): the tree is built from the
    drafter's untempered log-probs; the target samples (temperature only) at the root and at
    every node it reaches, and verification goes on while the sampled token is a child. The
    first token is sampled at prefill. Returns (output_ids, acceptance_lengths)."""

    def sample_next(ids):
        probs = torch.softmax(_target_forward(target, ids)[0][-1].float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)

    def step(seq, start, verify):
        dl = _block_logits(draft, target, target_embed, lm_head, seq, start, verify)
        tree = brute_force_tree(torch.log_softmax(dl.float(), -1), tree_budget)
        cont, accepted = seq[: start + 1].clone(), 0
        while True:
            cont = torch.cat([cont, sample_next(cont)])
            if accepted < verify - 1 and tuple(cont[start + 1 :].tolist()) in tree:
                accepted += 1
            else:
                return accepted, cont[start + 1 :]

    return _online_loop(prompt, sample_next(prompt), max_new_tokens, stop_token_ids, draft.block_size, step)
