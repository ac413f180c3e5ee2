"""Extract at temperature > 0: responses drawn from the reference's sampling distribution, their
sampling log-probs stored, reproducible whatever the batching, resume or seed handling.

Tiny Qwen3 target in fp32 (tests/helpers/models.py); nothing is downloaded. The sampler itself
(pipeline/common/sampling.py) against the reference: tests/pipeline/common/test_sampling.py.
"""

from __future__ import annotations

import json
import math
import sys
from statistics import NormalDist

import pytest
import torch
from click.testing import CliRunner

from pipeline.common.sampling import Sampling, sampling_probs
from pipeline.extract.inspect import format_report, inspect_extract
from pipeline.extract.prompts import PromptRecord, render_prompt
from pipeline.extract.run import ExtractConfig, run_extract
from pipeline.extract.target import load_target
from pipeline.shards import ShardError, ShardSet, finished_shard_entries, read_manifest
from specreplay.cli import main
from tests.helpers.processes import REPO, kill_after_first_shard
from tests.helpers.prompts import write_prompts

MAX_NEW = 8
LAYERS = [0, 2, 5]
SAMPLED = dict(temperature=0.7, top_p=0.9, sample_top_k=20, num_samples=2, seed=0)
PROMPTS = [
    {"id": "p0", "prompt": "Janet's ducks lay 16 eggs per day."},
    {"id": "p1", "prompt": "Hello"},
    {"id": "p2", "prompt": "The quick brown fox", "response": "jumps over the lazy dog."},
    {"id": "p3", "input_ids": [1, 40, 41, 42, 43, 44, 45, 46]},
    {"id": "p4", "prompt": "Write a solution to the following problem"},
]
GIVEN = {"p2"}


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("sampling") / "prompts.jsonl", PROMPTS)


def extract(model_dir, prompts, out, **kwargs):
    options = dict(max_new_tokens=MAX_NEW, layer_ids=LAYERS, batch_size=3, quiet=True)
    return run_extract(ExtractConfig(model=model_dir, prompts=prompts, out=str(out), **{**options, **kwargs}))


def by_id(out) -> dict:
    return {sample.sample_id: sample for sample in ShardSet(str(out)).samples()}


def responses(samples: dict) -> dict:
    return {sample_id: s.input_ids[s.prompt_len :].tolist() for sample_id, s in samples.items()}


@pytest.fixture(scope="module")
def sampled(tiny_qwen3_dir, prompts_file, tmp_path_factory):
    """One uninterrupted sampled extract (batch size 3): (out dir, manifest, samples by id)."""
    out = tmp_path_factory.mktemp("sampled") / "out"
    manifest = extract(tiny_qwen3_dir, prompts_file, out, **SAMPLED)
    return out, manifest, by_id(out)


# ---------------------------------------------------------------------------------------------
# the sampler


