"""P-EAGLE checkpoints as speculators and SpecForge save them: detected, scored end to end (chain and
DDTree, its drafts being independent given the block), SpecForge's read as vLLM reads it, and each
bad input one `error:` line naming its field, nothing written. The checkpoints are the references'
own PEagleDraftModels with random weights (the exactness of their drafts is
tests/parity/test_peagle_parity.py's)."""

from __future__ import annotations

import json

import polars as pl
import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from proposers.checkpoints.load import load_proposer
from specreplay.cli import main
from tests.helpers.models import TINY_HIDDEN, TINY_VOCAB
from tests.helpers.peagle_online import MASK_TOKEN, random_peagle
from tests.helpers.shards import tiny_synthetic

AUX_IDS = (2, 4)  # speculators' before-layer ids: the outputs of layers 1 and 3, as the shards store them


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    return tiny_synthetic(tmp_path_factory.mktemp("peagle") / "shards")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return random_peagle(
        tmp_path_factory.mktemp("peagle") / "ckpt", vocab=TINY_VOCAB, hidden=TINY_HIDDEN, aux_ids=AUX_IDS
    )


def test_a_speculators_checkpoint_is_p_eagle_with_its_mask_block(ckpt):
    proposer, _ = load_proposer(ckpt, target_layers=6)
    config = proposer.config
    assert (proposer.family, proposer.layout) == ("peagle", "speculators")
    assert proposer.independent_drafts and proposer.max_drafts == 4
    assert config.mask_token_id == MASK_TOKEN and not config.teacher_forced_block
    assert proposer.needs.feature_layers == (1, 3)
    assert tuple(proposer.model.mask_hidden.shape) == (1, 1, 2 * TINY_HIDDEN)


def test_score_writes_chain_and_ddtree_rows_under_its_family(ckpt, shards, tmp_path):
    out = tmp_path / "results"
    args = ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--ddtree-budgets", "8", "--quiet"]
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 0, run.output
    [result] = [p for p in out.iterdir() if p.is_dir()]
    summary = pl.read_parquet(result / "summary.parquet")
    assert set(summary["drafter_family"]) == {"peagle"}
    assert {"chain", "ddtree-8"} <= set(summary["method"])


def _copy(ckpt: str, tmp_path, edit_config=None, edit_state=None) -> str:
    """A copy of the checkpoint with its config.json and/or weights changed."""
    out = tmp_path / "bad"
    out.mkdir(parents=True)
    config = json.loads(open(f"{ckpt}/config.json").read())
    state = load_file(f"{ckpt}/model.safetensors")
    (edit_config or (lambda c: None))(config)
    (edit_state or (lambda s: None))(state)
    (out / "config.json").write_text(json.dumps(config))
    save_file(state, str(out / "model.safetensors"))
    return str(out)


BAD = {
    "no mask token": (lambda c: c.pop("mask_token_id"), None, "missing field 'mask_token_id'"),
    "mask token outside the vocabulary": (
        lambda c: c.update(mask_token_id=TINY_VOCAB),
        None,
        f"field 'mask_token_id' is {TINY_VOCAB}, outside",
    ),
    "no mask hidden state": (None, lambda s: s.pop("mask_hidden"), "mask_hidden"),
    "no embedding of its own": (None, lambda s: s.pop("embed_tokens.weight"), "embed_tokens.weight"),
    "vLLM's name beside speculators'": (lambda c: c.update(ptd_token_id=MASK_TOKEN), None, "ptd_token_id"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_checkpoint_is_one_error_naming_its_field(ckpt, shards, tmp_path, case):
    edit_config, edit_state, message = BAD[case]
    bad = _copy(ckpt, tmp_path, edit_config, edit_state)
    out = tmp_path / "results"
    run = CliRunner().invoke(main, ["score", "--ckpt", bad, "--shards", shards, "--out", str(out), "--quiet"])
    assert run.exit_code != 0 and run.output.count("error:") == 1, run.output
    assert message in run.output, run.output
    assert "Traceback" not in run.output and not any(out.glob("*/summary.parquet"))


# ---------------------------------------------------------------------------------------------
# SpecForge's layout: its own PEagleDraftModel (random weights), saved by its own save_pretrained


@pytest.fixture(scope="module")
def specforge_ckpt(tmp_path_factory) -> str:
    """SpecForge's PEagleDraftModel for 3 feature layers (its fc reads three), two layers, saved with
    the mask token and before-layer ids a vLLM user adds."""
    import torch

    from tests.helpers import peagle_specforge as specforge

    with torch.no_grad():
        model = specforge.new_model(vocab=TINY_VOCAB, hidden=TINY_HIDDEN, layers=2)
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    out = str(tmp_path_factory.mktemp("peagle") / "specforge")
    return specforge.save(model, out, mask_token=MASK_TOKEN, aux_ids=SPECFORGE_IDS, steps=3)


SPECFORGE_IDS = (2, 4, 6)  # before-layer ids as vLLM reads them: the outputs of layers 1, 3 and 5


def test_a_specforge_checkpoint_is_p_eagle_read_as_vllm_reads_it(specforge_ckpt):
    proposer, _ = load_proposer(specforge_ckpt, target_layers=6)
    config = proposer.config
    assert (proposer.family, proposer.layout) == ("peagle", "specforge")
    assert proposer.independent_drafts and proposer.max_drafts == 3
    assert config.mask_token_id == MASK_TOKEN and config.num_hidden_layers == 2
    assert proposer.needs.feature_layers == (1, 3, 6)  # id 6 of a 6-layer target: the last layer's output


def _mask_keys(config: dict, **keys) -> None:
    config.pop("mask_token_id")
    config.update(keys)


def test_the_mask_token_is_read_where_vllm_reads_it_first(specforge_ckpt, tmp_path):
    """vLLM's order (llm_base_proposer.py): dflash_config.mask_token_id before mask_token_id before
    ptd_token_id; the first one set wins."""
    edits = {
        "dflash": (lambda c: _mask_keys(c, dflash_config={"mask_token_id": 7}, ptd_token_id=9), 7),
        "ptd": (lambda c: _mask_keys(c, ptd_token_id=9, pard_token=8), 8),
    }
    for name, (edit, expected) in edits.items():
        bad = _copy(specforge_ckpt, tmp_path / name, edit)
        proposer, _ = load_proposer(bad, target_layers=6)
        assert proposer.config.mask_token_id == expected, name


SPECFORGE_BAD = {
    "no mask token (SpecForge saves none)": (lambda c: c.pop("mask_token_id"), 'add "mask_token_id": N'),
    "fc_norm": (lambda c: c.update(fc_norm=True), "field 'fc_norm' is true"),
    "norm_before_fc in eagle_config": (
        lambda c: c["eagle_config"].update(norm_before_fc=True),
        "field 'eagle_config.norm_before_fc' is true",
    ),
    "aux count": (lambda c: c.update(num_aux_hidden_states=2), "field 'num_aux_hidden_states' is 2"),
}


@pytest.mark.parametrize("case", list(SPECFORGE_BAD))
def test_a_bad_specforge_config_is_one_error_naming_its_field(specforge_ckpt, shards, tmp_path, case):
    edit, message = SPECFORGE_BAD[case]
    bad = _copy(specforge_ckpt, tmp_path, edit)
    out = tmp_path / "results"
    run = CliRunner().invoke(main, ["score", "--ckpt", bad, "--shards", shards, "--out", str(out), "--quiet"])
    assert run.exit_code != 0 and run.output.count("error:") == 1, run.output
    assert message in run.output, run.output
    assert "Traceback" not in run.output and not any(out.glob("*/summary.parquet"))
