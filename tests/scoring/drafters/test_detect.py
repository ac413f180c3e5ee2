"""scoring/drafters/detect.py: which family a config belongs to, checked in the documented order
(speculators_model_type, then architectures, then dflash_config keys), and the one feature-layer
resolver that score (through the family) and extract --draft-config share."""

from __future__ import annotations

import pytest

from pipeline.common.errors import UserError
from pipeline.common.layer_ids import build_target_layer_ids, drafter_layer_ids
from scoring.drafters.base import DrafterConfigError
from scoring.drafters.detect import FAMILIES, build_drafter, detect_family, parse_drafter_config
from scoring.drafters.dflash_model import DFlashDrafter
from tests.helpers.drafters import drafter_config


def test_a_zlab_config_is_dflash_v1_with_its_ids_as_stored():
    raw = drafter_config(layer_ids=(1, 3))
    assert detect_family(raw, "config.json") == "dflash"
    config = parse_drafter_config(raw, "config.json")
    assert config.family == "dflash" and config.target_layer_ids == [1, 3]
    assert isinstance(build_drafter(config), DFlashDrafter)
    assert FAMILIES["dflash"].name == "z-lab DFlash v1"


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark", "eagle3", "mtp"])
def test_speculators_type_wins_over_a_zlab_architecture(kind):
    # speculators exports say "architectures": ["DFlashDraftModel"] too; read as z-lab's they would
    # be one layer off, so the speculators type is checked first and refused by name
    raw = {**drafter_config(), "speculators_model_type": kind, "aux_hidden_state_layer_ids": [2, 4]}
    assert raw["architectures"] == ["DFlashDraftModel"]
    with pytest.raises(DrafterConfigError, match=rf"config.json: speculators_model_type '{kind}' is the speculators"):
        parse_drafter_config(raw, "config.json")


def test_architecture_then_dflash_config_keys():
    with pytest.raises(DrafterConfigError, match="architecture 'LlamaForCausalLMEagle3' is not supported"):
        parse_drafter_config({**drafter_config(), "architectures": ["LlamaForCausalLMEagle3"]}, "c.json")
    raw = drafter_config(dflash_extra={"projector_type": "dspark"})
    with pytest.raises(DrafterConfigError, match="SpecForge's DSpark"):
        parse_drafter_config(raw, "c.json")
    raw = drafter_config(dflash_extra={"selector_rank": 8})
    with pytest.raises(DrafterConfigError, match="selector_rank"):
        parse_drafter_config(raw, "c.json")


def test_one_resolver_for_extract_and_score():
    explicit = drafter_config(layer_ids=(0, 5))
    derived = drafter_config(layer_ids=None)  # num_target_layers of the tiny target, the formula
    for raw in (explicit, derived):
        assert parse_drafter_config(raw, "c.json").target_layer_ids == drafter_layer_ids(raw, "c.json")
    assert drafter_layer_ids(derived, "c.json") == build_target_layer_ids(
        derived["num_target_layers"], derived["num_hidden_layers"]
    )
    # without num_target_layers only extract, which knows the target, can resolve them
    bare = {k: v for k, v in derived.items() if k != "num_target_layers"}
    assert drafter_layer_ids(bare, "--draft-config c.json", num_target_layers=8) == build_target_layer_ids(8, 2)
    with pytest.raises(UserError, match="feature layers are unknown"):
        parse_drafter_config(bare, "c.json")
    # a speculators config is refused by extract too, not read one layer off
    with pytest.raises(UserError, match="speculators-format config"):
        drafter_layer_ids({**explicit, "speculators_model_type": "dflash"}, "--draft-config c.json", 8)


@pytest.mark.parametrize(
    ("change", "field", "expected"),
    [
        ({"block_size": "sixteen"}, "'block_size' is 'sixteen'", "an integer"),
        (
            {"dflash_config": {"mask_token_id": "511", "target_layer_ids": [1, 3]}},
            "'dflash_config.mask_token_id'",
            "an integer",
        ),
        ({"hidden_size": 64.5}, "'hidden_size' is 64.5", "an integer"),
        ({"num_hidden_layers": True}, "'num_hidden_layers' is True", "an integer"),
        ({"rms_norm_eps": "1e-6"}, "'rms_norm_eps'", "a number"),
        ({"attention_bias": "no"}, "'attention_bias'", "true or false"),
    ],
)
def test_a_field_of_the_wrong_type_is_one_line_naming_it(change, field, expected):
    # before: int("sixteen") raised a ValueError traceback from the parser
    with pytest.raises(DrafterConfigError, match=rf"^c\.json: field {field}.*; expected {expected}$"):
        parse_drafter_config({**drafter_config(), **change}, "c.json")
