"""A cost profile timed inside transformers' own `generate` (`profile --engine torch
--in-generate`, docs/speed.md): what a step costs there beyond the target's forward, as
llama-server's own timers give it for llama.cpp (`--in-server`). One sequence (transformers'
speculative modes decode one).

- plain: a step of greedy `generate` (the forward, the argmax, the loop's bookkeeping);
- draft_steps, at each K: a speculative step less its target forward: prompt lookup decoding
  (`prompt_lookup_num_tokens=K`, family `ngram`) and assisted generation with each --draft model
  (`num_assistant_tokens=K`, a constant K, no confidence stop; as its family): the lookup or the
  assistant's own `generate` call, and the loop's work around the verification.

Steps are timed after generate's first (the prompt's forward) by a stopping criterion, which
generate calls after each step's forward; the target's forwards inside them by forward hooks. CUDA is
synchronized at each, so a figure is the step's wall time. `requests` random prompts of `context`
tokens after a warm-up one, `n_predict` new tokens each; a row is the mean over their steps.
"""

from __future__ import annotations

import time

import torch

from scoring.speed.torch_bench import random_ids, synchronize

LOOKUP_NGRAM = 2  # max_matching_ngram_size: transformers' default (scored as ngram:vllm:k=K,min=1,max=2)


class StepClock:
    """A stopping criterion that never stops: the time of each step (the first call of it after each
    of the model's forwards, from the one after the prompt's) and the sequence's length at the first.
    Some transformers versions also call it on the candidates before the verifying forward (5.17:
    twice a speculative step); a call with no forward since the last is not a step. A context
    manager: the forward counter is a hook on `model` while it is entered."""

    def __init__(self, device: torch.device, model):
        self.device, self.model, self.times, self.first_length = device, model, [], None
        self.forwards, self.counted, self.hook = 0, 0, None

    def __enter__(self):
        self.hook = self.model.register_forward_pre_hook(self.forwarded)
        return self

    def __exit__(self, *exc):
        self.hook.remove()

    def forwarded(self, module, args):
        self.forwards += 1

    def __call__(self, input_ids, scores, **kwargs):
        if self.forwards > self.counted:
            self.counted = self.forwards
            synchronize(self.device)
            self.times.append(time.perf_counter())
            self.first_length = self.first_length or input_ids.shape[1]
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class ForwardClock:
    """Forward hooks on a model: the seconds of its forwards after the clock's first step."""

    def __init__(self, model, clock: StepClock):
        self.model, self.clock, self.seconds, self.started = model, clock, 0.0, None
        self.hooks = []

    def __enter__(self):
        self.hooks = [self.model.register_forward_pre_hook(self.pre), self.model.register_forward_hook(self.post)]
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()

    def pre(self, module, args):
        synchronize(self.clock.device)
        self.started = time.perf_counter()

    def post(self, module, args, output):
        synchronize(self.clock.device)
        if self.clock.times:
            self.seconds += time.perf_counter() - self.started


def generate_options(kind: str, k: int, draft=None) -> dict:
    """generate's keyword arguments: plain, prompt lookup at K, or assisted by `draft` at K (its K
    set in its own generation config, where transformers reads it)."""
    if kind == "plain":
        return {}
    if kind == "lookup":
        return {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": LOOKUP_NGRAM}
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    return {"assistant_model": draft}


@torch.inference_mode()
def timed_generate(model, ids: torch.Tensor, n_predict: int, options: dict) -> tuple[float, float, int]:
    """(seconds of the steps after the first, the target's forwards in them, how many steps)."""
    from transformers import StoppingCriteriaList

    with StepClock(ids.device, model) as clock, ForwardClock(model, clock) as forwards:
        stops = StoppingCriteriaList([clock])
        model.generate(ids, max_new_tokens=n_predict, do_sample=False, stopping_criteria=stops, **options)
    return clock.times[-1] - clock.times[0], forwards.seconds, len(clock.times) - 1


def mean_step(model, prompts: list[torch.Tensor], n_predict: int, options: dict, less_forwards: bool) -> float:
    """Seconds per step after a warm-up call, over the prompts (less the target's forwards: a
    speculative step's share beside its verification)."""
    timed_generate(model, prompts[0], n_predict, options)
    runs = [timed_generate(model, ids, n_predict, options) for ids in prompts]
    seconds = sum(s - (f if less_forwards else 0.0) for s, f, _ in runs)
    return seconds / sum(steps for _, _, steps in runs)


def in_generate_rows(model, drafts: dict, ks: list[int], how) -> dict:
    """{plain, draft_steps} rows at batch 1 (module docstring); `drafts` family -> its loaded draft
    model. `how`: a Measurement (context, requests, n_predict)."""
    generator = torch.Generator().manual_seed(1)
    prompts = [random_ids(model, 1, how.context, generator) for _ in range(how.requests)]
    plain = mean_step(model, prompts, how.n_predict, generate_options("plain", 0), False)
    steps = []
    for k in ks:
        seconds = mean_step(model, prompts, how.n_predict, generate_options("lookup", k), True)
        steps.append({"family": "ngram", "batch": 1, "drafts": k, "seconds": seconds})
    for family, draft in drafts.items():
        for k in ks:
            seconds = mean_step(model, prompts, how.n_predict, generate_options("assisted", k, draft), True)
            steps.append({"family": family, "batch": 1, "drafts": k, "seconds": seconds})
    return {"plain": [{"batch": 1, "seconds": plain}], "draft_steps": steps}
