"""`specreplay profile --engine torch`: transformers' forwards on torch (the engine of a GPU user,
and the one that times several sequences at once), on tiny targets built from configs; what
`speed` then reads."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from scoring.speed.profile import load_profile
from scoring.speed.torch_bench import timed_rows
from specreplay.cli import main
from tests.helpers.models import build_tiny_qwen3, build_tiny_qwen35_hybrid


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch_profile")
    return build_tiny_qwen3(tmp / "qwen3"), build_tiny_qwen35_hybrid(tmp / "hybrid")


def test_every_batch_size_and_count_is_timed_with_the_target_s_sizes(targets, tmp_path):
    """Rows at each (batch, tokens) asked, plain decoding and the draft model's one-token forward
    at each batch size; the target's sizes as its config.json says them; the device recorded."""
    qwen3, _ = targets
    out = tmp_path / "torch.json"
    args = ["profile", "--engine", "torch", "--target", qwen3, "--draft", f"draft={qwen3}", "--batch", "1-2"]
    run = CliRunner().invoke(main, [*args, "--tokens", "1,3", "--context", "8", "--reps", "1", "--out", str(out)])
    assert run.exit_code == 0, run.output
    profile = load_profile(str(out))
    assert [(p.batch, p.tokens) for p in profile.file.verify] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert sorted(profile.plain) == [1, 2]
    assert [(d.family, d.batch, d.tokens) for d in profile.file.drafters] == [("draft", 1, 1), ("draft", 2, 1)]
    with open(f"{qwen3}/config.json") as f:
        config = json.load(f)
    target = profile.file.target
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["vocab_size"],
    )
    assert profile.file.measured.device == "cpu" and "transformers on torch" in profile.file.measured.engine


@pytest.mark.parametrize("which", [0, 1], ids=["qwen3", "qwen3.5-hybrid"])
def test_each_timed_forward_sees_exactly_the_context_and_the_shape_asked(targets, which):
    """Every timed forward runs over [b, n] new tokens after exactly `context` cached ones (the cache
    is copied, not grown by earlier repetitions), a hybrid target's recurrent state included."""
    from pipeline.extract.target import load_target

    model, _, _ = load_target(targets[which], dtype="fp32")
    seen = []

    def record(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        seen.append((tuple(kwargs["input_ids"].shape), int(cache.get_seq_length()) if cache is not None else None))

    model.register_forward_pre_hook(record, with_kwargs=True)
    times = timed_rows(model, [1, 3], [1, 4], context=5, reps=2)
    assert sorted(times) == [(1, 1), (1, 4), (3, 1), (3, 4)] and all(t > 0 for t in times.values())
    prefills = [shape for shape, cached in seen if cached is None]
    timed = [(shape, cached) for shape, cached in seen if cached is not None]
    assert prefills == [(1, 5), (3, 5)]
    assert timed == [((b, n), 5) for b in (1, 3) for n in (1, 4) for _ in range(3)]  # a warm-up and 2 reps


def test_options_of_the_other_engine_and_a_missing_gpu_are_refused(targets, tmp_path):
    qwen3, _ = targets
    base = ["profile", "--target", qwen3, "--out", str(tmp_path / "p.json")]
    cases = [
        (["--engine", "torch", "--serve", f"dflash={qwen3}"], "--serve is read by --engine llama.cpp only"),
        (["--engine", "torch", "--in-server"], "--in-server is read by --engine llama.cpp only"),
        (["--batch", "4"], "--batch is read by --engine torch only"),
        (["--device", "cpu"], "--device is read by --engine torch only"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--engine", "torch", "--device", "cuda"], "torch sees no CUDA device here"))
    for extra, said in cases:
        run = CliRunner().invoke(main, [*base, *extra])
        assert run.exit_code != 0 and said in run.output, (extra, run.output)
        assert not (tmp_path / "p.json").exists()


def test_in_generate_times_generate_s_own_steps_and_the_drafting_share_of_each_k(targets, tmp_path):
    """--in-generate: plain decoding at batch 1 is generate's step (one row, no bare forward beside
    it), and draft_steps hold prompt lookup (family ngram) and the --draft model's assisted
    generation at each K of --serve-drafts; the llama.cpp engine refuses the flag."""
    qwen3, _ = targets
    out = tmp_path / "gen.json"
    args = ["profile", "--engine", "torch", "--target", qwen3, "--draft", f"draft={qwen3}", "--in-generate"]
    args += ["--serve-drafts", "1,3", "--serve-requests", "1", "--tokens", "1-4", "--context", "8", "--reps", "1"]
    run = CliRunner().invoke(main, [*args, "--out", str(out)])
    assert run.exit_code == 0, run.output
    profile = load_profile(str(out))
    assert [p.batch for p in profile.file.plain] == [1] and profile.plain[1] > 0
    steps = [(d.family, d.drafts) for d in profile.file.draft_steps]
    assert steps == [("ngram", 1), ("ngram", 3), ("draft", 1), ("draft", 3)]
    assert all(d.seconds > 0 for d in profile.file.draft_steps)
    assert "inside generate" in profile.file.measured.engine
    refused = CliRunner().invoke(main, ["profile", "--target", "t.gguf", "--in-generate", "--out", str(tmp_path / "x")])
    assert refused.exit_code == 2 and "--in-generate is read by --engine torch only" in refused.output


def check_candidates_too(monkeypatch):
    """transformers 5.17's assisted loop: the stopping criteria also called on the candidates, right
    after get_candidates and before the verifying forward (`is_done_candidate`), so twice a step."""
    from transformers.generation import candidate_generator as generators, utils

    criteria = {}
    decoding = utils.GenerationMixin._assisted_decoding

    def keep(self, input_ids, logits_processor, stopping_criteria, *args, **kwargs):
        criteria["now"] = stopping_criteria
        return decoding(self, input_ids, logits_processor, stopping_criteria, *args, **kwargs)

    monkeypatch.setattr(utils.GenerationMixin, "_assisted_decoding", keep)
    for cls in (generators.AssistedCandidateGenerator, generators.PromptLookupCandidateGenerator):

        def checked(self, ids, *args, _get=cls.get_candidates, **kwargs):
            out = _get(self, ids, *args, **kwargs)
            criteria["now"](out[0], None)
            return out

        monkeypatch.setattr(cls, "get_candidates", checked)


@pytest.mark.parametrize("candidate_check", [False, True], ids=["once-a-step", "5.17-twice-a-step"])
def test_a_step_is_one_call_of_the_clock_and_the_assistant_drafts_k(targets, candidate_check, monkeypatch):
    """timed_generate's steps are generate's steps after the prompt's: with a draft model equal to
    the target (every draft accepted) at K = 2, each step appends 3 tokens and forwards the target
    once; the target's forward time is a part of the steps' time. Where generate also calls the
    stopping criteria on the candidates (transformers 5.17), the steps are still the forwards."""
    from scoring.speed.torch_bench import loaded
    from scoring.speed.torch_generate import generate_options, timed_generate

    if candidate_check:
        check_candidates_too(monkeypatch)
    qwen3, _ = targets
    model, _ = loaded(qwen3, "cpu", "fp32")
    draft, _ = loaded(qwen3, "cpu", "fp32")
    calls = []
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    ids = torch.randint(3, 200, (1, 8), generator=torch.Generator().manual_seed(0))
    try:
        seconds, forwards, steps = timed_generate(model, ids, 13, generate_options("assisted", 2, draft))
    finally:
        hook.remove()
    assert steps == len(calls) - 1 == 4  # the prompt's step (3 tokens) and 4 more of 3 tokens: 15 >= 13
    assert 0 < forwards < seconds
