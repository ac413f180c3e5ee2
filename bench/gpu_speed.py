"""Part `speed` of `make bench-gpu` (issue 35, item 3 on a GPU): `specreplay speed`'s predicted
speedup against the speedup transformers' own speculative loops measure, the target served by
transformers on torch (on CUDA when there is one: the engine a GPU user runs a target in first).

- Target: a random Qwen3 stand-in built here (nothing downloaded), its lm_head emitting only
  `live` ids, so that its greedy responses fall into loops a lookup or a small draft model follows
  (llama.cpp's engine tests' recipe); fp32, so the loops' tokens are the stored ones exactly.
- Proposers, each at every K of the size's `ks`, as transformers runs them in `generate`: prompt lookup decoding
  (`prompt_lookup_num_tokens=K`, `max_matching_ngram_size=2`: scored as `ngram:vllm:k=K,min=1,max=2`,
  the same lookup: the longest n-gram up to 2, its earliest occurrence) and assisted generation
  with a standalone draft model fitted to the target's responses (`num_assistant_tokens=K`,
  schedule "constant", no confidence threshold: scored as `draft:DIR:n=K`).
- Measured: each configuration over the prompts `rounds` times, interleaved prompt by prompt (one
  generate call of each configuration in turn, the order rotating); tokens per second of
  generation after the call's first step (the prompt's forward: a StepClock), the target's
  forwards counted (tokens per step).
- Predicted: `specreplay extract` of the prompts with the target, `score` of every configuration,
  `profile --engine torch --in-generate` (the target's forward at 1 .. max K + 1 tokens; plain
  decoding and each proposer's share of a step at each K timed inside generate on random prompts)
  run before and after the served runs, its rows averaged (`averaged`), speed's prediction at
  batch 1.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from bench.common import Rows, log
from scoring.speed.torch_bench import loaded, synchronize

TOLERANCE = 0.10
QWEN3 = dict(
    full=(2048, 16, 16, 4, 128, 6144, 32768), cpu=(256, 4, 4, 2, 64, 768, 4096), tiny=(64, 2, 2, 1, 32, 128, 512)
)
SIZES = {  # the stand-in target (hidden, layers, heads, kv heads, head dim, MLP, vocab) and the workload
    name: dict(zip(("hidden", "layers", "heads", "kv", "head_dim", "inter", "vocab"), QWEN3[name]), **workload)
    for name, workload in (
        ("full", dict(prompts=3, new=128, rounds=2, ks=(1, 2, 4, 8))),  # ~2.5 min on one H200
        ("cpu", dict(prompts=4, new=64, rounds=2, ks=(1, 2, 4, 8))),
        ("tiny", dict(prompts=2, new=16, rounds=1, ks=(1, 2))),  # the test's: seconds
    )
}
PROMPT_TOKENS = 24
LIVE = 24  # ids emitted by the target: 3 .. 3 + LIVE - 1 (no special token)
FIRST_LIVE = 3
PROFILE_NEW = 48  # new tokens of each in-generate profile request


# ---------------------------------------------------------------------------------------------
# the stand-in target, its prompts, shards and draft model


@torch.no_grad()
def live_target(model_dir: Path, spec: dict, device: str) -> str:
    """A random fp32 Qwen3 whose lm_head rows outside the live ids are zero and the live ones x3
    (logit 0 never wins: only live ids are emitted), saved with the stand-in tokenizer."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from bench.standins import EOS_ID, _write_tokenizer

    config = Qwen3Config(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["inter"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv"],
        head_dim=spec["head_dim"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model.lm_head.weight.mul_(3.0)
    model.lm_head.weight[:FIRST_LIVE] = 0.0
    model.lm_head.weight[FIRST_LIVE + LIVE :] = 0.0
    model.generation_config = GenerationConfig(eos_token_id=EOS_ID, pad_token_id=EOS_ID, do_sample=False)
    model.save_pretrained(str(model_dir))
    _write_tokenizer(model_dir)
    return str(model_dir)


def write_prompts(path: Path, count: int) -> list[list[int]]:
    """Prompts of PROMPT_TOKENS live ids, as input_ids (the stand-in tokenizer decodes ids 3..28)."""
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(FIRST_LIVE, FIRST_LIVE + LIVE, (count, PROMPT_TOKENS), generator=generator).tolist()
    path.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n" for i, p in enumerate(prompts)))
    return prompts


def extracted(env, target_dir: str, prompts_path: Path, new_tokens: int) -> tuple[str, list[list[int]]]:
    """`specreplay extract` of the prompts (fp32, one prompt per batch as generate serves them):
    (shard dir, the stored responses)."""
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.run import run_extract
    from pipeline.shards import ShardSet

    out = env.work / "speed-shards"
    config = ExtractConfig(
        model=target_dir,
        prompts=str(prompts_path),
        out=str(out),
        max_new_tokens=new_tokens,
        dtype="fp32",
        num_draft_layers=1,  # no drafter here reads features: one layer kept
        batch_size=1,
        overwrite=True,
        quiet=True,
        device=env.device,
    )
    run_extract(config)
    samples = sorted(ShardSet(str(out)).samples(tensors=[]), key=lambda s: s.sample_id)
    return str(out), [list(map(int, s.input_ids[int(s.prompt_len) :])) for s in samples]


def draft_model(target_dir: str, prompts: list[list[int]], responses: list[list[int]], out: Path, vocab: int) -> str:
    """The engine tests' standalone draft model (2 layers, fitted briefly to the stored responses:
    it accepts often and misses too), at the stand-in's vocabulary, its tokenizer copied."""
    from tests.helpers.models import fitted_draft_model

    sequences = [(torch.tensor(p + r), len(p)) for p, r in zip(prompts, responses)]
    return fitted_draft_model(target_dir, sequences, out, vocab_size=vocab)


# ---------------------------------------------------------------------------------------------
# the prediction: scored configurations and a torch profile


def configurations(draft_dir: str, ks: tuple[int, ...]) -> dict[str, tuple[dict, str | None]]:
    """name -> (generate's speculative options, what specreplay scores), plain decoding included."""
    configs = {"plain": (("plain", 0), None)}
    for k in ks:
        configs[f"prompt lookup K={k}"] = (("lookup", k), f"ngram:vllm:k={k},min=1,max=2")
        configs[f"assisted K={k}"] = (("assisted", k), f"draft:{draft_dir}:n={k}")
    return configs


def scored(env, shards: str, configs: dict) -> dict[str, str]:
    """name -> its result directory (`score`, one run, fp32)."""
    from scoring.config import ScoreConfig
    from scoring.score.run import run_score

    names = {ckpt: name for name, (_, ckpt) in configs.items() if ckpt}
    out = str(env.work / "speed-results")
    config = ScoreConfig(list(names), shards, out, tree_nodes=[], device=env.device, dtype="fp32", force=True)
    found = {}
    for outcome in run_score(config):
        assert outcome.out_dir and outcome.error is None, outcome.error
        found[names[outcome.ckpt]] = outcome.out_dir
    return found


def torch_profile(env, target_dir: str, draft_dir: str, context: int, ks: tuple[int, ...]) -> dict:
    """`specreplay profile --engine torch --in-generate` of the target at 1 .. max K + 1 tokens, the
    draft model, and the steps inside generate at each K (random prompts of `context` tokens)."""
    from scoring.speed.measure import Measurement, Wanted, measure_profile

    tokens, drafts = list(range(1, max(ks) + 2)), {"draft": draft_dir}
    wanted = Wanted(target_dir, tokens, False, None, drafts, {}, list(ks), engine="torch", in_generate=True)
    how = Measurement(context, 10, 2, 0, (), None, str(env.work), PROFILE_NEW, device=env.device, dtype="fp32")
    return measure_profile(wanted, how)


def averaged(profiles: list[dict]) -> dict:
    """One profile whose every row's seconds are the mean of `profiles`' (the same rows in the same
    order: the same command run before and after the served runs). The machine drifts within
    minutes (plain decoding's step 38% apart between a profile and the served runs in one H200
    run), so the profile brackets the runs it predicts, as the CPU section interleaves its
    in-server profile with the served requests."""
    out = json.loads(json.dumps(profiles[0]))
    for key in ("verify", "plain", "drafters", "draft_steps"):
        for i, row in enumerate(out.get(key) or []):
            row["seconds"] = sum(p[key][i]["seconds"] for p in profiles) / len(profiles)
    out["measured"]["notes"] += f"; each row the mean of {len(profiles)} profiles, before and after the served runs"
    return out


# ---------------------------------------------------------------------------------------------
# the measurement: transformers' generate, interleaved


@torch.inference_mode()
def generate_once(models, prompt: list[int], new_tokens: int, options: dict, device: str, probe=None) -> dict:
    """One greedy generate call of a configuration ((kind, K): torch_generate.generate_options):
    the new tokens; after its first step (generation timed from there, as llama-server's timers
    time it), the seconds, the tokens produced and the steps; the target's forwards in all.
    `probe(clock)`: a context manager entered around the call with its StepClock."""
    from transformers import StoppingCriteriaList

    from scoring.speed.torch_generate import StepClock, generate_options

    target, draft = models
    ids = torch.tensor([prompt], device=device)
    with StepClock(torch.device(device), target) as clock, probe(clock) if probe else contextlib.nullcontext():
        kwargs = generate_options(*options, draft) | {"stopping_criteria": StoppingCriteriaList([clock])}
        out = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, **kwargs)
    seconds, steps = clock.times[-1] - clock.times[0], len(clock.times) - 1
    produced, new = out.shape[1] - clock.first_length, out[0, len(prompt) :].tolist()
    return {"seconds": seconds, "produced": produced, "steps": steps, "forwards": clock.forwards, "tokens": new}


def served(models, configs: dict, prompts: list[list[int]], new_tokens: int, device: str, rounds: int) -> dict:
    """name -> one generate record per (round, prompt): every configuration's call on a prompt
    in turn, the order rotating, after one warm-up call of each."""
    names = list(configs)
    runs: dict[str, list] = {name: [] for name in names}
    for name in names:
        generate_once(models, prompts[0], new_tokens, configs[name][0], device)
    turn = 0
    for _ in range(rounds):
        for index, prompt in enumerate(prompts):
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                runs[name].append(
                    dict(generate_once(models, prompt, new_tokens, configs[name][0], device), prompt=index)
                )
            turn += 1
    return runs


class CandidateClock:
    """The candidate generators' `get_candidates` (the draft model's own generate, or the lookup)
    timed after the clock's first step, CUDA synchronized at each boundary (so not the timed runs)."""

    def __init__(self, clock):
        self.clock, self.seconds = clock, 0.0

    @contextlib.contextmanager
    def patched(self):
        from transformers.generation import candidate_generator as generators

        classes = (generators.AssistedCandidateGenerator, generators.PromptLookupCandidateGenerator)
        saved = {cls: cls.get_candidates for cls in classes}
        for cls, original in saved.items():
            cls.get_candidates = lambda gen, *a, _o=original, **k: self.timed(lambda: _o(gen, *a, **k))
        try:
            yield self
        finally:
            for cls, original in saved.items():
                cls.get_candidates = original

    def timed(self, call):
        if not self.clock.times:
            return call()
        synchronize(self.clock.device)
        start = time.perf_counter()
        out = call()
        synchronize(self.clock.device)
        self.seconds += time.perf_counter() - start
        return out


def probed(models, prompt: list[int], new_tokens: int, options: dict, device: str) -> dict:
    """generate_once with where its time goes after its first step: the target's forwards
    (torch_generate.ForwardClock) and the candidate generators (CandidateClock); the rest of the
    seconds is the loop's own work."""
    from scoring.speed.torch_generate import ForwardClock

    found = {}

    @contextlib.contextmanager
    def probe(clock):
        with ForwardClock(models[0], clock) as forwards, CandidateClock(clock).patched() as candidates:
            yield
        found.update({"target forwards": forwards.seconds, "candidates": candidates.seconds})

    run = generate_once(models, prompt, new_tokens, options, device, probe)
    return {**{k: v for k, v in run.items() if k != "tokens"}, **found}


def probed_runs(models, configs: dict, prompts: list[list[int]], new_tokens: int, device: str) -> dict:
    """name -> the probed calls of every prompt (one round, after the timed ones)."""
    return {
        name: [probed(models, p, new_tokens, options, device) for p in prompts]
        for name, (options, _) in configs.items()
    }


def measured_speeds(runs: dict, stored: list[list[int]]) -> dict:
    """name -> tokens per second of generation after the first step, its speedup over plain, tokens
    per target step, responses differing from the stored ones."""
    found = {}
    for name, calls in runs.items():
        tokens, seconds = sum(c["produced"] for c in calls), sum(c["seconds"] for c in calls)
        differing = sum(c["tokens"] != stored[c["prompt"]] for c in calls)
        per_step = tokens / sum(c["steps"] for c in calls)
        found[name] = {"tokens_per_s": tokens / seconds, "differing": differing, "tokens_per_step": per_step}
        found[name]["others_cpu"] = None
    for run in found.values():
        run["speedup"] = run["tokens_per_s"] / found["plain"]["tokens_per_s"]
    return found


def steps_compared(results: dict[str, str], runs: dict[str, list]) -> dict:
    """name -> per prompt, the steps of specreplay's walk (walk.parquet, chain) and the target's
    forwards in transformers' generate (every call of a prompt alike: greedy). The walk follows the
    engines that decode the first token in the prompt's forward and draft after it (vLLM's and
    llama.cpp's loops): its steps + 1 are their forwards. transformers drafts from the prompt alone
    before its first token; where those drafts are accepted, its forwards are fewer."""
    import polars as pl

    from scoring import results as files

    found = {}
    for name, directory in results.items():
        walk = pl.read_parquet(str(Path(directory) / files.FILES["walk"]), columns=["sample_id", "method"])
        counts = walk.filter(pl.col("method") == "chain").group_by("sample_id").len()
        walked = {int(sid.removeprefix("p")): n for sid, n in counts.iter_rows()}
        served = {c["prompt"]: c["forwards"] for c in runs[name]}
        found[name] = {"walk": [walked[i] for i in sorted(served)], "served": [served[i] for i in sorted(served)]}
    return found


# ---------------------------------------------------------------------------------------------
# the part


def part_speed(env) -> tuple[dict, Rows]:
    from bench.sections.speed import figures_of, predicted_speeds

    spec = SIZES[env.size_name]
    prompts = write_prompts(env.work / "speed-prompts.jsonl", spec["prompts"])
    log("gpu: speed: the stand-in target, its shards and a fitted draft model ...")
    target_dir = live_target(env.work / "speed-target", spec, env.device)
    shards, stored = extracted(env, target_dir, env.work / "speed-prompts.jsonl", spec["new"])
    draft_dir = draft_model(target_dir, prompts, stored, env.work / "speed-draft", spec["vocab"])
    configs = configurations(draft_dir, spec["ks"])
    results = scored(env, shards, configs)
    context = PROMPT_TOKENS + spec["new"] // 2
    log("gpu: speed: profile --engine torch, generate interleaved, the profile again ...")
    profiles = [torch_profile(env, target_dir, draft_dir, context, spec["ks"])]
    models = tuple(loaded(path, env.device, "fp32")[0] for path in (target_dir, draft_dir))
    runs = served(models, configs, prompts, spec["new"], env.device, spec["rounds"])
    profiles.append(torch_profile(env, target_dir, draft_dir, context, spec["ks"]))
    profile = averaged(profiles)
    measured = measured_speeds(runs, stored)
    probes = probed_runs(models, configs, prompts, spec["new"], env.device)
    predicted = predicted_speeds(results, profile, env.work / "speed-profile.json")
    figures = {"size": spec, "context": context, "profile": profile, "profiles": profiles, "measured": measured}
    figures |= figures_of(measured, predicted)
    figures["steps"] = steps_compared(results, runs)
    figures["probes"] = probes
    figures["runs"] = {
        name: [{k: v for k, v in c.items() if k != "tokens"} for c in calls] for name, calls in runs.items()
    }
    return figures, speed_rows(figures, env)


def speed_rows(figures: dict, env) -> Rows:
    from bench.sections.speed import add_best_k_row

    rows = Rows()
    plain = figures["measured"]["plain"]["tokens_per_s"]
    spec = figures["size"]
    rows.add(
        f"speed, transformers generate on {env.device}, random Qwen3 stand-in (hidden {spec['hidden']}, "
        f"{spec['layers']} layers, vocab {spec['vocab']}), fp32, context ~{figures['context']}: plain decoding",
        f"{plain:.1f} tokens/s",
    )
    calls = figures["probes"]["plain"]
    served_step = sum(c["seconds"] for c in calls) / sum(c["steps"] for c in calls)
    before, after = (1e3 * p["plain"][0]["seconds"] for p in figures["profiles"])
    rows.add(  # the prediction's denominator against the same step timed beside the served runs
        "  plain decoding's step: the profile's before / after the served runs / the probed pass's",
        f"{before:.2f} ms / {after:.2f} ms / {1e3 * served_step:.2f} ms",
    )
    for proposer, ks in figures["table"].items():
        for k, r in sorted(ks.items()):
            steps = figures["measured"][f"{proposer} K={k}"]["tokens_per_step"]
            rows.add(
                f"  {proposer} K={k}: tau {r['tau']:.2f} (served {steps:.2f}), {r['differing']} responses differ; "
                "speedup measured / predicted",
                f"{r['measured_speedup']:.3f} / {r['predicted_speedup']:.3f} ({r['residual']:+.1%})",
                f"within {TOLERANCE:.0%}",
                met=abs(r["residual"]) <= TOLERANCE,
            )
        steps = [figures["steps"][f"{proposer} K={k}"] for k in sorted(ks)]
        same = sum(a + 1 == b for s in steps for a, b in zip(s["walk"], s["served"]))
        rows.add(
            f"  {proposer}: responses whose walk steps + 1 (the prompt's forward) == transformers' forwards",
            f"{same}/{sum(len(s['walk']) for s in steps)}",
        )
        add_best_k_row(rows, proposer, figures["best_k"][proposer])
    return rows + probe_rows(figures["probes"])


def probe_rows(probes: dict[str, list]) -> Rows:
    """Per configuration, where a step's time went inside generate (the probed pass): the target's
    forward, the candidate generator, the loop's own work; per step after the first, in ms."""
    rows = Rows()
    rows.add("  inside generate, per step after the first: target forward / candidates / the loop's own work")
    for name, calls in probes.items():
        steps = sum(c["steps"] for c in calls)
        forward, candidates = (sum(c[key] for c in calls) for key in ("target forwards", "candidates"))
        rest = sum(c["seconds"] for c in calls) - forward - candidates
        rows.add(f"    {name}", " / ".join(f"{1e3 * x / steps:.2f} ms" for x in (forward, candidates, rest)))
    return rows
