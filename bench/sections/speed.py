"""Section `speed`: `specreplay speed`'s predicted speedup against the speedup a real llama-server
measures, side by side in one run (docs/speed.md).

The real SmolLM2-135M (extract's `--model smollm2`), converted to an F32 GGUF by llama.cpp's own
converter, served by llama-server on CPU, one slot, greedy, no flash attention, its default F16 KV
cache (llama-bench times no F32 one); responses that differ from the stored ones are counted. Speculation by
llama-server's `ngram-simple` (drafts: its size-m) and `draft-simple` with a 2-layer draft model
fitted to SmolLM2's greedy outputs (drafts: --spec-draft-n-max), at each K of KS, and none.

- Measured: tokens per second of every configuration over the prompts (the sum of the answers'
  `predicted_n` over the sum of their `predicted_ms`: generation only, the prompt's forward out),
  plain decoding measured before and after the others (their mean is the base).
- Predicted: the same configurations scored by `specreplay score --walk-rule llama.cpp` from the
  shards, and `specreplay speed` with a profile `specreplay profile --in-server` measured just
  before: the target's step at 1 .. max K + 1 tokens and plain decoding by llama-server's own
  timers, the draft model's pass inside the server (`--serve draft=`), the server's flags, prompts
  of the workload's mean prompt length and its budget.
- Target: every predicted speedup within 10% of the measured one, and the same best K per proposer.
"""

from __future__ import annotations

import json
import time

import torch

from bench.common import Rows, log, others_cpu

KS = (1, 2, 4, 8)
TOLERANCE = 0.10
THREADS = 2
# The server's and llama-bench's flags: no flash attention (its CPU kernel rounds through F16), the
# default F16 KV cache (llama-bench times no F32 cache: the engine tests' F32 caches are not timed),
# so a few responses may differ from the stored ones (counted: their tau is then not the served one)
BENCH_FLAGS = ("-fa", "off")


def setup(ctx) -> dict:
    """The SmolLM2 target (HF and F32 GGUF), its greedy shards of the score prompts (the fp32
    section's), a draft model fitted to them and converted."""
    from bench.sections.fp32 import shards as fp32_shards
    from pipeline.extract.target import resolve_model_dir
    from pipeline.shards import ShardSet
    from tests.helpers import llama_engine as engine

    work = ctx.work / "speed"
    work.mkdir(exist_ok=True)
    model_dir = str(resolve_model_dir("smollm2")[2])
    shards = fp32_shards(ctx)
    sequences = [(s.input_ids, int(s.prompt_len)) for s in ShardSet(shards).samples(tensors=[])]
    converter = engine.Converter()
    try:
        log("speed: converting the target, fitting and converting the draft model ...")
        target_gguf = converter.convert(model_dir, work / "smollm2-f32.gguf")
        draft_dir = engine.fitted_draft_model(
            model_dir, [(torch.as_tensor(i), p) for i, p in sequences], work / "draft"
        )
        draft_gguf = converter.convert(draft_dir, work / "draft-f32.gguf")
    finally:
        converter.close()
    return {
        "work": work,
        "shards": shards,
        "target_gguf": target_gguf,
        "draft_dir": draft_dir,
        "draft_gguf": draft_gguf,
        "context": round(sum(p + (len(ids) - p) / 2 for ids, p in sequences) / len(sequences)),
        "prompt_len": round(sum(p for _, p in sequences) / len(sequences)),
        "prompts": [list(map(int, ids[:p])) for ids, p in sequences],
        "stored": [list(map(int, ids[p:])) for ids, p in sequences],
    }


def configurations(s: dict) -> dict[str, tuple]:
    """name -> (llama-server options beyond the target, the baseline specreplay scores, or None)."""
    configs = {"plain": ((), None)}
    for k in KS:
        ngram = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", str(k))
        configs[f"ngram-simple m={k}"] = (ngram, f"ngram:llama.cpp:n=3,m={k}")
        draft = ("-md", s["draft_gguf"], "--spec-type", "draft-simple", "--spec-draft-n-max", str(k))
        configs[f"draft-simple K={k}"] = (draft, f"draft:{s['draft_dir']}:n={k}")
    return configs


def served(s: dict, options: tuple, n_predict: int) -> dict:
    """Every prompt once through a llama-server with `options` (after one untimed request): tokens
    per second of generation, and how many responses differ from the stored ones."""
    from pathlib import Path

    from scoring.speed.llama_server import per_token
    from tests.helpers import llama_engine as engine
    from tools.llama_server import LlamaServer

    server = LlamaServer(Path(s["target_gguf"]), s["work"] / "server.log", extra=(*options, *BENCH_FLAGS)).start()
    try:
        engine.engine_run(server, s["prompts"][0], n_predict)
        start = time.perf_counter()
        runs = [engine.engine_run(server, prompt, n_predict) for prompt in s["prompts"]]
        others = others_cpu(start, time.perf_counter())
    finally:
        server.stop()
    differing = sum(r.tokens[: len(stored)] != stored for r, stored in zip(runs, s["stored"]))
    return {
        "tokens": sum(r.timings["predicted_n"] for r in runs),
        "tokens_per_s": 1 / per_token([r.timings for r in runs]),  # as the profile reads plain decoding
        "differing": differing,
        "others_cpu": others,
    }


