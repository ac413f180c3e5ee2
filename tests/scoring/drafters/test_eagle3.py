"""proposers/eagle3/config.py and the two EAGLE-3 layouts (proposers/ (layout.py of each family, layouts.py)):
the default aux layers of both layouts name the same target layers, `extract --draft-config`
stores them in this project's numbering, what the replay does not implement is refused by name,
and a checkpoint that does not fit the shards is one `error:` line with nothing written: aux layers
not stored (the extract command that adds them), a d2t mapping outside the target's vocabulary."""

from __future__ import annotations

import json

import polars as pl
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from pipeline.common.schema import SchemaError
from pipeline.shards import ShardSet
from proposers.detect import parse_drafter_config
from proposers.layouts import feature_layers_of
from proposers.toolkit.config import DrafterConfigError
from specreplay.cli import main
from tests.helpers.dspark_online import build_target
from tests.helpers.eagle3_reference import save, speculators_eagle3, write_specforge
from tests.helpers.prompts import write_prompts

DECODER = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4}
DECODER.update(num_key_value_heads=2, head_dim=8, intermediate_size=48, vocab_size=64)


def speculators(**top) -> dict:
    return {"speculators_model_type": "eagle3", "transformer_layer_config": DECODER, "draft_vocab_size": 64, **top}


def specforge(**top) -> dict:
    return {**DECODER, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 64, **top}


@pytest.mark.parametrize("layers", [8, 28, 36, 64])
def test_both_layouts_default_to_the_same_layers(layers):
    # speculators [2, L // 2, L - 3] before layer i, SpecForge [1, L // 2 - 1, L - 4] output of layer i
    ours = [1, layers // 2 - 1, layers - 4]
    assert feature_layers_of(speculators(), "c.json", layers) == ours
    assert feature_layers_of(specforge(), "c.json", layers) == ours
    config = parse_drafter_config(speculators(), "c.json", layers)
    assert config.target_layer_ids == ours and config.stated_layer_ids == [2, layers // 2, layers - 3]
    assert parse_drafter_config(specforge(), "c.json", layers).target_layer_ids == ours


def test_stated_ids_and_the_chain_geometry():
    raw = speculators(
        eagle_aux_hidden_state_layer_ids=[1, 3, 6],  # 6 = L: the final hidden state before the norm
        draft_vocab_size=40,
        speculators_config={"proposal_methods": [{"speculative_tokens": 5}]},
    )
    config = parse_drafter_config(raw, "c.json", 6)
    assert (config.family, config.layout, config.layer_convention) == ("eagle3", "speculators", "before")
    assert config.target_layer_ids == [0, 2, 6] and config.draft_vocab_size == 40
    assert (config.block_size, config.max_drafts, config.drafts_from_anchor, config.teacher_forced_block) == (
        5,
        5,
        True,
        True,
    )
    forge = parse_drafter_config(specforge(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}), "c.json")
    assert (forge.layout, forge.target_layer_ids, forge.block_size) == ("specforge", [0, 2, 4], 3)
    assert parse_drafter_config(specforge(num_speculative_tokens=6), "c.json", 8).block_size == 6


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (speculators(transformer_layer_config={**DECODER, "model_type": "gemma3"}), "Llama or Qwen3"),
        (speculators(transformer_layer_config={**DECODER, "layer_types": ["sliding_attention"]}), "full attention"),
        (speculators(target_hidden_size=48), "target_hidden_size' is 48"),
        (speculators(draft_vocab_size=65), "larger than"),
        (specforge(num_hidden_layers=2), "one layer"),
        (specforge(norm_output=False), "norm_output' is false"),
        (specforge(eagle_config={"use_aux_hidden_state": False}), "use_aux_hidden_state"),
    ],
)
def test_what_the_replay_does_not_implement_is_refused_by_name(raw, match):
    with pytest.raises(DrafterConfigError, match=match):
        parse_drafter_config(raw, "c.json", 8)


def test_default_layers_need_the_targets_layer_count():
    with pytest.raises(SchemaError, match="is not set, so the feature layers are the layout's default"):
        parse_drafter_config(speculators(), "c.json")


def test_defaults_too_shallow_and_specforge_last_layer_are_refused():
    with pytest.raises(SchemaError, match=r"default \[2, 3, 3\] for a 6-layer target names a layer twice"):
        feature_layers_of(speculators(), "c.json", 6)
    with pytest.raises(SchemaError, match="lists 7, not a layer sglang captures for a 8-layer target"):
        feature_layers_of(specforge(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}), "c.json", 8)


