"""Section `speed`: `specreplay speed`'s predicted speedup against the speedup a real llama-server
measures, side by side in one run (docs/speed.md).

The real SmolLM2-135M (extract's `--model smollm2`), converted to an F32 GGUF by llama.cpp's own
converter, served by llama-server on CPU, one slot, greedy, no flash attention, its default F16 KV
cache (llama-bench times no F32 one); responses that differ from the stored ones are counted. Speculation by
llama-server's `ngram-simple` (drafts: its size-m) and `draft-simple` with a 2-layer draft model
fitted to SmolLM2's greedy outputs (drafts: --spec-draft-n-max), at each K of KS, and none.

- Measured: tokens per second of every configuration over the prompts, ROUNDS times (the sum of
  the answers' `predicted_n` over the sum of their `predicted_ms`: generation only, the prompt's
  forward out); the speedup over plain decoding's.
- Predicted: the same configurations scored by `specreplay score --walk-rule llama.cpp` from the
  shards, and `specreplay speed` with a profile `specreplay profile --in-server` measures: the
  target's step at 1 .. max K + 1 tokens and plain decoding by llama-server's own timers, the draft
  model's pass inside the server (`--serve draft=`), the server's flags, prompts of the
  workload's mean prompt length and its budget.
- All of those servers are up at once and their requests interleaved, round after round
  (scoring/speed/llama_server.py interleave): the machine's drift lands on every figure alike.
- Synthetic acceptance (docs/speed.md#export): each draft-simple K served again with the
  `--spec-synth-rates` `speed --export llama.cpp` gives its result.
- Target: every predicted speedup within 10% of the measured one, the same best K per proposer,
  and each synthetic run within 10% of the real drafter's tokens per second.
"""

from __future__ import annotations

import json
import time

import torch

from bench.common import Rows, log, others_cpu

KS = (1, 2, 4, 8)
ROUNDS = 2  # each configuration serves the prompts this many times, its requests interleaved with all others'
TOLERANCE = 0.10
THREADS = 2
DFLASH_AUX = (2, 9, 15, 21, 28)  # speculators' before-layer ids: the fp32 shards' layers 1, 8, 14, 20, 27
SMOLLM2_LAYERS = 30
# The server's and llama-bench's flags: no flash attention (its CPU kernel rounds through F16), the
# default F16 KV cache (llama-bench times no F32 cache: the engine tests' F32 caches are not timed),
# so a few responses may differ from the stored ones (counted: their tau is then not the served one)
BENCH_FLAGS = ("-fa", "off")


def setup(ctx) -> dict:
    """The SmolLM2 target (HF and F32 GGUF), its greedy shards of the score prompts (the fp32
    section's), a draft model and a DFlash drafter fitted to them, each converted."""
    from bench.sections.fp32 import shards as fp32_shards
    from pipeline.extract.target import resolve_model_dir
    from pipeline.shards import ShardSet
    from tests.helpers import llama_engine as engine

    work = ctx.work / "speed"
    work.mkdir(exist_ok=True)
    model_dir = str(resolve_model_dir("smollm2")[2])
    shards = fp32_shards(ctx)
    sequences = [(s.input_ids, int(s.prompt_len)) for s in ShardSet(shards).samples(tensors=[])]
    fitting = [(torch.as_tensor(i), p) for i, p in sequences]
    converter = engine.Converter()
    try:
        log("speed: converting the target, fitting and converting the draft model and the DFlash drafter ...")
        target_gguf = converter.convert(model_dir, work / "smollm2-f32.gguf")
        draft_dir = engine.fitted_draft_model(model_dir, fitting, work / "draft")
        draft_gguf = converter.convert(draft_dir, work / "draft-f32.gguf")
        dflash_dir = dflash_drafter(model_dir, fitting, work)
        dflash_gguf = converter.convert(dflash_dir, work / "dflash-f32.gguf", target_dir=model_dir)
    finally:
        converter.close()
    return {
        "work": work,
        "shards": shards,
        "target_gguf": target_gguf,
        "draft_dir": draft_dir,
        "draft_gguf": draft_gguf,
        "dflash_dir": dflash_dir,
        "dflash_gguf": dflash_gguf,
        "context": round(sum(p + (len(ids) - p) / 2 for ids, p in sequences) / len(sequences)),
        "prompt_len": round(sum(p for _, p in sequences) / len(sequences)),
        "prompts": [list(map(int, ids[:p])) for ids, p in sequences],
        "stored": [list(map(int, ids[p:])) for ids, p in sequences],
    }