def chi_square(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom over tokens of positive probability, tokens
    expected fewer than 5 times pooled into one bin (the chi-square approximation needs >= 5)."""
    expected = probs.double() * draws
    big = expected >= 5
    observed = [counts[big].double(), counts[(~big) & (probs > 0)].double().sum()[None]]
    wanted = [expected[big], expected[(~big) & (probs > 0)].sum()[None]]
    observed, wanted = torch.cat(observed), torch.cat(wanted)
    keep = wanted > 0
    statistic = float((((observed - wanted) ** 2) / wanted)[keep].sum())
    return statistic, int(keep.sum()) - 1


def chi_square_quantile(df: int, false_alarm: float) -> float:
    """Upper quantile of chi-square(df) by Wilson-Hilferty (within a few % from df = 3 up)."""
    z = NormalDist().inv_cdf(1 - false_alarm)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_first_tokens_are_distributed_as_the_sampler_says(tiny_qwen3_dir, tmp_path):
    """400 one-token draws of one prompt against sampling_probs of the target's prefill logits.
    Pearson chi-square at a false-alarm rate of 1e-4 for a random seed (the seed is fixed, so
    the test is deterministic); a sampler that ignored top-p fails the same test by far."""
    draws, temperature, top_p = 400, 1.0, 0.8
    record = {"id": "d", "prompt": "Janet's ducks"}
    prompts = write_prompts(tmp_path / "one.jsonl", [record])
    extract(
        tiny_qwen3_dir,
        prompts,
        tmp_path / "out",
        max_new_tokens=1,
        temperature=temperature,
        top_p=top_p,
        num_samples=draws,
        batch_size=100,
        layer_ids=[0],
    )
    first = torch.tensor([s.input_ids[s.prompt_len].item() for s in ShardSet(str(tmp_path / "out")).samples()])
    assert first.numel() == draws

    model, tokenizer, _ = load_target(tiny_qwen3_dir, dtype="float32")
    prompt_ids, _ = render_prompt(PromptRecord(id="d", dataset="one", prompt=record["prompt"]), tokenizer, None)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids])).logits[0, -1].float()
    probs = sampling_probs(logits, Sampling(temperature, top_p))
    counts = torch.bincount(first, minlength=probs.numel())
    assert int(counts[probs == 0].sum()) == 0, "a token outside the top-p set was drawn"
    statistic, df = chi_square(counts, probs, draws)
    assert statistic < chi_square_quantile(df, 1e-4), (statistic, df)

    # The same statistic against top-p ignored (plain softmax at T): far off, so the test has teeth.
    wrong = sampling_probs(logits, Sampling(temperature))
    assert float(wrong[probs == 0].sum()) > 0.15  # the filter removes real mass here
    wrong_statistic, wrong_df = chi_square(counts, wrong, draws)
    assert wrong_statistic > 2 * chi_square_quantile(wrong_df, 1e-4), (wrong_statistic, wrong_df)


# ---------------------------------------------------------------------------------------------
# what a sampled extract stores


def test_sampled_ids_settings_and_given_responses(sampled):
    out, manifest, samples = sampled
    draws = SAMPLED["num_samples"]
    expected_ids = {p["id"] for p in PROMPTS if p["id"] in GIVEN}
    expected_ids |= {f"{p['id']}#{k}" for p in PROMPTS if p["id"] not in GIVEN for k in range(draws)}
    assert set(samples) == expected_ids
    settings = manifest["settings"]
    assert settings["decoding"] == "sampled"
    assert settings["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 0, "num_samples": 2}
    assert settings["prompts"]["count"] == len(PROMPTS)
    assert manifest["tensors"]["sample_logprob"] == "float32"
    for sample_id, sample in samples.items():
        assert not sample.greedy  # sampled and given responses alike are not the target's greedy output
        assert sample.finish_reason == ("given" if sample_id in GIVEN else sample.finish_reason)
        assert sample_id in GIVEN or sample.finish_reason in ("eos", "length")
        logprob = sample.tensors["sample_logprob"]
        assert logprob.dtype == torch.float32 and logprob.shape == (sample.response_len,)
    totals = manifest["totals"]
    sampled_tokens = sum(s.response_len for i, s in samples.items() if i not in GIVEN)
    assert totals["sampled_response_tokens"] == sampled_tokens
    zeros = sum(int(torch.isneginf(s.tensors["sample_logprob"]).sum()) for i, s in samples.items() if i not in GIVEN)
    assert totals["zero_prob_tokens"] == zeros == 0  # fp32: cached decoding and the full forward agree

    report = inspect_extract(str(out))
    assert report["sampling"] == settings["sampling"] and report["zero_prob_tokens"] == 0
    assert (report["sampled_samples"], report["given_samples"]) == (len(samples) - 1, 1)
    text = format_report(report)
    assert "sampled at T=0.7, top-p 0.9, top-k 20; 2 draws per prompt, seed 0" in text
    assert "greedy-consistency" not in text
    assert json.loads(json.dumps(report))["sampling"]["num_samples"] == 2


def test_sample_logprob_equals_an_independent_recomputation(sampled, tiny_qwen3_dir):
    """Full forward in fp32 -> sampling_probs -> gather -> log, row P-1+i for response token i."""
    _, _, samples = sampled
    model, _, _ = load_target(tiny_qwen3_dir, dtype="float32")
    sampling = Sampling(SAMPLED["temperature"], SAMPLED["top_p"], SAMPLED["sample_top_k"])
    for sample_id, sample in samples.items():
        ids = sample.input_ids
        with torch.inference_mode():
            logits = model(ids[None]).logits[0].float()
        rows = logits[sample.prompt_len - 1 : -1]
        want = sampling_probs(rows, sampling).gather(-1, ids[sample.prompt_len :, None])[:, 0].log()
        got = sample.tensors["sample_logprob"]
        assert torch.equal(torch.isinf(got), torch.isinf(want)), sample_id
        finite = torch.isfinite(want)
        assert torch.allclose(got[finite], want[finite], rtol=0, atol=1e-5), sample_id
        if sample_id not in GIVEN:
            assert bool(finite.all()), sample_id  # every drawn token is inside its top-k/top-p set


# ---------------------------------------------------------------------------------------------
# reproducibility


def assert_same_samples(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for sample_id, sample in want.items():
        other = got[sample_id]
        assert torch.equal(other.input_ids, sample.input_ids), sample_id
        assert (other.finish_reason, other.greedy) == (sample.finish_reason, sample.greedy), sample_id
        for name, tensor in sample.tensors.items():
            assert torch.equal(other.tensors[name], tensor), f"{sample_id}: {name}"


def test_same_seed_same_responses_whatever_the_batch_size(sampled, tiny_qwen3_dir, prompts_file, tmp_path):
    _, _, want = sampled
    extract(tiny_qwen3_dir, prompts_file, tmp_path / "batch1", **SAMPLED | {"batch_size": 1})
    assert_same_samples(by_id(tmp_path / "batch1"), want)


def test_another_seed_other_responses(sampled, tiny_qwen3_dir, prompts_file, tmp_path):
    _, _, want = sampled
    extract(tiny_qwen3_dir, prompts_file, tmp_path / "seed1", **SAMPLED | {"seed": 1})
    got = responses(by_id(tmp_path / "seed1"))
    drawn = [i for i in want if i not in GIVEN]
    assert sum(got[i] != responses(want)[i] for i in drawn) >= len(drawn) // 2
    assert got["p2"] == responses(want)["p2"]  # a given response is never resampled
    # The draws of one prompt differ from each other too (each has its own generator).
    assert responses(want)["p0#0"] != responses(want)["p0#1"]


def test_resume_refuses_other_sampling_settings(sampled, tiny_qwen3_dir, prompts_file):
    out, _, _ = sampled
    with pytest.raises(ShardError, match=r"(?s)different settings.*sampling\.temperature: 0\.7 -> 0\.8"):
        extract(tiny_qwen3_dir, prompts_file, out, **SAMPLED | {"temperature": 0.8})
    with pytest.raises(ShardError, match=r"(?s)decoding: 'sampled' -> 'greedy'.*sampling\.seed: 0 -> '<absent>'"):
        extract(tiny_qwen3_dir, prompts_file, out)


@pytest.mark.slow
def test_resume_after_kill_gives_the_uninterrupted_draws(sampled, tiny_qwen3_dir, prompts_file, tmp_path):
    """Killed after some shards (batch size 1, one sample per shard), resumed with batch size 2:
    every response and sample_logprob equals the uninterrupted batch-size-3 run's."""
    _, _, want = sampled
    out = tmp_path / "out"
    options = [
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--sample-top-k",
        "20",
        "--num-samples",
        "2",
        "--seed",
        "0",
    ]
    command = [sys.executable, "-m", "specreplay", "extract", "--model", tiny_qwen3_dir, "--prompts", prompts_file]
    command += ["--out", str(out), "--max-new-tokens", str(MAX_NEW), "--layer-ids", "0,2,5", "--quiet"]
    command += [*options, "--shard-bytes", "1", "--batch-size", "1"]
    kill_after_first_shard(command, out, REPO)
    assert not read_manifest(str(out))["complete"]
    before = len(finished_shard_entries(str(out)))
    assert 1 <= before < len(want), "the kill must land mid-way"

    manifest = extract(tiny_qwen3_dir, prompts_file, out, **SAMPLED | {"batch_size": 2, "shard_bytes": 1})
    assert manifest["complete"] and manifest["totals"]["samples"] == len(want)
    assert_same_samples(by_id(out), want)


# ---------------------------------------------------------------------------------------------
# greedy stays as it was; options


def test_greedy_extract_has_no_sampling(tiny_qwen3_dir, prompts_file, tmp_path):
    manifest = extract(tiny_qwen3_dir, prompts_file, tmp_path / "greedy")
    assert "sampling" not in manifest["settings"] and manifest["settings"]["decoding"] == "greedy"
    assert "sample_logprob" not in manifest["tensors"]
    assert "zero_prob_tokens" not in manifest["totals"] and "sampled_response_tokens" not in manifest["totals"]
    assert all("zero_prob_tokens" not in entry for entry in manifest["shards"])
    samples = by_id(tmp_path / "greedy")
    assert set(samples) == {p["id"] for p in PROMPTS}  # ids unchanged, no draw suffix
    assert all("sample_logprob" not in s.tensors for s in samples.values())
    report = inspect_extract(str(tmp_path / "greedy"))
    assert report["sampling"] is None and "greedy-consistency" in format_report(report)


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--num-samples", "2"], ["--num-samples 2", "--temperature > 0"]),
        (["--top-p", "0.9"], ["--top-p 0.9", "--temperature > 0"]),
        (["--sample-top-k", "20"], ["--sample-top-k 20", "--temperature > 0"]),
        (["--temperature", "-1"], ["--temperature must be >= 0"]),
        (["--temperature", "0.6", "--top-p", "1.5"], ["--top-p must be in (0, 1]", "1.5"]),
        (["--temperature", "0.6", "--top-p", "0"], ["--top-p must be in (0, 1]"]),
        (["--temperature", "0.6", "--sample-top-k", "-1"], ["--sample-top-k must be >= 0"]),
        (["--temperature", "0.6", "--num-samples", "0"], ["--num-samples must be >= 1"]),
    ],
)
def test_option_errors_are_one_line(tiny_qwen3_dir, prompts_file, tmp_path, args, needles):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["extract", "--model", tiny_qwen3_dir, "--prompts", prompts_file, "--out", str(out), "--quiet", *args]
    )
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    for needle in needles:
        assert needle in result.output, result.output
    assert not out.exists()
