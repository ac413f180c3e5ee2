"""Greedy generation of the responses that extract stores.

Prompts are generated in left-padded batches with `model.generate(do_sample=False)`; in fp32,
left-padded batched greedy decoding gives the same tokens as one prompt at a time
(tests/test_extract.py checks it on tiny Qwen3 and Qwen3.5 targets).

A record that already carries a response (text or token ids, e.g. produced by a serving engine)
is not generated: its response is teacher-forced and marked `greedy=False`, finish reason
"given", so the scorer can say its walk is not exact.

Progress is counted in tokens, not prompts: a batch of long responses takes minutes, and a bar
that moves only when a whole batch is done shows nothing, then a wild ETA. `on_tokens(n)` is
called every decode step with the number of sequences still generating (`TokenCounter`, a
transformers streamer), and once more at the end of the batch with the budget the sequences
that stopped early did not use, so a batch always adds exactly rows x max_new_tokens.
"""

from __future__ import annotations

from collections.abc import Callable
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


class TokenCounter:
    """A transformers streamer (duck-typed `put`/`end`, what generate calls) that reports, every
    decode step, how many sequences of the batch produced a real token.

    generate() first puts the prompt ids [B, T], then each step's new tokens [B]. A row counts
    until it emits a stop token (that token included, as `cut_at_stop` keeps it); after that
    generate pads it, and the pad is often the eos itself, so liveness is tracked here rather
    than read from the tokens."""

    def __init__(self, rows: int, stop_ids: list[int], on_tokens: Callable[[int], None]):
        self.alive = torch.ones(rows, dtype=torch.bool)
        self.stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
        self.on_tokens = on_tokens
        self.counted = 0
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first put is the prompt, not generated tokens
            self.prompt_seen = True
            return
        tokens = value.reshape(-1).to("cpu", torch.long)
        live = int(self.alive.sum())
        self.alive &= ~torch.isin(tokens, self.stops)
        if live:
            self.counted += live
            self.on_tokens(live)

    def end(self) -> None:
        pass


@torch.inference_mode()
def generate_batch(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: list[int],
    pad_id: int,
    on_tokens: Callable[[int], None] | None = None,
) -> list[Response]:
    """Greedy responses for a batch of tokenized prompts (one left-padded generate call).
    `on_tokens(n)`: see the module docstring; the calls add up to len(prompts) * max_new_tokens."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not stop_ids:
        raise ValueError("the target has no stop token ids; cannot tell where a response ends")
    ids, mask = left_pad(prompts, pad_id, model_device(model))
    counter = TokenCounter(len(prompts), stop_ids, on_tokens) if on_tokens is not None else None
    # The facts are fixed when the stage starts: the token budget, not the tokens generate makes.
    with timing.stage("generate", prompts=len(prompts), max_new_tokens=max_new_tokens):
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(stop_ids),
            pad_token_id=pad_id,
            streamer=counter,
            **NEUTRAL_GENERATION,
        )
    new = out[:, ids.shape[1] :].cpu().tolist()
    if counter is not None:
        unused = len(prompts) * max_new_tokens - counter.counted  # rows that stopped before the budget
        if unused:
            on_tokens(unused)
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
    on_tokens: Callable[[int], None] | None = None,
) -> list[Response]:
    """Responses for one batch in input order: given ones as they are, the rest generated together
    (`on_tokens` counts the generated ones only; a given response costs no decoding)."""
    todo = [i for i, g in enumerate(given) if g is None]
    generated = (
        generate_batch(model, [prompts[i] for i in todo], max_new_tokens, stop_ids, pad_id, on_tokens) if todo else []
    )
    by_index = dict(zip(todo, generated))
    return [by_index[i] if given[i] is None else given_response(given[i]) for i in range(len(prompts))]
