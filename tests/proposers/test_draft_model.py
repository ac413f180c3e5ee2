"""A standalone draft model (proposers/draft/) against the shards it is scored on: the target itself as
its own draft model accepts every draft (greedy), so the checks let a good one through; a draft model
llama-server would refuse (another tokenizer, a vocabulary more than 128 tokens apart,
common/speculative.cpp:67-127), one without a tokenizer and one over --memory-budget are one
`error:` line each, before any weight is read, nothing written."""

from __future__ import annotations

import json
import shutil

import polars as pl
import pytest
from click.testing import CliRunner

from specreplay.cli import main
from tests.helpers.models import TINY_VOCAB
from tests.helpers.shards import tiny_shards

N_MAX = 3


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_qwen3_dir) -> str:
    tmp = tmp_path_factory.mktemp("draft_model")
    return tiny_shards(tmp, tiny_qwen3_dir, [{"id": f"q{i}", "prompt": f"What is {i} + {i}?"} for i in range(3)])


def draft_json(tmp_path, model_dir) -> str:
    path = tmp_path / "draft.json"
    path.write_text(json.dumps({"spec-type": "draft-simple", "model-draft": str(model_dir), "spec-draft-n-max": N_MAX}))
    return str(path)


def score(shards: str, ckpt: str, out, *extra: str):
    args = ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--ddtree-budgets", "", *extra]
    return CliRunner().invoke(main, [*args, "--walk-rule", "llama.cpp"])


def test_the_target_as_its_own_draft_model_accepts_every_draft(shards, tiny_qwen3_dir, tmp_path):
    run = score(shards, draft_json(tmp_path, tiny_qwen3_dir), tmp_path / "out")
    assert run.exit_code == 0, run.output
    [results] = (tmp_path / "out").glob("*/walk.parquet")
    walk = pl.read_parquet(results)
    assert walk.height > 0 and (walk["counted_accepted"] == walk["drafted"]).all(), walk  # every draft the target's
    assert (walk["drafted"] == N_MAX).sum() >= 3, walk  # whole chains, not only the budget's short last steps
    assert (walk["drafted"] == N_MAX).sum() >= 3, walk  # whole chains, not only the budget's short last steps


def changed_copy(source: str, dst, edit) -> str:
    """A copy of the tiny target's directory with `edit(dst)` applied."""
    shutil.copytree(source, dst)
    edit(dst)
    return str(dst)


def swap_two_tokens(directory) -> None:
    """Another tokenizer of the same size: ids 10 and 11 hold each other's text."""
    path = directory / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = (next(t for t, i in vocab.items() if i == n) for n in (10, 11))
    vocab[first], vocab[second] = 11, 10
    path.write_text(json.dumps(tokenizer))


def bigger_vocabulary(directory) -> None:
    """The same tokenizer, a model with 129 rows more than the target: llama-server's limit is 128."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    config.vocab_size = TINY_VOCAB + 129
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def no_tokenizer(directory) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (directory / name).unlink(missing_ok=True)


@pytest.mark.parametrize(
    "edit, message",
    [
        (swap_two_tokens, "token 10 is "),
        (bigger_vocabulary, f"the draft model's vocabulary has {TINY_VOCAB + 129} tokens, the target's {TINY_VOCAB}"),
        (no_tokenizer, "no tokenizer (tokenizer.json, tokenizer.model, vocab.json)"),
    ],
    ids=["another tokenizer", "vocabulary 129 apart", "no tokenizer"],
)
def test_a_draft_model_llama_server_would_refuse_is_one_error_line(shards, tiny_qwen3_dir, tmp_path, edit, message):
    draft = changed_copy(tiny_qwen3_dir, tmp_path / "draft", edit)
    run = score(shards, draft_json(tmp_path, draft), tmp_path / "out")
    assert run.exit_code == 1, run.output
    errors = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], run.output
    assert "Traceback" not in run.output and not list((tmp_path / "out").glob("*/run.json"))


def test_a_vocabulary_128_apart_is_still_the_servers_limit(shards, tiny_qwen3_dir, tmp_path):
    def padded(directory) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(directory)
        config.vocab_size = TINY_VOCAB + 128
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)

    draft = changed_copy(tiny_qwen3_dir, tmp_path / "draft", padded)
    run = score(shards, draft_json(tmp_path, draft), tmp_path / "out")
    assert run.exit_code == 0, run.output


def test_a_draft_model_over_the_memory_budget_is_one_error_line(shards, tiny_qwen3_dir, tmp_path):
    run = score(shards, f"draft:{tiny_qwen3_dir}:n={N_MAX}", tmp_path / "out", "--memory-budget", "64KiB")
    assert run.exit_code == 1, run.output
    errors = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "more than --memory-budget 64KiB" in errors[0] and "float32" in errors[0], run.output
    assert not list((tmp_path / "out").glob("*/run.json"))
