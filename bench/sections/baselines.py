"""Section `baselines`: the proposers that need no trained drafter, offline.

- vLLM's suffix decoding: anchors per second on one core, its global tree over the responses
  built first; llama-server's ngram-mod and SGLang's NGRAM (state along the online loop): walk
  steps per second through `score`.
- N-gram lookups (vLLM's `ngram`, llama-server's `ngram-simple`): anchors per second on one core
  through the product's proposer (`NgramProposer.propose` over chunks of anchors, as the replay
  calls it), on the SmolLM2 sequences of the score prompts (the fp32 section's shards) and on long
  synthetic ones (vLLM's rule scans every earlier position, so its cost grows with the context).
  Target: over a million anchors per second per core.
- A standalone draft model (SmolLM2-135M cut to its first DRAFT_LAYERS layers: the target's own
  vocabulary): the replay's one causal forward per sample (`DraftModelProposer.prepare`, then
  `propose`) against the online loop llama-server's draft-simple runs on the draft side (its KV
  cache catching up on the accepted tokens, then the last token and K drafts decoded one at a
  time, the rejected ones cropped), on the same sequences, reps alternated, the minima compared.
  Target: offline faster than online by at least the FLOP ratio (tokens the online loop forwards
  through the draft model / tokens the replay forwards).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import Rows, log, others_cpu

K = 4  # drafts per step, both proposers
DRAFT_LAYERS = 6
NGRAMS = {
    "vLLM ngram (min 1, max 3)": {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    },
    "llama.cpp ngram-simple (n 3, m 8)": {
        "spec-type": "ngram-simple",
        "spec-ngram-simple-size-n": 3,
        "spec-ngram-simple-size-m": 8,
    },
}
CHUNK_ANCHORS = 65536
TARGET_ANCHORS_PER_S = 1e6


def stored_sequences(shard_dir: str) -> list[tuple[torch.Tensor, int]]:
    """(token ids [N], prompt length) of every sample in the shards."""
    from pipeline.shards import ShardSet

    return [(torch.as_tensor(s.input_ids), int(s.prompt_len)) for s in ShardSet(shard_dir).samples(tensors=[])]


def synthetic_sequences(count: int, length: int, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    """Token streams over a 32k vocabulary where half the spans copy an earlier span (matches to find)."""
    rng = np.random.default_rng(seed)
    sequences = []
    for _ in range(count):
        ids = rng.integers(0, 32000, length)
        for start in range(64, length - 32, 64):
            source = rng.integers(0, start - 32)
            ids[start : start + 32] = ids[source : source + 32]
        sequences.append((torch.as_tensor(ids), 16))
    return sequences


def packed(sequences):
    from proposers.interface import PackedTokens

    lengths = torch.tensor([len(s) for s, _ in sequences])
    starts = torch.cumsum(lengths, 0) - lengths
    prompts = torch.tensor([p for _, p in sequences])
    return PackedTokens(torch.cat([s for s, _ in sequences]), starts, lengths, prompts)


def all_chunks(sequences, block_len: int):
    """Every response anchor (prompt_len .. N - 2), in chunks of CHUNK_ANCHORS."""
    from proposers.interface import Chunk

    idx = torch.cat([torch.full((len(s) - 1 - p,), i) for i, (s, p) in enumerate(sequences)])
    anchors = torch.cat([torch.arange(p, len(s) - 1) for s, p in sequences])
    return [Chunk(i, a, block_len) for i, a in zip(idx.split(CHUNK_ANCHORS), anchors.split(CHUNK_ANCHORS))], int(
        anchors.numel()
    )


def proposer_of(raw: dict, source: str):
    from proposers.detect import parse_config

    parsed = parse_config(raw, source)
    return parsed.family.proposer(parsed.config)


def anchors_per_second(proposer, sequences, reps: int) -> tuple[float, int, float | None]:
    """(the best rep's anchors per second, anchors, others' CPU): prepare (the occurrence chains),
    then propose over every anchor, as the replay calls them."""
    from proposers.interface import ProposeOptions

    tokens, options = packed(sequences), ProposeOptions()
    chunks, anchors = all_chunks(sequences, K)

    def once(chosen):
        tokens.state, _ = proposer.prepare([(s, None) for s, _ in sequences], None, options)
        proposer.propose(tokens, chosen, None, options)

    once(chunks[:1])  # compiles the lookup once (numba)
    best, start = float("inf"), time.perf_counter()
    for _ in range(reps):
        began = time.perf_counter()
        once(chunks)
        best = min(best, time.perf_counter() - began)
    return anchors / best, anchors, others_cpu(start, time.perf_counter())


def ngram_figures(ctx, real) -> dict:
    reps = max(ctx.args.reps or 0, 20)  # milliseconds a rep: the minimum of many
    length = 1024 if ctx.args.quick else 4096
    inputs = {"score prompts (SmolLM2)": real, f"synthetic, {length} tokens x 8": synthetic_sequences(8, length)}
    figures = {}
    for name, raw in NGRAMS.items():
        proposer = proposer_of(raw, name)
        for data, sequences in inputs.items():
            rate, anchors, others = anchors_per_second(proposer, sequences, reps)
            figures[f"{name} | {data}"] = {"anchors_per_s": rate, "anchors": anchors, "others_cpu": others}
            log(f"baselines: {name} on {data}: {rate / 1e6:.2f} M anchors/s ({anchors} anchors)")
    return figures


SUFFIX = {"method": "suffix", "num_speculative_tokens": K}


def suffix_per_second(sequences, reps: int) -> tuple[float, int, float | None]:
    """vLLM's suffix decoding: (the best rep's anchors per second, anchors, others' CPU): a fresh
    proposer serves every sample (its global tree over the responses), then drafts at every anchor."""
    from proposers.interface import ProposeOptions

    tokens, options = packed(sequences), ProposeOptions()
    chunks, anchors = all_chunks(sequences, K)
    best, start = float("inf"), time.perf_counter()
    for _ in range(reps):
        proposer = proposer_of(SUFFIX, "suffix")
        began = time.perf_counter()
        proposer.serve([(s, p) for s, p in sequences])
        tokens.state, _ = proposer.prepare([(s, None) for s, _ in sequences], None, options)
        proposer.propose(tokens, chunks, None, options)
        best = min(best, time.perf_counter() - began)
    return anchors / best, anchors, others_cpu(start, time.perf_counter())


def suffix_figures(ctx, real) -> dict:
    length = 1024 if ctx.args.quick else 4096
    inputs = {"score prompts (SmolLM2)": real, f"synthetic, {length} tokens x 8": synthetic_sequences(8, length)}
    figures = {}
    for data, sequences in inputs.items():
        rate, anchors, others = suffix_per_second(sequences, max(ctx.args.reps or 0, 3))
        figures[f"vLLM suffix (k {K}) | {data}"] = {"anchors_per_s": rate, "anchors": anchors, "others_cpu": others}
        log(f"baselines: vLLM suffix on {data}: {rate / 1e3:.1f} k anchors/s ({anchors} anchors)")
    return figures


# Proposers with state along the online loop, replayed one step at a time: (config, walk rule)
STATEFUL = {
    "llama.cpp ngram-mod (n 3, min 2, max 8)": (
        {"spec-type": "ngram-mod", "spec-ngram-mod-n-match": 3, "spec-ngram-mod-n-min": 2, "spec-ngram-mod-n-max": 8},
        "llama.cpp",
    ),
    "SGLang NGRAM (its defaults: 12 tokens, BFS)": ({"speculative_algorithm": "NGRAM"}, "sglang"),
}


def stateful_figures(ctx, shard_dir: str) -> dict:
    return {name: stateful_one(ctx, shard_dir, name, raw, rule) for name, (raw, rule) in STATEFUL.items()}


def stateful_one(ctx, shard_dir: str, name: str, raw: dict, rule: str) -> dict:
    """A proposer with state along the online loop through `score` (walk-only, one step at a time):
    walk steps per second, the whole replay (shard reading, scoring, writing) included."""
    import json

    from scoring.config import ScoreConfig
    from scoring.score.run import run_score

    path = ctx.work / f"stateful-{rule}.json"
    path.write_text(json.dumps(raw))
    out = ctx.work / f"baselines-stateful-{rule}"
    config = ScoreConfig(ckpts=[str(path)], shards=shard_dir, out=str(out), walk_rule=rule, tree_nodes=[], force=True)
    start = time.perf_counter()
    [outcome] = run_score(config)
    seconds = time.perf_counter() - start
    assert outcome.status == "scored", outcome.error
    steps = _walk_steps(outcome.out_dir)
    log(f"baselines: {name} through score: {steps} steps in {seconds:.2f}s")
    return {
        "steps": steps,
        "seconds": seconds,
        "steps_per_s": steps / seconds,
        "others_cpu": others_cpu(start, time.perf_counter()),
    }


def _walk_steps(out_dir: str) -> int:
    import pyarrow.parquet as pq

    return pq.read_metadata(f"{out_dir}/walk.parquet").num_rows


# --------------------------------------------------------------------------- a draft model


def cut_draft(work) -> str:
    """SmolLM2-135M's first DRAFT_LAYERS layers, saved with its tokenizer: a draft model of the target's family."""
    from transformers import AutoModelForCausalLM

    from pipeline.extract.target import resolve_model_dir

    source = Path(resolve_model_dir("smollm2")[2])
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.model.layers = model.model.layers[:DRAFT_LAYERS]
    model.config.num_hidden_layers = DRAFT_LAYERS
    out = work / "draft-smollm2"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return str(out)


def offline_draft(proposer, sequences) -> float:
    """Seconds for the replay's drafts at every anchor: prepare (one forward per sample), then propose."""
    from proposers.interface import ProposeOptions

    options, tokens = ProposeOptions(), packed(sequences)
    began = time.perf_counter()
    state, _ = proposer.prepare([(s, None) for s, _ in sequences], None, options)
    tokens.state = state
    proposer.propose(tokens, all_chunks(sequences, K)[0], None, options)
    return time.perf_counter() - began


