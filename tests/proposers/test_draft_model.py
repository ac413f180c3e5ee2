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


def rows_more(more: int):
    """An edit: the same tokenizer, a model with `more` embedding rows than the target."""

    def edit(directory) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(directory)
        config.vocab_size = TINY_VOCAB + more
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)

    return edit


def no_tokenizer(directory) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (directory / name).unlink(missing_ok=True)


@pytest.mark.parametrize(
    "edit, message",
    [
        (swap_two_tokens, "token 10 is "),
        (rows_more(129), f"the draft model's vocabulary has {TINY_VOCAB + 129} tokens, the target's {TINY_VOCAB}"),
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
    draft = changed_copy(tiny_qwen3_dir, tmp_path / "draft", rows_more(128))  # llama-server's limit is 128
    run = score(shards, draft_json(tmp_path, draft), tmp_path / "out")
    assert run.exit_code == 0, run.output


def test_a_draft_model_over_the_memory_budget_is_one_error_line(shards, tiny_qwen3_dir, tmp_path):
    run = score(shards, f"draft:{tiny_qwen3_dir}:n={N_MAX}", tmp_path / "out", "--memory-budget", "64KiB")
    assert run.exit_code == 1, run.output
    errors = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "more than --memory-budget 64KiB" in errors[0] and "float32" in errors[0], run.output
    assert not list((tmp_path / "out").glob("*/run.json"))


# --------------------------------------------------------------------------------------------- vLLM's


def test_vllms_draft_model_by_name_accepts_every_draft_of_the_target_itself(shards, tiny_qwen3_dir, tmp_path):
    """vLLM's method "draft_model" (greedy drafting, the default) under vLLM's walk rule."""
    run = score(shards, f"draft-vllm:{tiny_qwen3_dir}:k={N_MAX}", tmp_path / "out", "--walk-rule", "vllm")
    assert run.exit_code == 0, run.output
    walk = pl.read_parquet(next((tmp_path / "out").glob("*/walk.parquet")))
    assert set(walk["drafter_layout"]) == {"vllm"}
    known = walk.filter(pl.col("counted_exact"))
    assert (known["counted_accepted"] == known["drafted"]).all() and (known["drafted"] == N_MAX).sum() >= 3, walk


def test_vllm_refuses_a_vocabulary_one_token_apart_which_llama_server_takes(shards, tiny_qwen3_dir, tmp_path):
    """vLLM requires the same vocabulary size (vllm/config/speculative.py verify_equal_vocab_size_if_draft_model)."""
    draft = changed_copy(tiny_qwen3_dir, tmp_path / "draft", rows_more(1))
    run = score(shards, f"draft-vllm:{draft}:k={N_MAX}", tmp_path / "out", "--walk-rule", "vllm")
    assert run.exit_code == 1 and "vLLM requires the same size" in run.output, run.output
    assert score(shards, draft_json(tmp_path, draft), tmp_path / "llama").exit_code == 0


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"draft_sample_method": "probabilistic"}, "field 'draft_sample_method' is 'probabilistic'"),
        ({"use_local_argmax_reduction": True}, "use_local_argmax_reduction"),  # vLLM refuses it with a mapping
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),  # a key not replayed: refused, not dropped
    ],
)
def test_a_vllm_draft_config_not_replayed_as_given_is_refused_by_name(fields, message):
    from pipeline.common.errors import UserError
    from proposers.detect import parse_config

    raw = {"method": "draft_model", "model": "small/", "num_speculative_tokens": 3, **fields}
    with pytest.raises(UserError, match=message) as error:
        parse_config(raw, "vllm-draft.json")
    assert str(error.value).startswith("vllm-draft.json: ") and "\n" not in str(error.value)
