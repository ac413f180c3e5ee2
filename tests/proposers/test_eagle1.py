"""EAGLE-1/2 checkpoints as the EAGLE repository saves them: detected by SGLang's and vLLM's
architectures (the repository's own only with --family eagle), scored end to end (the chain and
sglang's dynamic tree, no DDTree: each step reads the draft before it), and each bad input one
`error:` line naming its field, nothing written. The checkpoint is the repository's own `Model`
with random weights (the exactness of its drafts is tests/parity/test_eagle1_parity.py's)."""

from __future__ import annotations

import json

import polars as pl
import pytest
import torch
from click.testing import CliRunner

from proposers.checkpoints.load import load_proposer
from specreplay.cli import main
from tests.helpers.eagle1_online import random_eagle1
from tests.helpers.models import TINY_HIDDEN, TINY_VOCAB

TARGET_LAYERS = 6


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    from bench.standins import write_synthetic_shards

    out = tmp_path_factory.mktemp("eagle1") / "shards"
    layers = [TARGET_LAYERS - 1]  # the post-norm last hidden state
    write_synthetic_shards(out, [14, 12], TINY_HIDDEN, TINY_VOCAB, TARGET_LAYERS, layers, top_k=4, prompt_tokens=4)
    return str(out)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return random_eagle1(tmp_path_factory.mktemp("eagle1") / "ckpt", vocab=TINY_VOCAB, hidden=TINY_HIDDEN, layers=2)


def _score(ckpt: str, shards: str, out, *options: str):
    return CliRunner().invoke(
        main, ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--quiet", *options]
    )


def test_the_repositorys_checkpoint_is_eagle1_reading_the_last_layer(ckpt):
    proposer, _ = load_proposer(ckpt, target_layers=TARGET_LAYERS)
    assert (proposer.family, proposer.layout) == ("eagle", "sglang")
    assert not proposer.independent_drafts and proposer.max_drafts == 3
    assert proposer.needs.feature_layers == (TARGET_LAYERS - 1,)
    model = proposer.model
    assert model.layers[0].input_layernorm is None and model.layers[1].input_layernorm is not None
    assert model.fc.bias is not None and model.lm_head is None


def test_score_writes_chain_and_eagle_tree_rows_under_its_family(ckpt, shards, tmp_path):
    run = _score(ckpt, shards, tmp_path / "results", "--eagle-trees", "2x3-4", "--steps", "2")
    assert run.exit_code == 0, run.output
    [result] = [p for p in (tmp_path / "results").iterdir() if p.is_dir()]
    summary = pl.read_parquet(result / "summary.parquet")
    assert set(summary["drafter_family"]) == {"eagle"}
    assert {"chain", "eagle-tree-2x3-4"} <= set(summary["method"])
    assert not any(m.startswith("ddtree") for m in summary["method"])


def _copy(ckpt: str, tmp_path, edit_config=None, edit_state=None) -> str:
    """A copy of the checkpoint with its config.json and/or weights changed."""
    out = tmp_path / "bad"
    out.mkdir()
    config = json.loads(open(f"{ckpt}/config.json").read())
    state = torch.load(f"{ckpt}/pytorch_model.bin", weights_only=True)
    (edit_config or (lambda c: None))(config)
    (edit_state or (lambda s: None))(state)
    (out / "config.json").write_text(json.dumps(config))
    torch.save(state, out / "pytorch_model.bin")
    return str(out)


BAD = {
    "the repository's architecture without --family": (
        lambda c: c.update(architectures=["LlamaForCausalLM"]),
        None,
        "--family eagle reads one",
    ),
    "a bias the checkpoint lacks": (None, lambda s: s.pop("fc.bias"), "fc.bias"),
    "a bias the config denies": (lambda c: c.update(bias=False), None, "fc.bias"),
    "a Qwen2 EAGLE": (lambda c: c.update(model_type="qwen2"), None, "field 'model_type' is 'qwen2'"),
    "no first layer": (None, lambda s: s.pop("layers.0.self_attn.q_proj.weight"), "layers.0.self_attn.q_proj.weight"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_checkpoint_is_one_error_naming_its_field(ckpt, shards, tmp_path, case):
    edit_config, edit_state, message = BAD[case]
    out = tmp_path / "results"
    run = _score(_copy(ckpt, tmp_path, edit_config, edit_state), shards, out)
    assert run.exit_code != 0 and run.output.count("error:") == 1, run.output
    assert message in run.output, run.output
    assert "Traceback" not in run.output and not any(out.glob("*/summary.parquet"))


def test_the_repositorys_architecture_scores_under_family_eagle(ckpt, shards, tmp_path):
    repo = _copy(ckpt, tmp_path, lambda c: c.update(architectures=["LlamaForCausalLM"]))
    run = _score(repo, shards, tmp_path / "results", "--family", "eagle")
    assert run.exit_code == 0, run.output


def test_shards_without_the_last_layer_are_refused_naming_it(ckpt, tmp_path):
    from bench.standins import write_synthetic_shards

    other = tmp_path / "shards"
    write_synthetic_shards(other, [10], TINY_HIDDEN, TINY_VOCAB, TARGET_LAYERS, [1, 3], top_k=4, prompt_tokens=4)
    run = _score(ckpt, str(other), tmp_path / "results")
    assert run.exit_code != 0 and run.output.count("error:") == 1, run.output
    assert str(TARGET_LAYERS - 1) in run.output and "Traceback" not in run.output, run.output