@torch.no_grad()
def online_draft(model, ids: torch.Tensor, prompt_len: int) -> int:
    """llama-server's draft-simple loop on the draft side along a stored sequence (the target's greedy
    output): the cache catches up on the accepted tokens, decodes the last token and K - 1 drafts one
    at a time (K drafts), keeps the accepted ones. Returns the tokens forwarded through the model."""
    from transformers import DynamicCache

    cache, forwarded, t = DynamicCache(), 0, prompt_len
    while t < len(ids) - 1:
        catch_up = ids[cache.get_seq_length() : t]  # the prompt, or accepted tokens not yet in the cache
        if catch_up.numel():
            model(catch_up[None], cache=cache)
        token, drafts = ids[t : t + 1], []
        for _ in range(K):
            token = model(token[None], cache=cache).logits[0, -1:].argmax(-1)
            drafts.append(int(token))
        forwarded += catch_up.numel() + K
        stored = ids[t + 1 : t + 1 + K].tolist()
        accepted = next((j for j, (d, s) in enumerate(zip(drafts, stored)) if d != s), len(stored))
        cache.crop(-(cache.get_seq_length() - (t + 1 + min(accepted, K - 1))))  # keep x_t and the accepted drafts
        t += accepted + 1
    return forwarded


def draft_figures(ctx, real) -> dict:
    from transformers import AutoModelForCausalLM

    path = cut_draft(ctx.work)
    proposer = proposer_of({"spec-type": "draft-simple", "model-draft": path, "spec-draft-n-max": K}, path + ".json")
    proposer.load(torch.float32, "cpu")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reps, offline, online, forwarded = ctx.args.reps or 2, [], [], 0
    start = time.perf_counter()
    for rep in range(reps):
        log(f"baselines: draft model rep {rep + 1}/{reps}: offline, then the online loop ...")
        offline.append(offline_draft(proposer, real))
        began = time.perf_counter()
        forwarded = sum(online_draft(model, ids, p) for ids, p in real)
        online.append(time.perf_counter() - began)
    tokens = sum(len(ids) for ids, _ in real)
    return {
        "offline_s": min(offline),
        "online_s": min(online),
        "speedup": min(online) / min(offline),
        "flop_ratio": forwarded / tokens,
        "tokens": tokens,
        "online_forwarded": forwarded,
        "samples": len(real),
        "others_cpu": others_cpu(start, time.perf_counter()),
    }


