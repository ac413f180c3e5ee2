"""What an end-to-end chain parity test needs around its family's online loop (the EAGLE-3 and
DSpark ones, tests/parity/test_eagle3_parity.py and test_dspark_parity.py):
prompts for the tiny target of tests/helpers/dspark_online.py, a stop token its greedy responses
reach in about half of them, extract and score through specreplay's own entry points, the walk
and expected-tau tables read back from the results, and the statistics the sampled comparison
uses (per-prompt means, standard errors, z in combined standard errors)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import numpy as np
import polars as pl
import torch

from pipeline.extract.run import ExtractConfig, run_extract
from pipeline.shards import ShardSet
from scoring.config import ScoreConfig
from scoring.score.run import run_score
from tests.helpers.dspark_online import target_states


def one_thread():
    """A module fixture's body: one intra-op thread while the module runs. Tiny matrices gain nothing
    from more, and on shared cores OpenMP's spinning workers slow every call of the online loops
    by an order of magnitude."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_target_setup(tmp, count: int, max_new: int, layer_ids=None) -> tuple:
    """(tmp, target dir, prompts file, the target loaded, its greedy shards, their stop ids): the tiny
    target of tests/helpers/dspark_online.py with a stop token its greedy responses reach in about
    half of `count` prompts (written into its generation config), greedy shards of `layer_ids`
    (default the before-layer ids 1, 3, 5: OUTPUT_IDS)."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.dspark_online import build_target
    from tests.helpers.dspark_reference import OUTPUT_IDS
    from tests.helpers.prompts import write_prompts

    model_dir = build_target(tmp / "target")
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = prompt_ids(count)
    with open(f"{model_dir}/generation_config.json") as f:
        generation = json.load(f)
    generation["eos_token_id"] = stop_token(target, ids, max_new)
    with open(f"{model_dir}/generation_config.json", "w") as f:
        json.dump(generation, f)
    prompts = write_prompts(tmp / "prompts.jsonl", [{"id": f"p{i}", "input_ids": p} for i, p in enumerate(ids)])
    greedy = extract(tmp / "greedy", model_dir, prompts, max_new, OUTPUT_IDS if layer_ids is None else layer_ids)
    stop_ids = ShardSet(greedy).settings["target"]["stop_token_ids"]
    return tmp, model_dir, prompts, target, greedy, stop_ids


def prompt_ids(count: int, seed: int = 4) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 60, (6 + i % 4,), generator=gen).tolist() for i in range(count)]


def greedy_response(target, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor(prompt)
    for _ in range(max_new):
        ids = torch.cat([ids, target_states(target, ids)[0][-1].argmax()[None]])
    return ids[len(prompt) :].tolist()


def stop_token(target, prompts: list[list[int]], max_new: int) -> int:
    """A token the target's greedy responses hold after a few steps in about half of the
    prompts: some responses end at it, the others run into the budget."""
    responses = [greedy_response(target, prompt, max_new) for prompt in prompts]
    counts = Counter(token for response in responses for token in set(response[6:]) - set(response[:1]))
    token, _ = min(counts.items(), key=lambda kv: (abs(kv[1] - len(prompts) / 2), kv[0]))
    return int(token)


def extract(out, model_dir, prompts, max_new: int, layer_ids, temperature=0.0, num_samples=1, seed=11) -> str:
    options = dict(temperature=temperature, num_samples=num_samples, seed=seed) if temperature > 0 else {}
    config = ExtractConfig(
        model=model_dir,
        prompts=prompts,
        out=str(out),
        max_new_tokens=max_new,
        layer_ids=list(layer_ids),
        top_k=8,
        dtype="fp32",
        batch_size=32,
        **options,
    )
    run_extract(config)
    return str(out)


def score(ckpt: str, shards: str, out, force: bool = True, **options) -> str:
    """The results directory of `ckpt` scored on `shards`; force=False keeps one already there
    with the same settings (score's own check)."""
    config = ScoreConfig(ckpts=[ckpt], shards=shards, out=str(out), tree_nodes=[], force=force, **options)
    [outcome] = run_score(config)
    assert outcome.status in (("scored",) if force else ("scored", "skipped")), outcome.error
    return outcome.out_dir


def walk_table(out_dir: str, *more: str) -> pl.DataFrame:
    """walk.parquet's chain steps (and the columns `more`), sorted."""
    walk = pl.read_parquet(f"{out_dir}/walk.parquet", glob=False).filter(pl.col("method") == "chain")
    return walk.sort("sample_id", "step").select("sample_id", "step", "anchor", "produced", "draft_tokens", *more)


def walks(out_dir: str, *more: str) -> dict[str, pl.DataFrame]:
    """sample id -> its chain steps (produced, the teacher-forced draft tokens, the columns `more`), in order."""
    rows = walk_table(out_dir, *more)
    return {sid: group for (sid,), group in rows.group_by("sample_id", maintain_order=True)}


def offline_taus(out_dir: str) -> dict[str, list[float]]:
    """Prompt id -> the expected tau of each of its sampled responses (draws `<id>#<k>`); a
    response whose first token is a stop token has none, as the online loop takes no step."""
    samples = pl.read_parquet(f"{out_dir}/samples.parquet").filter(pl.col("method") == "chain")
    taus: dict[str, list[float]] = {}
    for sample_id, tau in samples.select("sample_id", "tau").drop_nulls().iter_rows():
        taus.setdefault(sample_id.split("#")[0], []).append(tau)
    return taus


def mean_se(values) -> tuple[float, float]:
    values = np.asarray(values, dtype=np.float64)
    return float(values.mean()), float(values.std(ddof=1) / np.sqrt(values.size))


def per_prompt(values: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    return {prompt: mean_se(v) for prompt, v in sorted(values.items())}


def anchor_chains_compared(ckpt: str, shards: str, out, chain_at, **options) -> tuple[int, int]:
    """anchors.parquet's draft block at every response anchor (score --anchor-drafts) against the
    online proposer's greedy chain there, `chain_at(ids, anchor, count)`, up to the chain's first
    draft that is not the stored token (after it the online chain reads its own wrong draft, the
    replay the stored token, and it is never verified). Asserts each equal; returns (anchors
    compared, drafts compared)."""
    out_dir = score(ckpt, shards, out, anchor_drafts=True, **options)
    rows = pl.read_parquet(f"{out_dir}/anchors.parquet").select("sample_id", "anchor", "draft_tokens")
    samples = {s.sample_id: s.input_ids for s in ShardSet(shards).samples(tensors=[])}
    compared = drafts = 0
    for sample_id, anchor, offline in rows.iter_rows():
        ids = samples[sample_id]
        # drafts of tokens the response holds (a block near a stop token drafts past it, never verified)
        known = min(len(offline), ids.numel() - 1 - anchor)
        if known == 0:  # the budget's last position drafts nothing
            continue
        chain = chain_at(ids, anchor, known)
        stored = ids[anchor + 1 : anchor + 1 + known].tolist()
        verified = next((i + 1 for i, (d, y) in enumerate(zip(chain, stored)) if d != y), known)
        assert offline[:verified] == chain[:verified], (sample_id, anchor, offline, chain)
        compared, drafts = compared + 1, drafts + verified
    print(f"every anchor: {compared} anchors' chains equal the online proposer's ({drafts} drafts compared)")
    return compared, drafts


# --------------------------------------------------------------------------- paired sampled checks


@dataclass
class PairedVerdict:
    """Per prompt, the z of the paired residual (online tau minus the offline expected tau given the
    run's own tokens: mean over the prompt's runs in standard errors), and over every run; the
    same for the wrong rule."""

    z_prompts: dict
    z: float
    z_wrong_prompts: dict
    z_wrong: float


def paired_runs(
    run, count: int, draws: int, prompts: list | None = None
) -> list[tuple[str, list[int], list[int], float]]:
    """(sample id `p<i>#<draw>`, prompt ids, the run's response ids, its tau) of `draws` seeded online
    runs on each of the `count` prompts (`prompts`, else prompt_ids') (`run(prompt ids)` -> a run with
    .tau and .output_ids); runs whose first token stops take no step and are left out."""
    runs = []
    for i, prompt in enumerate((prompts or prompt_ids(count))[:count]):
        for draw in range(draws):
            torch.manual_seed(1000 * i + draw)
            done = run(torch.tensor(prompt))
            if done.tau is not None:
                runs.append((f"p{i}#{draw}", prompt, done.output_ids[len(prompt) :].tolist(), done.tau))
    return runs


def _residual_z(runs: list, expected: dict[str, float]) -> tuple[dict[str, float], float]:
    """Per prompt and over all runs: mean(online tau - expected[sample id]) / its standard error."""
    residuals: dict[str, list[float]] = {}
    for sample_id, _, _, tau in runs:
        residuals.setdefault(sample_id.split("#")[0], []).append(tau - expected[sample_id])
    z = {p: _z(*stats) for p, stats in per_prompt(residuals).items()}
    return z, _z(*mean_se([r for rs in residuals.values() for r in rs]))


def _z(mean: float, se: float) -> float:
    """mean / se; runs whose every residual is equal have se 0: z 0 if they are 0, else infinite."""
    return mean / se if se > 0 else (0.0 if mean == 0 else np.inf)


def paired_verdict(
    ckpt: str, model_dir: str, runs: list, out, wrong: tuple, label: str, *, max_new, layer_ids, temperature, **options
) -> PairedVerdict:
    """Every online run's own response (paired_runs) extracted as a given response (`layer_ids`, at the
    runs' `temperature`), `ckpt` scored on them (score's `options`) as it is and with the wrong rule
    (object, attribute, value) patched in: the paired residual online tau - offline E[tau | those
    tokens] has mean zero under the right rule; pairing removes the tokens' own variance, so far
    fewer runs separate a wrong rule than comparing two means over separate draws does."""
    import pytest

    from tests.helpers.prompts import write_prompts

    records = [{"id": sid, "input_ids": prompt, "response": response} for sid, prompt, response, _ in runs]
    prompts = write_prompts(out / "paired.jsonl", records)
    shards = extract(out / "paired-shards", model_dir, prompts, max_new, layer_ids, temperature)
    expected = _expected_by_sample(score(ckpt, shards, out / "paired-results", **options))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(*wrong)
        expected_wrong = _expected_by_sample(score(ckpt, shards, out / "paired-results-wrong", **options))
    verdict = PairedVerdict(*_residual_z(runs, expected), *_residual_z(runs, expected_wrong))
    for prompt, z in verdict.z_prompts.items():
        print(f"{prompt}: paired residual z {z:+.2f}, {label} z {verdict.z_wrong_prompts[prompt]:+.2f}")
    print(f"over {len(runs)} runs: z {verdict.z:+.2f}, {label} z {verdict.z_wrong:+.2f}")
    return verdict


def _expected_by_sample(out_dir: str) -> dict[str, float]:
    samples = pl.read_parquet(f"{out_dir}/samples.parquet").filter(pl.col("method") == "chain")
    return dict(samples.select("sample_id", "tau").iter_rows())
