"""A cost profile measured with transformers on torch (docs/speed.md): the engine a GPU user runs
the target in, and the one that times several sequences at once (llama-bench forwards one).

For each batch size b, `context` random tokens of b sequences are forwarded once into a KV cache;
then each timed forward is the target's over n new tokens of each sequence (logits at all n
positions, as verification reads them), on a copy of that cache. The first
forward of each shape is a warm-up; the median of `reps` more is kept (CUDA synchronized around
each). Plain decoding is the one-token forward. A standalone draft model (`--draft FAMILY=DIR`)
is timed the same way at one token.
"""

from __future__ import annotations

import copy
import os
import statistics
import time

import torch

from pipeline.common.errors import UserError


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def filled_cache(model, batch: int, context: int, generator: torch.Generator):
    """The model's own KV cache (its class: a hybrid target's holds recurrent states) after `context`
    random tokens of each of `batch` sequences."""
    ids = random_ids(model, batch, context, generator)
    return model(input_ids=ids, use_cache=True).past_key_values


def random_ids(model, batch: int, tokens: int, generator: torch.Generator) -> torch.Tensor:
    vocab = model.get_input_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    return torch.randint(0, vocab, (batch, tokens), generator=generator).to(device)  # [b, n]


def forward_seconds(model, cache, ids: torch.Tensor, reps: int) -> float:
    """The median of `reps` forwards of `ids` after the cache's tokens (one warm-up first), each on
    a copy of the cache made outside the timing (a hybrid target's recurrent state cannot be cropped)."""
    device = ids.device
    samples = []
    for _ in range(1 + reps):
        fresh = copy.deepcopy(cache)
        synchronize(device)
        start = time.perf_counter()
        model(input_ids=ids, past_key_values=fresh, use_cache=True)
        synchronize(device)
        samples.append(time.perf_counter() - start)
        del fresh
    return statistics.median(samples[1:])


@torch.inference_mode()
def timed_rows(model, batches: list[int], tokens: list[int], context: int, reps: int) -> dict[tuple[int, int], float]:
    """(batch, tokens) -> seconds of one forward of `model` over `tokens` new tokens of each sequence."""
    generator = torch.Generator().manual_seed(0)
    found = {}
    for b in batches:
        cache = filled_cache(model, b, context, generator)
        for n in tokens:
            found[(b, n)] = forward_seconds(model, cache, random_ids(model, b, n, generator), reps)
    return found


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def loaded(path: str, device: str, dtype: str):
    """(model, its sizes as a profile records them) of a transformers directory, in eval mode."""
    from transformers import AutoModelForCausalLM

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: torch sees no CUDA device here; use --device cpu")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"{path}: no config.json; --engine torch times a transformers model directory")
    chosen = DTYPES.get(dtype) or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=chosen).to(device).eval()
    config = model.config.get_text_config()
    facts = {"name": os.path.basename(os.path.normpath(path)), "num_layers": config.num_hidden_layers}
    facts |= {"hidden_size": config.hidden_size, "vocab_size": model.get_input_embeddings().weight.shape[0]}
    return model, facts


def torch_profile_rows(
    target: str, drafts: dict[str, str], batches: list[int], tokens: list[int], how, in_generate=None
):
    """({verify, plain, drafters, draft_steps} rows, target facts, what timed them). `how`: a
    scoring.speed.measure.Measurement (context, reps, device, dtype). `in_generate(model, drafts)`,
    when given, times steps inside transformers' generate too with the loaded draft models
    (torch_generate.py: its plain and draft_steps rows; plain decoding at batch 1 is then
    generate's step). Each model is loaded once."""
    model, facts = loaded(target, how.device, how.dtype)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    times = timed_rows(model, batches, sorted(set(tokens) | {1}), how.context, how.reps)
    draft_models = {family: loaded(path, how.device, how.dtype)[0] for family, path in drafts.items()}
    drafters = [
        {"family": family, "batch": b, "tokens": 1, "seconds": seconds}
        for family, draft in draft_models.items()
        for (b, _), seconds in timed_rows(draft, batches, [1], how.context, how.reps).items()
    ]
    served = in_generate(model, draft_models) if in_generate else {"plain": [], "draft_steps": []}
    del model, draft_models
    verify = [{"batch": b, "tokens": n, "seconds": times[(b, n)]} for b in batches for n in tokens]
    served_batches = {row["batch"] for row in served["plain"]}
    plain = served["plain"] + [{"batch": b, "seconds": times[(b, 1)]} for b in batches if b not in served_batches]
    engine = f"transformers on torch {torch.__version__}, {dtype} (median of {how.reps} repetitions)"
    if in_generate:
        engine += f"; plain decoding and draft_steps inside generate ({how.requests} prompts after a warm-up)"
    rows = {"verify": verify, "plain": plain, "drafters": drafters, "draft_steps": served["draft_steps"]}
    return rows, facts, engine
