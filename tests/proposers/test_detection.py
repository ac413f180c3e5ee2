"""Which family reads a config: detection's assumptions are said, and `--family NAME[:LAYOUT]`
overrides them. A Qwen3.5 target's config is read as its native MTP head only by assumption (a small
Qwen3.5 could be a standalone draft model); a config without `architectures` is read as z-lab's
DFlash by assumption; the override reads the file as the named family's, or says in one line why it
cannot."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pipeline.common.schema import SchemaError
from proposers.detect import parse_config
from proposers.layouts import Override
from proposers.toolkit.config import DrafterConfigError
from specreplay.cli import main
from tests.helpers.drafters import drafter_config


def test_a_config_that_names_its_architecture_assumes_nothing():
    parsed = parse_config(drafter_config(), "config.json")
    assert (parsed.family.name, parsed.config.layout, parsed.assumed) == ("dflash", "z-lab", None)


def test_a_config_without_architectures_is_z_lab_dflash_by_assumption_and_says_so():
    raw = {k: v for k, v in drafter_config().items() if k != "architectures"}
    parsed = parse_config(raw, "config.json")
    assert parsed.family.name == "dflash" and "no 'architectures' field" in parsed.assumed
    assert parse_config(raw, "config.json", override=Override("dflash")).assumed is None  # said, not assumed


def qwen35_target_config() -> dict:
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 4, "hidden_size": 64},
    }


def test_a_target_config_is_its_mtp_head_by_assumption_and_says_so():
    from proposers.layouts import detect_layout

    detected = detect_layout(qwen35_target_config(), "config.json")
    assert detected.layout.LAYOUT == "native" and "native MTP head" in detected.assumed
    assert "--family" in detected.assumed


def test_the_override_reads_the_file_as_the_named_familys():
    # a speculators DSpark export read as DFlash: the family's own layout names what does not fit
    raw = {
        "speculators_model_type": "dspark",
        "transformer_layer_config": {k: drafter_config()[k] for k in ("hidden_size", "num_hidden_layers")},
        "mask_token_id": 3,
    }
    with pytest.raises(DrafterConfigError, match=r"^config.json: field 'speculators_model_type' is 'dspark'.*dflash"):
        parse_config(raw, "config.json", override=Override.parse("dflash:speculators"))
    # z-lab's DFlash config read as DFlash2: its fields say DFlash, and the override says it cannot read it
    with pytest.raises(DrafterConfigError, match=r"a dflash drafter's .*--family dflash2 cannot read it"):
        parse_config(drafter_config(), "config.json", override=Override.parse("dflash2"))


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "dflash3",
            r"no family 'dflash3'; choose from dflash, dflash2, xpress, dspark, eagle3, peagle, eagle, mtp, ngram",
        ),
        (
            "dspark:z-lab",
            r"dspark has no layout 'z-lab'; its layouts: deepseek-v4, deepspec, k3, qwen3-omni, specforge, speculators",
        ),
    ],
)
def test_a_misspelt_override_is_one_line_naming_the_choices(text, message):
    with pytest.raises(SchemaError, match=message):
        Override.parse(text)


def test_score_refuses_a_misspelt_family_before_reading_anything(tmp_path):
    run = CliRunner().invoke(
        main,
        [
            "score",
            "--ckpt",
            str(tmp_path / "absent"),
            "--shards",
            str(tmp_path),
            "--out",
            str(tmp_path / "o"),
            "--family",
            "eagle4",
        ],
    )
    assert run.exit_code != 0 and run.output.count("error:") == 1, run.output
    assert "no family 'eagle4'" in run.output and "absent" not in run.output  # the family first, before the paths
    assert not (tmp_path / "o").exists()


def test_score_notes_the_assumption_it_made(tmp_path):
    """A drafter whose config has no `architectures`: scored as z-lab's DFlash, with a note saying so."""
    from bench.standins import write_synthetic_shards
    from proposers.detect import build_drafter, parse_drafter_config
    from scoring.fit import save_drafter
    from tests.helpers.models import TINY_HIDDEN, TINY_VOCAB

    write_synthetic_shards(tmp_path / "shards", [12, 10], TINY_HIDDEN, TINY_VOCAB, 6, [1, 3], top_k=4, prompt_tokens=4)
    raw = drafter_config(layers=1)
    ckpt = save_drafter(build_drafter(parse_drafter_config(raw, "c")), str(tmp_path / "ckpt"))
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    args = ["score", "--ckpt", ckpt, "--shards", str(tmp_path / "shards"), "--out", str(tmp_path / "o"), "--quiet"]
    run = CliRunner().invoke(main, args + ["--ddtree-budgets", ""])
    assert run.exit_code == 0, run.output
    assert "note: ckpt: no 'architectures' field: read as z-lab's DFlash layout" in run.output
    forced = CliRunner().invoke(main, args + ["--ddtree-budgets", "", "--family", "dflash:z-lab", "--force"])
    assert forced.exit_code == 0 and "note:" not in forced.output, forced.output
