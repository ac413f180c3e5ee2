"""proposers/detect.py: which family a config belongs to, checked in the documented order
(speculators_model_type, then architectures, then dflash_config keys), and the one feature-layer
resolver that score (through the family) and extract --draft-config share."""

from __future__ import annotations

import pytest

from pipeline.common.errors import UserError
from pipeline.common.layer_ids import build_target_layer_ids
from proposers.detect import build_drafter, detect_family, parse_drafter_config
from proposers.dflash.model import DFlashDrafter
from proposers.layouts import feature_layers_of as drafter_layer_ids
from proposers.registry import family
from proposers.toolkit.config import DrafterConfigError
from tests.helpers.drafters import drafter_config


def test_a_zlab_config_is_dflash_v1_with_its_ids_as_stored():
    raw = drafter_config(layer_ids=(1, 3))
    assert detect_family(raw, "config.json") == "dflash"
    config = parse_drafter_config(raw, "config.json")
    assert config.family == "dflash" and config.target_layer_ids == [1, 3]
    assert isinstance(build_drafter(config), DFlashDrafter)
    assert family("dflash").label == "DFlash"


def speculators_config(kind: str, **top) -> dict:
    """A speculators-layout config of the tiny drafter's shapes; like real exports it keeps z-lab's
    "architectures": ["DFlashDraftModel"] (speculators' DFlash converter writes it). Each kind
    carries its own keys only: a key of another kind's is refused by name (docs/config-fields.md)."""
    zlab = drafter_config()
    decoder = {
        k: zlab[k]
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    }
    if kind == "eagle3":
        own = {"eagle_aux_hidden_state_layer_ids": [2, 4]}
    elif kind == "mtp":
        own = {}
    else:
        own = {"mask_token_id": 3, "aux_hidden_state_layer_ids": [2, 4]}
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": kind,
        "transformer_layer_config": decoder,
        "draft_vocab_size": zlab["vocab_size"],
        **own,
        **top,
    }


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark", "eagle3"])
def test_speculators_type_wins_over_a_zlab_architecture(kind):
    # speculators exports say "architectures": ["DFlashDraftModel"] too; read as z-lab's their ids
    # would be one layer off, so the speculators type is checked first
    config = parse_drafter_config(speculators_config(kind), "config.json")
    assert (config.family, config.layout, config.layer_convention) == (kind, "speculators", "before")
    assert config.stated_layer_ids == [2, 4] and config.target_layer_ids == [1, 3]


def test_an_mtp_head_of_another_decoder_kind_is_refused_by_name():
    """speculators' MTP export of a Qwen3 verifier: no native head layout specreplay implements."""
    raw = speculators_config("mtp")
    with pytest.raises(DrafterConfigError, match=r"^config.json: field 'model_type' is .*MTP heads of"):
        parse_drafter_config(raw, "config.json")


def test_a_qwen3_5_targets_own_config_is_its_mtp_head_reading_id_l():
    text = dict(model_type="qwen3_5_text", vocab_size=64, hidden_size=32, num_hidden_layers=3)
    text |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48)
    raw = {"model_type": "qwen3_5", "text_config": text | {"layer_types": ["full_attention"] * 3}}
    config = parse_drafter_config(raw, "config.json", target_layers=3)
    assert (config.family, config.layout, config.target_layer_ids) == ("mtp", "native", [3])


def test_a_speculators_config_is_validated_before_it_is_refused():
    raw = speculators_config("eagle3", transformer_layer_config={"hidden_size": "64"})
    with pytest.raises(DrafterConfigError, match=r"field 'transformer_layer_config.hidden_size' is '64' \(a string\)"):
        parse_drafter_config(raw, "c.json")
    with pytest.raises(DrafterConfigError, match=r"field 'speculators_model_type' is 'eagle4'"):
        parse_drafter_config(speculators_config("eagle4"), "c.json")
    with pytest.raises(DrafterConfigError, match=r"'norm_before_fc' and 'fc_norm' are both true"):
        parse_drafter_config(speculators_config("eagle3", norm_before_fc=True, fc_norm=True), "c.json")


def test_architecture_then_dflash_config_keys():
    with pytest.raises(DrafterConfigError, match="missing field 'q_lora_rank'; vLLM's K3DSparkConfig"):
        parse_drafter_config({**drafter_config(), "architectures": ["K3DSparkModel"]}, "c.json")
    with pytest.raises(DrafterConfigError, match="architecture 'GPT2LMHeadModel' is not a drafter layout"):
        parse_drafter_config({**drafter_config(), "architectures": ["GPT2LMHeadModel"]}, "c.json")
    raw = drafter_config(dflash_extra={"projector_type": "dspark", "attention_mode": "mha"})
    assert (parse_drafter_config(raw, "c.json").family, parse_drafter_config(raw, "c.json").layout) == (
        "dspark",
        "specforge",
    )
    raw = drafter_config(dflash_extra={"selector_rank": 8})
    with pytest.raises(DrafterConfigError, match=r"DFlash2 field dflash_config.conv_kernel_size is missing"):
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
    # a speculators config's before-layer ids are translated, never read one layer off
    assert drafter_layer_ids(speculators_config("dflash"), "c.json", 8) == [1, 3]
    assert drafter_layer_ids(speculators_config("eagle3"), "c.json", 8) == [1, 3]
    # before-layer id L is the residual after the last layer before the final norm: our id L
    # (stored apart from the post-norm L - 1), never L - 1
    assert drafter_layer_ids(speculators_config("dflash", aux_hidden_state_layer_ids=[2, 8]), "c.json", 8) == [1, 8]
    with pytest.raises(UserError, match="lists 0, the embedding output"):
        drafter_layer_ids(speculators_config("dflash", aux_hidden_state_layer_ids=[0, 4]), "c.json", 8)


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
        ({"rms_norm_eps": "1e-6"}, "'rms_norm_eps'", "a number with a decimal point or exponent, like 1e-06"),
        ({"attention_bias": "no"}, "'attention_bias'", "true or false"),
    ],
)
def test_a_field_of_the_wrong_type_is_one_line_naming_it(change, field, expected):
    # before: int("sixteen") raised a ValueError traceback from the parser
    with pytest.raises(DrafterConfigError, match=rf"^c\.json: field {field}.*; expected {expected}$"):
        parse_drafter_config({**drafter_config(), **change}, "c.json")


def test_declared_activations_are_the_ones_transformers_builds():
    from typing import get_args

    from transformers.activations import ACT2FN

    from proposers.toolkit.layout_fields import Activation

    assert set(get_args(Activation)) <= set(ACT2FN)
    with pytest.raises(DrafterConfigError, match=r"field 'hidden_act' is '' \(a string\); expected 'gelu'"):
        parse_drafter_config({**drafter_config(), "hidden_act": ""}, "c.json")