def dflash_drafter(model_dir: str, sequences, work) -> str:
    """speculators' DFlashDraftModel fitted to SmolLM2's own features by its own training forward
    (the engine-parity tests' recipe on the real target), in z-lab's layout: a block of max(KS) + 1,
    reading the fp32 shards' layers."""
    from tests.helpers import family_fits as fits

    recipe = fits.Recipe("dflash", aux_ids=DFLASH_AUX, block_size=max(KS) + 1, steps=200, anchors=32, lr=2e-2)
    ckpt = fits.fitted(recipe, model_dir, sequences, work / "speculators-dflash")
    return fits.zlab_layout(ckpt, work / "zlab-dflash", num_target_layers=SMOLLM2_LAYERS)


def configurations(s: dict) -> dict[str, tuple]:
    """name -> (llama-server options beyond the target, what specreplay scores: (a checkpoint or
    baseline, --steps or None), or None for plain decoding)."""
    configs = {"plain": ((), None)}
    for k in KS:
        ngram = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", str(k))
        configs[f"ngram-simple m={k}"] = (ngram, (f"ngram:llama.cpp:n=3,m={k}", None))
        draft = ("-md", s["draft_gguf"], "--spec-type", "draft-simple", "--spec-draft-n-max", str(k))
        configs[f"draft-simple K={k}"] = (draft, (f"draft:{s['draft_dir']}:n={k}", None))
        dflash = ("-md", s["dflash_gguf"], "--spec-type", "draft-dflash", "--spec-draft-n-max", str(k))
        configs[f"draft-dflash K={k}"] = (dflash, (s["dflash_dir"], k))
    return configs


def synthetic_configs(configs: dict, scored: dict) -> dict[str, tuple]:
    """name -> options: each draft-simple and draft-dflash K served again at the acceptance `speed --export
    llama.cpp` gives its scored result (--spec-synth-rates: the same drafts, accepted at random
    at the result's per-position rates; item 4 of docs/speed.md#export)."""
    from scoring.speed.export import llama_cpp_flag

    found = {}
    for name, (options, _) in configs.items():
        if name.startswith(("draft-simple", "draft-dflash")):
            flag = llama_cpp_flag(scored[name]).split()
            found[f"{name} synthetic"] = (*options, *flag[2:])  # its --spec-draft-n-max already given
    return found


def served_configs(s: dict, configs: dict[str, tuple], n_predict: int) -> dict:
    """name -> a Served of the configuration over the prompts ROUNDS times after a warm-up request."""
    from scoring.speed.llama_server import Served

    prompts = [s["prompts"][0]] + s["prompts"] * ROUNDS
    return {
        name: Served(tuple(options), s["work"] / f"served-{i}.log", prompts, n_predict)
        for i, (name, options) in enumerate(configs.items())
    }


def measured_speeds(served: dict, s: dict, others: float) -> dict:
    """name -> tokens per second of generation, speedup over plain, how many responses differ from
    the stored ones (their tau is then not the served one)."""
    from scoring.speed.llama_server import per_token

    results = {}
    for name, one in served.items():
        tokens = [reply["tokens"] for reply in one.replies[1:]]
        stored = s["stored"] * ROUNDS
        differing = sum(t[: len(want)] != want for t, want in zip(tokens, stored))
        # as the profile reads plain decoding: generation time over generated tokens
        results[name] = {"tokens_per_s": 1 / per_token(one.timings), "differing": differing, "others_cpu": others}
    for run in results.values():
        run["speedup"] = run["tokens_per_s"] / results["plain"]["tokens_per_s"]
    return results


def measured_profile(ctx, s: dict, served: dict) -> dict:
    """`specreplay profile --in-server` of the target at 1 .. max K + 1 tokens (its verification as
    served) and `--serve draft=` of the draft model at each K, at the workload's prompt length and
    budget, its requests interleaved with the served configurations' (one pool of servers)."""
    from scoring.speed.measure import Measurement, Wanted, measure_profile

    work = str(s["work"] / "profile-logs")
    tokens = list(range(1, max(KS) + 2))
    serve = {"draft": s["draft_gguf"], "dflash": s["dflash_gguf"]}
    wanted = Wanted(s["target_gguf"], tokens, True, s["draft_gguf"], {}, serve, list(KS))
    requests = len(s["prompts"]) * ROUNDS
    how = Measurement(s["prompt_len"], 5, requests, THREADS, BENCH_FLAGS, None, work, ctx.args.max_new_tokens)
    log(
        f"speed: profiling inside llama-server at 1..{max(KS) + 1} tokens, prompts of {s['prompt_len']}, "
        f"and serving {len(served)} configurations, {requests} requests each, interleaved ..."
    )
    return measure_profile(wanted, how, tuple(served.values()))


