"""No config field silently ignored (docs/config-fields.md): every key of a drafter config is
declared by its layout or transformers' config class, or refused by name; a field an engine
honours that the replay does not implement is refused unless neutral, naming the value and the
engine; the ones it implements change what is computed the way the engines' rule says. A refusal
is one line; through the CLI one `error:` line, nothing written, no traceback."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from click.testing import CliRunner

from pipeline.common.errors import UserError
from proposers.checkpoints.files import CheckpointError, resolve_checkpoint_files
from proposers.detect import build_drafter, parse_drafter_config
from proposers.fields.decoder_rules import shown
from proposers.toolkit.attention import block_masks
from proposers.toolkit.layout_fields import UNKNOWN_KEY
from specreplay.cli import main
from tests.helpers.config_layouts import ABSENT, BASE, REFUSALS, SLIDING, TARGET_LAYERS, base, with_field
from tests.helpers.drafters import _random_weights, fitted_drafters
from tests.helpers.shards import tiny_shards


def parse(raw: dict):
    return parse_drafter_config(raw, "c.json", TARGET_LAYERS)


def refusal(raw: dict) -> str:
    with pytest.raises(UserError) as caught:
        parse(raw)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("c.json: "), message
    return message


def same_config(a, b) -> bool:
    """Two parsed configs alike in everything but the raw fields they were read from."""
    return {k: v for k, v in vars(a).items() if k != "raw"} == {k: v for k, v in vars(b).items() if k != "raw"}


# --------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("layout", sorted(BASE))
def test_every_base_layout_parses(layout):
    assert parse(base(layout)).family == layout.split(":")[0]


@pytest.mark.parametrize(
    ("layout", "path"),
    [
        ("dflash:z-lab", "dflash_config.foo"),
        ("dflash2:z-lab", "dflash_config.block_sise"),
        ("dflash:speculators", "speculators_config.foo"),
        ("dspark:speculators", "speculators_config.proposal_methods[0].foo"),
        ("eagle3:speculators", "speculators_config.verifier.foo"),
        ("eagle3:specforge", "eagle_config.foo"),
        ("dspark:specforge", "dflash_config.foo"),
    ],
)
def test_an_unknown_key_of_an_enumerated_namespace_is_refused_by_name(layout, path):
    message = refusal(with_field(base(layout), path, 1))
    assert message == f"c.json: field {path!r} {UNKNOWN_KEY}", message


@pytest.mark.parametrize(
    ("layout", "path", "cls"),
    [
        ("dflash:z-lab", "foo", "Qwen3Config"),
        ("dflash2:z-lab", "quantization_config", "Qwen3Config"),
        ("dflash:z-lab", "rope_parameters.foo", "Qwen3Config"),
        ("dflash:speculators", "transformer_layer_config.foo", "Qwen3Config"),
        ("dflash:speculators", "foo", "PretrainedConfig"),
        ("eagle3:speculators", "eagle_config", "PretrainedConfig"),  # SpecForge's namespace, not speculators'
        ("eagle3:speculators", "transformer_layer_config.is_causal", "LlamaConfig"),
        ("eagle3:specforge", "is_neox_style", "LlamaConfig"),
        ("dspark:deepspec", "foo", "Qwen3Config"),
        ("dspark:specforge", "input_embedding_scale", "Qwen3Config"),  # z-lab's, not SpecForge DSpark's
        ("mtp:native", "text_config.foo", "Qwen3_5TextConfig"),
        ("mtp:native", "foo", "Qwen3_5Config"),
        ("mtp:native-qwen3-next", "foo", "Qwen3NextConfig"),
        ("mtp:speculators", "transformer_layer_config.logit_scale", "Qwen3_5TextConfig"),
    ],
)
def test_an_unknown_key_of_a_decoder_namespace_is_refused_by_name(layout, path, cls):
    message = refusal(with_field(base(layout), path, 1))
    assert message.startswith(f"c.json: field {path!r} is not a field specreplay knows (neither transformers' {cls}")
    assert message.endswith("refusing rather than scoring the drafter as something it is not"), message


@pytest.mark.parametrize(
    ("layout", "path", "value"),
    [
        ("dflash:z-lab", "torch_dtype", "bfloat16"),
        ("dflash:z-lab", "transformers_version", "4.57.0"),
        ("dflash:z-lab", "initializer_range", 0.02),
        ("dflash:z-lab", "_name_or_path", "z-lab/Qwen3-8B-DFlash"),
        ("dflash:z-lab", "use_cache", True),
        ("dflash:z-lab", "max_length", 20),
        ("dflash:z-lab", "step", 100),
        ("dflash:z-lab", "specreplay_fit", {"shards_identity": "abc"}),
        ("dflash:z-lab", "has_own_lm_head", True),
        ("dflash:z-lab", "sample_from_anchor", True),  # vLLM reads dflash_config's alone
        ("dflash:z-lab", "dflash_config.mask_token", "<|MASK|>"),
        ("dflash:z-lab", "dflash_config.shift_label", False),
        ("dflash:speculators", "speculators_config.verifier.name_or_path", "Qwen/Qwen3-8B"),
        ("dflash:speculators", "speculators_config.proposal_methods[0].verifier_accept_k", 1),
        ("dflash:speculators", "speculators_config.proposal_methods[0].accept_tolerance", 0.0),
        ("dflash:speculators", "transformer_layer_config.tie_word_embeddings", True),
        ("dflash:speculators", "auto_map", {"": "config.DFlashSpeculatorConfig"}),
        ("eagle3:speculators", "embed_requires_grad", True),
        ("eagle3:specforge", "target_model_type", "gemma3_text"),
        ("dspark:deepspec", "num_anchors", 512),
        ("dspark:specforge", "dflash_config.confidence_head_alpha", 0.0),
        ("mtp:native", "text_config.mamba_ssm_dtype", "float32"),
        ("mtp:native", "text_config.full_attention_interval", 1),
        ("mtp:native", "vision_config", {"depth": 1}),
    ],
)
def test_training_only_and_bookkeeping_keys_are_accepted_and_change_nothing(layout, path, value):
    assert same_config(parse(with_field(base(layout), path, value)), parse(base(layout)))


# --------------------------------------------------------------------------- refused values


@pytest.mark.parametrize(("layout", "path", "value", "engine", "neutral"), REFUSALS, ids=lambda v: str(v))
def test_a_field_the_replay_does_not_implement_is_refused_unless_neutral(layout, path, value, engine, neutral):
    message = refusal(with_field(base(layout), path, value))
    assert re.match(rf"c\.json: field {re.escape(repr(path))} is {re.escape(shown(value))}[:;] ", message), message
    assert engine in message, message
    if neutral is not ABSENT:
        parse(with_field(base(layout), path, neutral))


def test_swa_window_size_windows_the_sliding_layers_and_use_swa_every_layer():
    """vLLM's and llama.cpp's reading: swa_window_size before sliding_window on the sliding layers;
    use_swa over all-full layer_types windows every layer, each keeping layer_types' causality."""

    def kinds(raw):
        config = parse(raw)
        return [config.layer_mask_kind(i)[:2] for i in range(config.num_hidden_layers)]

    sliding = base("dflash:z-lab") | SLIDING  # layer 0 sliding (window 8), layer 1 full
    assert kinds(sliding) == [(True, 8), (False, None)]
    assert kinds(with_field(sliding, "dflash_config.swa_window_size", 4)) == [(True, 4), (False, None)]
    assert kinds(with_field(base("dflash:z-lab"), "dflash_config.swa_window_size", 4)) == [(False, None)] * 2
    every = with_field(
        with_field(base("dflash:z-lab"), "dflash_config.use_swa", True), "dflash_config.swa_window_size", 3
    )
    assert kinds(every) == [(False, 3)] * 2  # full layers stay bidirectional, as vLLM's _dflash_layer_causal
    assert kinds(with_field(every, "dflash_config.causal", True)) == [(True, 3)] * 2
    all_sliding = with_field(sliding | {"layer_types": ["sliding_attention"] * 2}, "dflash_config.use_swa", True)
    assert kinds(all_sliding) == [(True, 8)] * 2
    message = refusal(with_field(sliding, "dflash_config.use_swa", True))
    assert "field 'dflash_config.use_swa' is true: with layer_types mixing" in message


