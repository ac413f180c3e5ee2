"""`specreplay score` refusing a drafter of another family it cannot score as given: each is one
`error:` line naming the checkpoint, what was found and what is expected, no traceback, and no
results directory. The checkpoints are speculators' own models (built and saved by its classes,
tests/helpers/family_fits.py), damaged the way a bad export or an edit damages them."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from specreplay.cli import main
from tests.helpers import family_fits as fits
from tests.helpers.dflash2_reference import speculators_dflash2
from tests.helpers.drafters import REFERENCE_HIDDEN
from tests.helpers.models import TINY_HIDDEN, TINY_VOCAB
from tests.helpers.shards import tiny_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_qwen3_dir):
    tmp = tmp_path_factory.mktemp("family_errors")
    records = [{"id": f"q{i}", "prompt": f"Question {i}: what is {i} + {i}?"} for i in range(2)]
    return tiny_shards(tmp, tiny_qwen3_dir, records, max_new_tokens=8)


def _save(recipe: fits.Recipe, target_dir: str, out) -> str:
    """speculators' drafter of `recipe` for the tiny target (aux ids 2, 4: the shards' 1, 3),
    unfitted, saved by its own save_pretrained."""
    ids = torch.arange(3, 3 + 64)
    model = fits.new_drafter(recipe, target_dir, [(ids, 4)])
    model.save_pretrained(str(out))
    return str(out)


def _edit_weights(ckpt: str, edit) -> None:
    path = os.path.join(ckpt, "model.safetensors")
    tensors = load_file(path)
    save_file(edit(tensors), path)


def _refused(ckpt: str, shards: str, out) -> str:
    result = CliRunner().invoke(main, ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(out)])
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert len(errors) == 1 and errors[0].startswith(f"error: {ckpt}"), result.output
    assert not os.path.exists(out), os.listdir(out)  # nothing written
    return errors[0]


def test_an_unknown_family_names_what_was_found_and_what_is_supported(shards, tiny_qwen3_dir, tmp_path):
    ckpt = _save(fits.Recipe("dflash"), tiny_qwen3_dir, tmp_path / "ckpt")
    config = json.load(open(f"{ckpt}/config.json"))
    json.dump({**config, "speculators_model_type": "medusa"}, open(f"{ckpt}/config.json", "w"))
    line = _refused(ckpt, shards, tmp_path / "out")
    assert "medusa" in line and all(name in line for name in ("dflash", "dflash2", "dspark")), line


def test_a_dflash2_checkpoint_without_its_selector_names_the_missing_weights(shards, tiny_qwen3_dir, tmp_path):
    ckpt = _save(fits.Recipe("dflash2"), tiny_qwen3_dir, tmp_path / "ckpt")
    _edit_weights(ckpt, lambda t: {k: v for k, v in t.items() if not k.startswith("candidate_selector.")})
    line = _refused(ckpt, shards, tmp_path / "out")
    assert "missing" in line and "candidate_selector." in line, line


def test_a_d2t_outside_the_target_vocabulary_is_refused(shards, tiny_qwen3_dir, tmp_path):
    ckpt = _save(fits.Recipe("dflash", draft_vocab_size=32), tiny_qwen3_dir, tmp_path / "ckpt")

    def push_last_id_out(tensors):
        d2t = tensors["d2t"].clone()
        d2t[-1] = TINY_VOCAB  # draft id 31 -> target id 31 + 512: past the vocabulary
        return {**tensors, "d2t": d2t}

    _edit_weights(ckpt, push_last_id_out)
    line = _refused(ckpt, shards, tmp_path / "out")
    assert "d2t" in line and f"vocabulary of {TINY_VOCAB}" in line, line


def test_a_drafter_for_another_target_names_both_shapes(shards, tmp_path):
    """speculators' DFlash2 for a target of hidden 32 and vocabulary 64 against shards of a
    target of hidden 64 and vocabulary 512: refused, naming both hidden sizes."""
    ckpt = str(tmp_path / "ckpt")
    speculators_dflash2(ckpt)
    line = _refused(ckpt, shards, tmp_path / "out")
    assert f"hidden_size {REFERENCE_HIDDEN}" in line and f"hidden_size {TINY_HIDDEN}" in line, line


def test_steps_on_a_block_family_needs_an_engine_rule_and_fits_the_block(shards, tiny_qwen3_dir, tmp_path):
    """dflash_generate runs a DFlash drafter's trained block: --steps is refused under the default
    walk rule, naming the engine rules; under one, more drafts than the block holds are refused."""
    ckpt = _save(fits.Recipe("dflash"), tiny_qwen3_dir, tmp_path / "ckpt")
    out = tmp_path / "out"
    for extra, wanted in (
        (["--steps", "2"], "--walk-rule llama.cpp"),
        (["--steps", "4", "--walk-rule", "llama.cpp"], "--steps 3 or fewer"),
    ):
        result = CliRunner().invoke(main, ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(out), *extra])
        errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
        assert result.exit_code == 1 and len(errors) == 1 and "Traceback" not in result.output, result.output
        assert "--steps" in errors[0] and "DFlash" in errors[0] or "at most 3" in errors[0], errors[0]
        assert wanted in errors[0], errors[0]
        assert not os.path.exists(out)


def test_an_eagle3_checkpoint_missing_weights_is_asked_about_its_own_family_once(shards, tmp_path):
    from tests.helpers import eagle3_reference as eagle3

    model = eagle3.speculators_eagle3(vocab=TINY_VOCAB, hidden=TINY_HIDDEN, aux_ids=(2, 4))
    ckpt = eagle3.save(model, tmp_path / "ckpt")
    _edit_weights(ckpt, lambda t: {k: v for k, v in t.items() if not k.startswith("fc.")})
    result = CliRunner().invoke(main, ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(tmp_path / "out")])
    line = _refused(ckpt, shards, tmp_path / "out")
    assert "missing" in line and "as the EAGLE-3 drafter its config declares" in line and "DFlash" not in line, line
    assert not line.startswith(f"error: {ckpt}: {ckpt}"), line  # the path once
    assert result.output.count("missing") == 1, result.output  # the error once, no recap of one checkpoint
