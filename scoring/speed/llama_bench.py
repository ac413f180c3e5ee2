"""A cost profile measured with llama.cpp's own benchmark, `llama-bench` (docs/speed.md): the
target's forward over n tokens of one sequence after `context` tokens are in its KV cache
(`-p n -n 0 -d context`: the prompt-processing test at that depth, which times exactly one
llama_decode of n tokens per repetition), and a standalone draft model's one-token forward the
same way. One sequence: llama-bench forwards no batch of several sequences.

Each time is the median of the repetitions' samples (llama-bench's `samples_ns`): robust to the
one repetition another process slowed, which the mean is not.
"""

from __future__ import annotations

import json
import statistics
import subprocess

from pipeline.common.errors import UserError
from pipeline.common.llama_cpp import binary_env, find_binary
from proposers.checkpoints.gguf_file import read_gguf


def target_facts(gguf: str) -> dict:
    """The sizes a profile records (and `speed` checks), from the GGUF's metadata."""
    meta = read_gguf(gguf).metadata
    arch = meta.get("general.architecture")
    tokens = meta.get("tokenizer.ggml.tokens")
    facts = {
        "name": meta.get("general.name"),
        "num_layers": meta.get(f"{arch}.block_count"),
        "hidden_size": meta.get(f"{arch}.embedding_length"),
        "vocab_size": len(tokens) if tokens is not None else meta.get(f"{arch}.vocab_size"),
    }
    missing = [k for k, v in facts.items() if v is None and k != "name"]
    if missing:
        raise UserError(f"{gguf}: its metadata lacks {', '.join(missing)} ({arch}); is it a model llama.cpp runs?")
    return facts


def bench_command(binary, gguf: str, tokens: list[int], context: int, reps: int, threads: int, extra) -> list[str]:
    prompt = ",".join(map(str, tokens))
    return [str(binary), "-m", gguf, "-p", prompt, "-n", "0", "-d", str(context), "-r", str(reps)] + [
        "-t",
        str(threads),
        "-o",
        "json",
        *extra,
    ]


def run_bench(gguf: str, tokens: list[int], context: int, reps: int, threads: int, extra=(), binary=None):
    """(n -> seconds of one forward over n tokens at depth `context`, median over `reps`; the CPU's name)."""
    program = find_binary("llama-bench", binary)
    command = bench_command(program, gguf, tokens, context, reps, threads, extra)
    done = subprocess.run(command, capture_output=True, text=True, env=binary_env(program))
    if done.returncode != 0:
        raise UserError(f"llama-bench failed on {gguf}: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
    tests = json.loads(done.stdout)
    return {int(t["n_prompt"]): statistics.median(t["samples_ns"]) / 1e9 for t in tests}, tests[0]["cpu_info"]


def bench_verify(target: str, tokens: list[int], how) -> tuple[list[dict], str]:
    """(the profile's `verify` rows at each of `tokens`, the CPU's name) from llama-bench; `how`: a
    scoring.speed.measure.Measurement (context, reps, threads, extra, binary)."""
    verify, cpu = run_bench(target, tokens, how.context, how.reps, how.threads, how.extra, how.binary)
    return [{"batch": 1, "tokens": n, "seconds": s} for n, s in sorted(verify.items())], cpu


def bench_draft(family: str, gguf: str, how) -> dict:
    """The profile's row of a standalone draft model's one-token forward, from llama-bench."""
    seconds = run_bench(gguf, [1], how.context, how.reps, how.threads, how.extra, how.binary)[0][1]
    return {"family": family, "batch": 1, "tokens": 1, "seconds": seconds}