def test_a_lilicorr_head_switched_off_is_accepted():
    raw = with_field(base("dflash:z-lab"), "dflash_config.lilicorr_enabled", False)
    parse(with_field(raw, "dflash_config.lilicorr_num_layers", 2))
    message = refusal(with_field(base("dflash:z-lab"), "dflash_config.lilicorr_num_layers", 2))
    assert "field 'dflash_config.lilicorr_num_layers' is 2: SGLang adds its LiLiCorr" in message


def test_speculative_tokens_follow_the_block_geometry():
    # vLLM's block: N + 1 queries after the anchor's, N when every slot drafts (speculators writes so)
    raw = with_field(base("dspark:speculators"), "sample_from_anchor", False)
    parse(with_field(raw, "speculators_config.proposal_methods[0].speculative_tokens", 3))
    message = refusal(with_field(raw, "speculators_config.proposal_methods[0].speculative_tokens", 4))
    assert "vLLM serves a block of 5 queries" in message and "block_size is 4" in message


def test_a_qwen3_next_mtp_head_is_moe_unless_the_resolved_config_says_dense():
    raw = base("mtp:native-qwen3-next")
    del raw["num_experts"]  # Qwen3NextConfig's default, 512 experts, as every engine reads it
    moe = parse(raw)
    assert moe.family_options["moe"] and moe.intermediate_size == 10 * 512 + 512  # top-10 experts + shared
    assert not parse(raw | {"mlp_only_layers": [0]}).family_options["moe"]
    assert not parse(raw | {"decoder_sparse_step": 2}).family_options["moe"]
    assert not parse(base("mtp:native-qwen3-next")).family_options["moe"]  # num_experts 0