def measured_speeds(ctx, s: dict, configs: dict) -> dict:
    """name -> served(); plain decoding before and after the others, its mean the base."""
    results = {}
    plain = configs["plain"]
    speculative = [(name, c) for name, c in configs.items() if name != "plain"]
    for name, (options, _) in [("plain (before)", plain), *speculative, ("plain (after)", plain)]:
        log(f"speed: serving {name} ...")
        results[name] = served(s, options, ctx.args.max_new_tokens)
        log(f"speed:   {results[name]['tokens_per_s']:.1f} tokens/s, {results[name]['differing']} responses differ")
    base = (results["plain (before)"]["tokens_per_s"] + results["plain (after)"]["tokens_per_s"]) / 2
    for run in results.values():
        run["speedup"] = run["tokens_per_s"] / base
    return results


def measured_profile(ctx, s: dict) -> dict:
    """`specreplay profile --in-server` of the target at 1 .. max K + 1 tokens (its verification as
    served) and `--serve draft=` of the draft model at each K, at the workload's prompt length and
    budget."""
    from scoring.speed.measure import Measurement, Wanted, measure_profile

    work = str(s["work"] / "profile-logs")
    tokens = list(range(1, max(KS) + 2))
    wanted = Wanted(s["target_gguf"], tokens, True, s["draft_gguf"], {}, {"draft": s["draft_gguf"]}, list(KS))
    how = Measurement(s["prompt_len"], 5, 3, THREADS, BENCH_FLAGS, None, work, ctx.args.max_new_tokens)
    log(f"speed: profiling inside llama-server at 1..{max(KS) + 1} tokens, prompts of {s['prompt_len']} ...")
    return measure_profile(wanted, how)


def predicted_speeds(ctx, s: dict, configs: dict) -> tuple[dict, dict]:
    """(name -> speed's prediction at batch 1, the profile): scored with score, priced by profile."""
    from scoring.config import ScoreConfig
    from scoring.score.run import run_score
    from scoring.speed.predict import as_rows
    from scoring.speed.profile import load_profile
    from scoring.speed.run import predict_results

    profile = measured_profile(ctx, s)
    path = s["work"] / "profile.json"
    path.write_text(json.dumps(profile))
    names = {baseline: name for name, (_, baseline) in configs.items() if baseline}
    log(f"speed: scoring {len(names)} configurations (--walk-rule llama.cpp) ...")
    config = ScoreConfig(
        ckpts=list(names),
        shards=s["shards"],
        out=str(s["work"] / "results"),
        tree_nodes=[],
        walk_rule="llama.cpp",
        force=True,
    )
    priced = load_profile(str(path))
    found = {}
    for outcome in run_score(config):
        assert outcome.out_dir and outcome.error is None, outcome.error
        [row] = as_rows(predict_results([outcome.out_dir], priced, methods=["chain"]))
        found[names[outcome.ckpt]] = row
    return found, profile


def best_k(values: dict[int, float]) -> int:
    return max(values, key=lambda k: (values[k], -k))


def figures_of(measured: dict, predicted: dict) -> dict:
    """Per proposer and K: measured and predicted speedup, the residual (predicted / measured - 1);
    per proposer the best K each way."""
    table = {}
    for name, row in predicted.items():
        proposer, k = name.rsplit(" ", 1)
        run = measured[name]
        table.setdefault(proposer, {})[int(k.split("=")[1])] = {
            "measured_tokens_per_s": run["tokens_per_s"],
            "measured_speedup": run["speedup"],
            "predicted_tokens_per_s": row["tokens_per_s"],
            "predicted_speedup": row["speedup"],
            "residual": row["speedup"] / run["speedup"] - 1,
            "tau": row["tau"],
            "differing": run["differing"],
            "others_cpu": run["others_cpu"],
        }
    best = {
        proposer: {
            "measured": best_k({k: r["measured_speedup"] for k, r in ks.items()}),
            "predicted": best_k({k: r["predicted_speedup"] for k, r in ks.items()}),
        }
        for proposer, ks in table.items()
    }
    return {"table": table, "best_k": best}


def run(ctx) -> tuple[dict, Rows]:
    s = setup(ctx)
    configs = configurations(s)
    predicted, profile = predicted_speeds(ctx, s, configs)
    measured = measured_speeds(ctx, s, configs)
    figures = {"context": s["context"], "profile": profile, "measured": measured, **figures_of(measured, predicted)}
    return figures, rows_of(figures)


def rows_of(figures: dict) -> Rows:
    rows = Rows()
    plain = [figures["measured"][f"plain ({when})"]["tokens_per_s"] for when in ("before", "after")]
    rows.add(
        f"speed, llama-server on CPU, SmolLM2-135M F32, context ~{figures['context']}: plain decoding",
        f"{plain[0]:.1f} / {plain[1]:.1f} tokens/s (before / after)",
    )
    for proposer, ks in figures["table"].items():
        for k, r in sorted(ks.items()):
            rows.add(
                f"  {proposer} K={k}: tau {r['tau']:.2f}, {r['differing']} responses differ; speedup measured / predicted",
                f"{r['measured_speedup']:.3f} / {r['predicted_speedup']:.3f} ({r['residual']:+.1%})",
                f"within {TOLERANCE:.0%}",
                met=abs(r["residual"]) <= TOLERANCE,
                others=[r["others_cpu"]],
                sides=[r["others_cpu"]],
            )
        best = figures["best_k"][proposer]
        rows.add(
            f"  {proposer}: best K measured / predicted",
            f"{best['measured']} / {best['predicted']}",
            "equal",
            met=best["measured"] == best["predicted"],
        )
    return rows
