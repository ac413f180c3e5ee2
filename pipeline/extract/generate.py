"""Generation of the responses that extract stores: greedy, or sampled at temperature > 0.

Prompts are generated in left-padded batches with `model.generate(do_sample=False)`; in fp32,
left-padded batched greedy decoding gives the same tokens as one prompt at a time
(tests/pipeline/extract/test_run.py checks it on tiny Qwen3 and Qwen3.5 targets).

Sampling (temperature > 0) keeps that same greedy generate call and adds one logits processor,
`DrawFromSampling`: it draws each row's token from `pipeline.common.sampling.sampling_probs` (the
reference's distribution, not transformers' warpers, whose top-p boundary differs) and hands
back scores that are -inf everywhere but the drawn token, so greedy selection picks it. Every
response (prompt, draw) has its own torch.Generator seeded from (seed, prompt id, draw) through
sha256 (`draw_seed`), so its tokens do not depend on the batch it ran in, on the rank, or on a
resume. Responses are sampled responses, not the target's greedy output: `greedy=False`.

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

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pipeline.common import timing
from pipeline.common.sampling import Sampling, sampling_probs

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


def draw_seed(seed: int, prompt_id: str, draw: int) -> int:
    """The generator seed of one sampled response: sha256 of (seed, prompt id, draw), so the
    draw's randomness is a function of those three only (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{int(seed)}\0{prompt_id}\0{int(draw)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


class DrawFromSampling:
    """A logits processor for greedy `generate` that samples instead: row r's token is drawn
    from sampling_probs(scores[r]) with row r's own generator, and the returned scores are -inf
    everywhere but that token, so generate's argmax picks it.

    Each row is drawn alone, with its own generator, from its own 1-D distribution: the draw
    consumes that generator the same way whatever else is in the batch. Rows that already
    stopped keep drawing (generate pads them afterwards); that only advances their own generator.
    The logits come from a padded, cached batched forward, which differs from a single-sequence
    forward by ~1e-6, so a draw that falls exactly on a boundary between two tokens could in
    principle differ between batch sizes; at such odds that is accepted, not engineered away.
    """

    def __init__(self, sampling: Sampling, seeds: list[int]):
        self.sampling, self.seeds, self.generators = sampling, list(seeds), None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.generators is None:  # on the logits' device, created when that is known
            self.generators = [torch.Generator(scores.device).manual_seed(seed) for seed in self.seeds]
        drawn = [
            torch.multinomial(sampling_probs(scores[row], self.sampling), 1, generator=generator)
            for row, generator in enumerate(self.generators)
        ]
        picked = torch.full_like(scores, float("-inf"))
        return picked.scatter_(1, torch.stack(drawn), 0.0)


@torch.inference_mode()
def generate_batch(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: list[int],
    pad_id: int,
    on_tokens: Callable[[int], None] | None = None,
    sampling: Sampling | None = None,
    seeds: list[int] | None = None,
) -> list[Response]:
    """Responses for a batch of tokenized prompts (one left-padded generate call): greedy, or
    drawn from `sampling` with one seed per prompt (`draw_seed`).
    `on_tokens(n)`: see the module docstring; the calls add up to len(prompts) * max_new_tokens."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not stop_ids:
        raise ValueError("the target has no stop token ids; cannot tell where a response ends")
    ids, mask = left_pad(prompts, pad_id, model_device(model))
    counter = TokenCounter(len(prompts), stop_ids, on_tokens) if on_tokens is not None else None
    processors = None
    if sampling is not None:
        from transformers import LogitsProcessorList

        processors = LogitsProcessorList([DrawFromSampling(sampling, seeds)])
    # The facts are fixed when the stage starts: the token budget, not the tokens generate makes.
    with timing.stage("generate", prompts=len(prompts), max_new_tokens=max_new_tokens):
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(stop_ids),
            pad_token_id=pad_id,
            streamer=counter,
            logits_processor=processors,
            **NEUTRAL_GENERATION,
        )
    new = out[:, ids.shape[1] :].cpu().tolist()
    if counter is not None:
        unused = len(prompts) * max_new_tokens - counter.counted  # rows that stopped before the budget
        if unused:
            on_tokens(unused)
    responses = [cut_at_stop(row, stop_ids, max_new_tokens) for row in new]
    return responses if sampling is None else [replace(r, greedy=False) for r in responses]


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
    sampling: Sampling | None = None,
    seeds: list[int | None] | None = None,
) -> list[Response]:
    """Responses for one batch in input order: given ones as they are, the rest generated together,
    greedy or sampled (`seeds[i]`: prompt i's `draw_seed`) (`on_tokens` counts the generated ones
    only; a given response costs no decoding)."""
    todo = [i for i, g in enumerate(given) if g is None]
    todo_seeds = [seeds[i] for i in todo] if sampling is not None else None
    generated = (
        generate_batch(
            model, [prompts[i] for i in todo], max_new_tokens, stop_ids, pad_id, on_tokens, sampling, todo_seeds
        )
        if todo
        else []
    )
    by_index = dict(zip(todo, generated))
    return [by_index[i] if given[i] is None else given_response(given[i]) for i in range(len(prompts))]
