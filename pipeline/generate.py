"""Greedy generation of the responses that extract stores.

Prompts are generated in left-padded batches with `model.generate(do_sample=False)`; in fp32,
left-padded batched greedy decoding gives the same tokens as one prompt at a time
(tests/test_extract.py checks it on tiny Qwen3 and Qwen3.5 targets).

A record that already carries a response (text or token ids, e.g. produced by a serving engine)
is not generated: its response is teacher-forced and marked `greedy=False`, finish reason
"given", so the scorer can say its walk is not exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline import timing

FINISH_EOS = "eos"
FINISH_LENGTH = "length"
FINISH_GIVEN = "given"

# Generation-config entries that would change which token greedy decoding picks. A target's
# shipped generation_config.json may set some of them (repetition_penalty is common); stored
# responses must be the argmax of the raw logits, so they are pinned to neutral values.
NEUTRAL_GENERATION = dict(
    do_sample=False,
    num_beams=1,
    repetition_penalty=1.0,
    no_repeat_ngram_size=0,
    encoder_no_repeat_ngram_size=0,
    min_length=0,
    bad_words_ids=None,
    suppress_tokens=None,
    begin_suppress_tokens=None,
    forced_bos_token_id=None,
    forced_eos_token_id=None,
)


@dataclass
class Response:
    """One prompt's response: token ids after the prompt (stop token included when hit)."""

    token_ids: list[int]
    finish_reason: str  # "eos" | "length" | "given"
    greedy: bool


def cut_at_stop(tokens: list[int], stop_ids: list[int], max_new_tokens: int) -> Response:
    """Keep tokens up to and including the first stop token.

    generate() keeps emitting pad tokens for rows of a batch that already stopped, and the pad
    token is often the eos token itself (SmolLM2), so the cut is what defines the response.
    """
    stops = set(stop_ids)
    for index, token in enumerate(tokens[:max_new_tokens]):
        if token in stops:
            return Response(tokens[: index + 1], FINISH_EOS, True)
    return Response(tokens[:max_new_tokens], FINISH_LENGTH, True)


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] input ids and attention mask, padded on the left so every prompt ends at T-1.

    Padding is done here rather than by the tokenizer so `input_ids` records (used as is) and
    rendered chat prompts take the same path.
    """
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def model_device(model) -> torch.device:
    """Where inputs go: the embedding's device (also right for device_map-sharded targets)."""
    try:
        return model.get_input_embeddings().weight.device
    except AttributeError:
        return next(model.parameters()).device


@torch.inference_mode()
def generate_batch(
    model, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], pad_id: int
) -> list[Response]:
    """Greedy responses for a batch of tokenized prompts (one left-padded generate call)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not stop_ids:
        raise ValueError("the target has no stop token ids; cannot tell where a response ends")
    ids, mask = left_pad(prompts, pad_id, model_device(model))
    # The facts are fixed when the stage starts: the token budget, not the tokens generate makes.
    with timing.stage("generate", prompts=len(prompts), max_new_tokens=max_new_tokens):
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(stop_ids),
            pad_token_id=pad_id,
            **NEUTRAL_GENERATION,
        )
    new = out[:, ids.shape[1] :].cpu().tolist()
    return [cut_at_stop(row, stop_ids, max_new_tokens) for row in new]


def given_response(token_ids: list[int]) -> Response:
    """A response supplied with the prompt record: teacher-forced, never generated."""
    if not token_ids:
        raise ValueError("a given response must have at least one token")
    return Response(list(token_ids), FINISH_GIVEN, False)


def generate_responses(
    model,
    prompts: list[list[int]],
    given: list[list[int] | None],
    max_new_tokens: int,
    stop_ids: list[int],
    pad_id: int,
) -> list[Response]:
    """Responses for one batch in input order: given ones as they are, the rest generated together."""
    todo = [i for i, g in enumerate(given) if g is None]
    generated = generate_batch(model, [prompts[i] for i in todo], max_new_tokens, stop_ids, pad_id) if todo else []
    by_index = dict(zip(todo, generated))
    return [by_index[i] if given[i] is None else given_response(given[i]) for i in range(len(prompts))]