def test_a_qwen3_5_moe_mtp_head_is_always_moe():
    """vLLM builds the sparse block for the qwen3_5_moe_text kind by model_type alone; a dense
    qwen3_5 kind stays dense whatever expert fields it carries (no engine reads them there)."""
    assert parse(base("mtp:native-moe")).family_options == {
        "decoder": "qwen3_5_moe_text",
        "feed_post_norm": True,
        "moe": True,
    }
    assert parse(base("mtp:native-moe") | {"model_type": "qwen3_5_moe_text"}).family_options["moe"]
    dense = with_field(base("mtp:native"), "text_config.num_experts", 4)
    assert not parse(dense).family_options["moe"]


def test_mask_embedding_beside_the_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_checkpoint_files(str(tmp_path))[0] == [str(tmp_path / "model.safetensors")]
    (tmp_path / "mask_embedding.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"file 'mask_embedding.pt' beside the weights: vLLM, SGLang"):
        resolve_checkpoint_files(str(tmp_path))


# --------------------------------------------------------------------------- implemented fields


def test_dflash_config_causal_sets_every_layer_unless_is_causal_says():
    assert parse(base("dflash:z-lab")).is_causal is None
    causal = parse(with_field(base("dflash:z-lab"), "dflash_config.causal", True))
    assert causal.is_causal is True and all(causal.layer_is_causal(i) for i in range(causal.num_hidden_layers))
    assert parse(with_field(base("dflash2:z-lab"), "dflash_config.causal", True)).is_causal is True
    over = with_field(base("dflash:z-lab"), "dflash_config.causal", True) | {"is_causal": False}
    assert parse(over).is_causal is False  # top-level is_causal first, as vLLM and llama.cpp read it


@torch.no_grad()
def test_causal_blocks_hide_later_slots_from_earlier_ones():
    """The engines' rule for a causal block: slot i sees slots <= i only, so a change at the last
    slot leaves every earlier slot's hidden state alone; bidirectional, it reaches every slot."""
    moved = {}
    for causal in (False, True):
        config = parse(with_field(base("dflash:z-lab"), "dflash_config.causal", causal))
        drafter = _random_weights(build_drafter(config), seed=0, std=0.2)
        features = torch.randn(12, 2 * config.hidden_size)
        context = drafter.context_kv(features)
        block = torch.randn(1, config.block_size, config.hidden_size)
        changed = block.clone()
        changed[:, -1] += 1.0
        anchors = torch.tensor([8])
        delta = (drafter(block, anchors, context) - drafter(changed, anchors, context)).abs().amax(-1)[0]
        moved[causal] = delta[:-1]
    assert (moved[False] > 1e-4).all() and (moved[True] == 0).all()
    mask = block_masks(torch.tensor([3]), 4, 8, True, None).block_visible
    assert torch.equal(mask, torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize(
    ("layout", "path"),
    [
        ("dflash:speculators", "transformer_layer_config.is_causal"),
        ("dflash2:speculators", "transformer_layer_config.is_causal"),
        ("dspark:speculators", "transformer_layer_config.is_causal"),
        ("dspark:specforge", "is_causal"),
        ("dspark:deepspec", "is_causal"),
    ],
)
def test_is_causal_of_every_block_layout_sets_every_layer(layout, path):
    for value in (True, False):
        config = parse(with_field(base(layout), path, value))
        assert config.is_causal is value and [config.layer_is_causal(i) for i in range(2)] == [value, value]


@torch.no_grad()
def test_attention_value_scale_scales_every_attention_output():
    """vLLM and SGLang multiply every value (context and block) by it: with no o_proj bias each
    layer's attention output is that multiple of the unscaled one (llama.cpp's rule then agrees)."""
    plain = parse(base("dflash:z-lab"))
    scaled = parse(with_field(base("dflash:z-lab"), "dflash_config.attention_value_scale", 2.5))
    assert (plain.attention_value_scale, scaled.attention_value_scale) == (1.0, 2.5)
    one = _random_weights(build_drafter(plain), seed=0, std=0.2)
    other = build_drafter(scaled)
    other.load_state_dict(one.state_dict())
    features = torch.randn(10, 2 * plain.hidden_size)
    (k1, v1), (k2, v2) = one.context_kv(features)[0], other.context_kv(features)[0]
    assert torch.equal(k1, k2) and torch.allclose(v2, 2.5 * v1)
    x = torch.randn(1, 4, plain.hidden_size)
    cos, sin = one.rope(x, torch.arange(10, 14)[None])
    mask = block_masks(torch.tensor([10]), 4, 10, False, None)
    out1 = one.layers[0].self_attn(x, cos, sin, k1, v1, mask)
    out2 = other.layers[0].self_attn(x, cos, sin, k2, v2, mask)
    torch.testing.assert_close(out2, 2.5 * out1)


def test_dflash_config_num_target_layers_sets_the_default_feature_layers():
    raw = base("dflash:z-lab")
    del raw["dflash_config"]["target_layer_ids"], raw["num_target_layers"]
    config = parse(with_field(raw, "dflash_config.num_target_layers", 12))
    assert (
        config.num_target_layers == 12
        and config.target_layer_ids == parse(raw | {"num_target_layers": 12}).target_layer_ids
    )


@pytest.mark.parametrize("layout", ["dspark:specforge", "dspark:deepspec"])
def test_sample_from_anchor_false_is_the_fill_in_block_every_engine_serves(layout):
    every_slot = parse(base(layout))
    fill_in = parse(with_field(base(layout), "sample_from_anchor", False))
    assert (every_slot.drafts_from_anchor, every_slot.max_drafts) == (True, 4)
    assert (fill_in.drafts_from_anchor, fill_in.first_draft_slot, fill_in.max_drafts) == (False, 1, 3)
    assert parse(with_field(base(layout), "sample_from_anchor", True)).drafts_from_anchor is True


# --------------------------------------------------------------------------- through the CLI


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_qwen3_dir):
    tmp = tmp_path_factory.mktemp("config_fields")
    shards = tiny_shards(tmp, tiny_qwen3_dir, [{"id": "q0", "prompt": "What is 1 + 1?"}], max_new_tokens=6)
    return {"tmp": tmp, "shards": shards, "ckpt": fitted_drafters(shards, tmp / "runs", steps=1)[-1]}


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda c: c["dflash_config"].update(foo=1), "field 'dflash_config.foo' is not a field specreplay knows"),
        (lambda c: c.update(rope_scaling_typo=1), "field 'rope_scaling_typo' is not a field specreplay knows"),
        (lambda c: c.update(partial_rotary_factor=0.5), "field 'partial_rotary_factor' is 0.5: vLLM, SGLang"),
        (lambda c: c["dflash_config"].update(use_swa=True), "field 'dflash_config.use_swa' is true: without"),
        (None, "file 'mask_embedding.pt' beside the weights"),
    ],
    ids=["namespace key", "decoder key", "partial rotary", "use_swa", "mask_embedding.pt"],
)
def test_score_refuses_in_one_error_line_and_writes_nothing(world, tmp_path, change, said):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(world["ckpt"], ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    if change is None:
        (ckpt / "mask_embedding.pt").write_bytes(b"")
    else:
        change(config)
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["score", "--ckpt", str(ckpt), "--shards", world["shards"], "--out", str(out)])
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert len(errors) == 1 and str(ckpt) in errors[0] and said in errors[0], result.output
    assert not os.path.exists(out)


@pytest.mark.parametrize("model_type", ["deepseek_v4", "deepseek_v41"])
def test_deepseeks_config_naming_dspark_is_the_dspark_stages_not_the_mtp_head(model_type):
    """DeepSeek's config.json keeps the target's model_type beside `DeepseekV4DSparkModel`: the architecture,
    a drafter layout's, wins over the MTP head's model_type; without it the model_type says the MTP head."""
    assert parse({**base("dspark:deepseek-v4"), "model_type": model_type}).family == "dspark"
    assert (parse(base("mtp:deepseek-v4")).family, parse(base("mtp:deepseek-v4")).layout) == ("mtp", "deepseek-v4")