# ---------------------------------------------------------------------------------------------
# extract --draft-config, and checkpoints that do not fit the shards


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target, its prompts, a random speculators EAGLE-3 drafter for it (aux ids [1, 3, 5]
    before layer i) and its SpecForge twin, shards extracted with --draft-config of each."""
    tmp = tmp_path_factory.mktemp("eagle3")
    model_dir = build_target(tmp / "target")
    prompts = write_prompts(tmp / "p.jsonl", [{"id": f"p{i}", "input_ids": [5 + i, 9, 11, 3]} for i in range(2)])
    model = speculators_eagle3(vocab=64, hidden=32, aux_ids=(1, 3, 5), steps=3, draft_vocab=torch.arange(0, 64, 2))
    ckpt = save(model, tmp / "ckpt")
    forge = write_specforge(ckpt, tmp / "ckpt-specforge", 6)
    base = ["extract", "--model", model_dir, "--prompts", prompts, "--max-new-tokens", "6", "--quiet"]
    shards = {}
    for name, path in (("speculators", ckpt), ("specforge", forge)):
        shards[name] = str(tmp / f"shards-{name}")
        result = CliRunner().invoke(main, [*base, "--draft-config", f"{path}/config.json", "--out", shards[name]])
        assert result.exit_code == 0, result.output
    partial = str(tmp / "shards-partial")
    assert CliRunner().invoke(main, [*base, "--layer-ids", "0,2", "--out", partial]).exit_code == 0
    return dict(tmp=tmp, ckpt=ckpt, forge=forge, shards=shards, partial=partial)


def _score(ckpt: str, shards: str, out):
    return CliRunner().invoke(main, ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--quiet"])


def test_extract_stores_the_aux_layers_and_both_layouts_score_alike(world):
    for name in ("speculators", "specforge"):
        assert ShardSet(world["shards"][name]).settings["layer_ids"] == [0, 2, 4], name
    tables = {}
    for name, path in (("speculators", world["ckpt"]), ("specforge", world["forge"])):
        out = world["tmp"] / f"results-{name}"
        result = _score(path, world["shards"]["speculators"], out)
        assert result.exit_code == 0, result.output
        [results] = out.iterdir()
        walk = pl.read_parquet(results / "walk.parquet")
        tables[name] = walk.select("sample_id", "step", "produced", "draft_tokens", "drafter_family", "drafter_layout")
    assert set(tables["speculators"]["drafter_family"]) == {"eagle3"}
    assert set(tables["specforge"]["drafter_layout"]) == {"specforge"}
    assert tables["speculators"].drop("drafter_layout").equals(tables["specforge"].drop("drafter_layout"))
    # walk-only replay packs the samples together: the same walks
    out = world["tmp"] / "results-walk"
    walked = CliRunner().invoke(
        main,
        ["score", "--ckpt", world["ckpt"], "--shards", world["shards"]["speculators"], "--out", str(out), "--quiet"]
        + ["--anchors", "walk"],
    )
    assert walked.exit_code == 0, walked.output
    [results] = out.iterdir()
    walk = pl.read_parquet(results / "walk.parquet").select(tables["speculators"].columns)
    assert walk.equals(tables["speculators"])


def test_steps_sets_the_chain_and_is_part_of_the_results_identity(world):
    """--steps 5 drafts 5 tokens per anchor where the checkpoint says 3: teacher-forced along the
    stored tokens, its first 3 are the 3-step chain's; run.json records it, and results of
    another step count in the same --out are refused rather than mixed."""
    shards = world["shards"]["speculators"]
    drafts = {}
    for steps in (None, 5):
        out = world["tmp"] / f"results-steps-{steps}"
        extra = ["--anchor-drafts", "--eagle-trees", ""] + ([] if steps is None else ["--steps", str(steps)])
        result = CliRunner().invoke(
            main, ["score", "--ckpt", world["ckpt"], "--shards", shards, "--out", str(out)] + extra
        )
        assert result.exit_code == 0, result.output
        [results] = out.iterdir()
        assert json.loads((results / "run.json").read_text())["chain_steps"] == (steps or 3)
        drafts[steps] = (
            pl.read_parquet(results / "anchors.parquet").sort("sample_id", "anchor")["draft_tokens"].to_list()
        )
    assert max(len(d) for d in drafts[5]) == 5 and max(len(d) for d in drafts[None]) == 3
    assert [d[:3] for d in drafts[5]] == drafts[None]
    again = ["score", "--ckpt", world["ckpt"], "--shards", shards, "--out", str(world["tmp"] / "results-steps-5")]
    refused = CliRunner().invoke(main, again + ["--anchor-drafts", "--eagle-trees", "", "--steps", "4"])
    assert refused.exit_code != 0 and "chain steps: 5 -> 4" in refused.output, refused.output


def test_diagnose_runs_the_variants_that_apply(world):
    out = world["tmp"] / "diagnose"
    args = ["diagnose", "--ckpt", world["ckpt"], "--shards", world["shards"]["speculators"], "--out", str(out)]
    asked = CliRunner().invoke(main, [*args, "--variants", "positions+1", "--no-progress", "--device", "cpu"])
    assert asked.exit_code == 2 and "positions+1: cannot be measured" in asked.output, asked.output
    assert "no block to shift" in asked.output
    result = CliRunner().invoke(main, [*args, "--limit", "2", "--no-progress", "--device", "cpu", "--force"])
    assert result.exit_code == 0, result.output
    assert "no block to shift" in result.output and "Traceback" not in result.output, result.output


def test_aux_layers_missing_from_the_shards_print_the_extract_command(world):
    out = world["tmp"] / "results-partial"
    result = _score(world["ckpt"], world["partial"], out)
    assert result.exit_code != 0
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    assert "missing [4]" in errors[0] and "eagle_aux" not in errors[0]
    assert "`specreplay extract --model " in errors[0] and "--layer-ids 0,2,4 " in errors[0], errors[0]
    assert f"--out {world['partial']}-layers" in errors[0], errors[0]
    assert "Traceback" not in result.output
    assert not out.exists() or not any(out.iterdir())


def test_a_d2t_outside_the_target_vocabulary_is_one_line_nothing_written(world, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((world["tmp"] / "ckpt" / "config.json").read_text())
    state = load_file(str(world["tmp"] / "ckpt" / "model.safetensors"))
    state["d2t"] = state["d2t"].clone()
    state["d2t"][-1] += 10  # the last draft id now names target id 72 of 64
    save_file(state, str(ckpt / "model.safetensors"))
    out = tmp_path / "results"
    result = _score(str(ckpt), world["shards"]["speculators"], out)
    assert result.exit_code != 0
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "outside the target vocabulary of 64" in errors[0], result.output
    assert not out.exists() or not any(out.iterdir())