def run(ctx) -> tuple[dict, Rows]:
    from bench.sections.fp32 import shards

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per core
    try:
        real = stored_sequences(shards(ctx))
        figures = {"ngram": ngram_figures(ctx, real), "stateful": stateful_figures(ctx, shards(ctx))}
        figures["suffix"] = suffix_figures(ctx, real)
        figures["draft"] = draft_figures(ctx, real)
    finally:
        torch.set_num_threads(threads)
    return figures, rows_of(figures)


def rows_of(figures: dict) -> Rows:
    rows = Rows()
    rows.add("baselines, one core: n-gram lookups through the proposer, every response anchor")
    for name, f in figures["ngram"].items():
        rate = f["anchors_per_s"]
        rows.add(
            f"  {name} ({f['anchors']} anchors)",
            f"{rate / 1e6:.2f} M anchors/s",
            "> 1 M/s",
            met=rate > TARGET_ANCHORS_PER_S,
            others=[f["others_cpu"]],
        )
    for name, f in figures["suffix"].items():
        rows.add(
            f"  {name} ({f['anchors']} anchors)",
            f"{f['anchors_per_s'] / 1e3:.1f} k anchors/s",
            others=[f["others_cpu"]],
        )
    for name, f in figures["stateful"].items():
        rows.add(
            f"  {name} through score, one step at a time ({f['steps']} walk steps, all included)",
            f"{f['steps_per_s']:.0f} steps/s",
            others=[f["others_cpu"]],
        )
    d = figures["draft"]
    rows.add(
        f"  draft model (SmolLM2 first {DRAFT_LAYERS} layers, K {K}): online / offline wall, {d['samples']} samples",
        f"{d['speedup']:.1f}x ({d['online_s']:.1f} / {d['offline_s']:.2f} s)",
        f">= FLOP ratio {d['flop_ratio']:.2f}",
        met=d["speedup"] >= d["flop_ratio"],
        others=[d["others_cpu"]],
    )
    return rows