def scored_configs(s: dict, configs: dict) -> dict[str, str]:
    """name -> its result directory: every speculative configuration scored by `score --walk-rule
    llama.cpp` from the shards (one run per --steps)."""
    from scoring.config import ScoreConfig
    from scoring.score.run import run_score

    by_steps: dict = {}
    for name, (_, scored) in configs.items():
        if scored:
            by_steps.setdefault(scored[1], {})[scored[0]] = name
    log(f"speed: scoring {sum(map(len, by_steps.values()))} configurations (--walk-rule llama.cpp) ...")
    found = {}
    for steps, names in by_steps.items():
        out = s["work"] / f"results-{steps or 'own'}"
        config = ScoreConfig(
            ckpts=list(names),
            shards=s["shards"],
            out=str(out),
            tree_nodes=[],
            walk_rule="llama.cpp",
            steps=steps,
            force=True,
        )
        for outcome in run_score(config):
            assert outcome.out_dir and outcome.error is None, outcome.error
            found[names[outcome.ckpt]] = outcome.out_dir
    return found


def predicted_speeds(scored: dict, profile: dict, path) -> dict:
    """name -> speed's prediction at batch 1 from the result and the measured profile."""
    from scoring.speed.predict import as_rows
    from scoring.speed.profile import load_profile
    from scoring.speed.run import predict_results

    path.write_text(json.dumps(profile))
    priced = load_profile(str(path))
    found = {}
    for name in scored:
        [row] = as_rows(predict_results([scored[name]], priced, methods=["chain"]))
        found[name] = row
    return found


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
    scored = scored_configs(s, configs)
    synthetic = synthetic_configs(configs, scored)
    served = served_configs(s, {name: c[0] for name, c in configs.items()} | synthetic, ctx.args.max_new_tokens)
    start = time.perf_counter()
    profile = measured_profile(ctx, s, served)
    measured = measured_speeds(served, s, others_cpu(start, time.perf_counter()))
    predicted = predicted_speeds(scored, profile, s["work"] / "profile.json")
    figures = {"context": s["context"], "profile": profile, "measured": measured, **figures_of(measured, predicted)}
    figures["synthetic"] = synthetic_figures(measured)
    return figures, rows_of(figures)


def synthetic_figures(measured: dict) -> dict:
    """Per K: the synthetic run's tokens per second against the real drafter's (item 4)."""
    found = {}
    for name, run in measured.items():
        if name.endswith(" synthetic"):
            real = measured[name.removesuffix(" synthetic")]
            found[name] = {
                "tokens_per_s": run["tokens_per_s"],
                "real_tokens_per_s": real["tokens_per_s"],
                "residual": run["tokens_per_s"] / real["tokens_per_s"] - 1,
                "others_cpu": run["others_cpu"],
            }
    return found


def add_best_k_row(rows: Rows, proposer: str, best: dict) -> None:
    rows.add(
        f"  {proposer}: best K measured / predicted",
        f"{best['measured']} / {best['predicted']}",
        "equal",
        met=best["measured"] == best["predicted"],
    )


def rows_of(figures: dict) -> Rows:
    rows = Rows()
    rows.add(
        f"speed, llama-server on CPU, SmolLM2-135M F32, context ~{figures['context']}: plain decoding",
        f"{figures['measured']['plain']['tokens_per_s']:.1f} tokens/s",
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
        add_best_k_row(rows, proposer, best)
        # what following the prediction costs: the measured speedup at the predicted best K
        # against the measured best's (a near-tie of K that hardly differ loses little)
        kept = ks[best["predicted"]]["measured_speedup"] / ks[best["measured"]]["measured_speedup"]
        rows.add(
            f"  {proposer}: measured speedup at the predicted best K / at the measured best",
            f"{kept:.3f}",
            f">= {1 - TOLERANCE:.2f}",
            met=kept >= 1 - TOLERANCE,
        )
    for name, r in figures["synthetic"].items():
        rows.add(
            f"  {name} (--spec-synth-rates from its result) / the real drafter, tokens/s",
            f"{r['tokens_per_s']:.1f} / {r['real_tokens_per_s']:.1f} ({r['residual']:+.1%})",
            f"within {TOLERANCE:.0%}",
            met=abs(r["residual"]) <= TOLERANCE,
            others=[r["others_cpu"]],
        )
    return rows
