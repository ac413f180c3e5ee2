"""A draft model given as a GGUF file (`draft:small.gguf`, llama-server's `-md small.gguf`,
vLLM's `model` the same): read as the extract reads a GGUF target (pipeline/extract/target.py
gguf_to_cache), then drafted as its transformers directory is.

The target is llama_engine's tiny Qwen3 at SmolLM2's vocabulary (whose tokenizer llama.cpp's
converter knows); the draft a 1-layer Qwen3 fitted briefly on the target's greedy continuations,
converted to an F32 GGUF by llama.cpp's own converter. Its head_dim is 128: transformers' GGUF
reader takes a Qwen3's head_dim from the config's default (128), not from the GGUF, so a GGUF of a
Qwen3 with another head_dim does not load (one error line, below). Scored as `draft:X.gguf` and as
`draft:X/`, the walks are equal; a GGUF cut short, or one transformers cannot read as a causal LM,
is one error line naming it.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from specreplay.cli import main
from tests.helpers import chain_parity as chains, engine_parity as parity, llama_engine as engine
from tests.helpers.models import one_torch_thread
from tests.helpers.prompts import write_prompts
from tools.llama_convert import convert

N_MAX, MAX_NEW, FIT_STEPS = 3, 24, 25
WALK_COLUMNS = ["sample_id", "step", "anchor", "drafted", "counted_accepted", "counted_exact"]


def fitted_draft(target_dir, sequences, out, head_dim: int = 128) -> str:
    """llama_engine.fitted_draft_model of 1 layer, `head_dim` wide (transformers' GGUF reader
    assumes a Qwen3's head width of 128)."""
    shape = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": head_dim}
    return engine.fitted_draft_model(target_dir, sequences, out, layers=1, steps=FIT_STEPS, **shape)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(shards, the draft's transformers directory, its GGUF, the cache the GGUF converts into)."""
    tmp = tmp_path_factory.mktemp("draft_gguf")
    prompts = parity.prompt_ids(3)
    target = engine.engine_target(tmp / "target", prompts, MAX_NEW, layers=2)
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(prompts)]
    shards = chains.extract(tmp / "shards", target, write_prompts(tmp / "prompts.jsonl", records), MAX_NEW, [])
    draft = fitted_draft(target, engine.continuations(target, prompts, MAX_NEW), tmp / "draft")
    return shards, draft, str(convert(draft, tmp / "draft.gguf")), tmp / "model-cache"


@pytest.fixture(autouse=True)
def model_cache(world, monkeypatch):
    monkeypatch.setenv("SPECREPLAY_MODEL_CACHE", str(world[3]))  # not the repository's data/models/


def score(shards: str, ckpt: str, out, rule: str = "llama.cpp"):
    args = ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--ddtree-budgets", ""]
    return CliRunner().invoke(main, [*args, "--walk-rule", rule])


def walk_of(out) -> pl.DataFrame:
    return pl.read_parquet(next(Path(out).glob("*/walk.parquet"))).select(WALK_COLUMNS).sort("sample_id", "step")


@pytest.mark.parametrize("prefix, rule", [("draft", "llama.cpp"), ("draft-vllm", "vllm")])
def test_a_gguf_draft_model_walks_as_its_transformers_directory(world, tmp_path, prefix, rule):
    shards, draft, gguf, _ = world
    key = "n" if prefix == "draft" else "k"
    runs = {
        name: score(shards, f"{prefix}:{path}:{key}={N_MAX}", tmp_path / name, rule)
        for name, path in (("dir", draft), ("gguf", gguf))
    }
    for run in runs.values():
        assert run.exit_code == 0, run.output
    directory, converted = walk_of(tmp_path / "dir"), walk_of(tmp_path / "gguf")
    assert directory.equals(converted), (directory, converted)
    assert directory["counted_accepted"].sum() >= 5, directory  # the fit accepts drafts: the walks say something


def one_error(run, out, message: str) -> None:
    assert run.exit_code == 1, run.output
    errors = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], run.output
    assert "Traceback" not in run.output and not list(Path(out).glob("*/run.json"))


def test_a_gguf_cut_short_is_one_error_line(world, tmp_path):
    shards, _, gguf, _ = world
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(gguf).read_bytes()[: Path(gguf).stat().st_size // 3])
    one_error(score(shards, f"draft:{cut}:n={N_MAX}", tmp_path / "out"), tmp_path / "out", f"{cut}: not a GGUF of")


def test_a_gguf_transformers_cannot_read_as_a_causal_lm_is_one_error_line(world, tmp_path):
    """A Qwen3 of head_dim 16 (transformers' GGUF reader assumes 128), and a file that is no GGUF."""
    shards, draft, _, _ = world
    narrow = fitted_draft(draft, [], tmp_path / "narrow", head_dim=16)
    gguf = convert(narrow, tmp_path / "narrow.gguf")
    one_error(score(shards, f"draft:{gguf}:n={N_MAX}", tmp_path / "out"), tmp_path / "out", f"{gguf}: not a GGUF of")
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    one_error(score(shards, f"draft:{text}:n={N_MAX}", tmp_path / "o2"), tmp_path / "o2", f"{text}: not a GGUF of")
