"""`specreplay diagnose` finds the convention a drafter was trained under.

Drafters are fitted with the public reference model under a wrong convention (inputs built in
tests/helpers/convention_fits.py from transformers' hidden states, never with specreplay's switches),
on a target and data where that convention matters. Each test first shows the gap with the
test's own evaluation (streak under the training convention vs under the reference), then runs
the CLI on shards extracted with --neighbour-layers and checks the ranking, the interval and
the verdict. A drafter fitted under the reference convention must be called consistent.
"""

from __future__ import annotations

import html
import json
import os

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from scoring import results
from scoring.diagnose.variants import CONFIGURED, VARIANTS
from scoring.diagnose.view import acceptance_by_position
from scoring.methods.chain import CHAIN
from specreplay.cli import main
from tests.helpers import convention_fits as cf
from tests.helpers.prompts import write_prompts

HELD_OUT = 48  # samples diagnosed (every one: --limit covers them all)
GAP = 0.5  # streak (of at most BLOCK - 1 = 3) lost under the reference convention, at least


def build_world(tmp, recipe: cf.Recipe) -> dict:
    """A recipe's target, training and held-out sequences with their hidden states, and the
    held-out set extracted through the CLI with --neighbour-layers."""
    table = cf.order2_table() if recipe.name == "order2" else None
    if recipe.name == "order2":
        model_dir = cf.build_lookahead_target(tmp / "target", table)
    else:
        model_dir = cf.build_layered_target(tmp / "target")
    train, held = cf.sequences(recipe, 100, 512, table), cf.sequences(recipe, 200, HELD_OUT, table)
    assert cf.stop_free(train) and cf.stop_free(held)
    target, train_states = cf.target_and_states(model_dir, train)
    _, held_states = cf.target_and_states(model_dir, held)
    prompts = write_prompts(tmp / "held.jsonl", cf.prompt_records(held, recipe.prompt_len))
    shards = str(tmp / "shards")
    layers = ",".join(map(str, recipe.layer_ids))
    args = ["extract", "--model", model_dir, "--prompts", prompts, "--out", shards, "--layer-ids", layers]
    run = CliRunner().invoke(main, [*args, "--neighbour-layers", "--top-k", "4", "--dtype", "fp32", "--quiet"])
    assert run.exit_code == 0, run.output
    return {
        "recipe": recipe,
        "tmp": tmp,
        "model_dir": model_dir,
        "target": target,
        "train": (train, train_states),
        "held": (held, held_states),
        "shards": shards,
    }


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """recipe name -> its world, built on first use and shared by the module's tests."""
    built: dict[str, dict] = {}

    def world(name: str) -> dict:
        if name not in built:
            built[name] = build_world(tmp_path_factory.mktemp(name), cf.RECIPES[name])
        return built[name]

    return world


@pytest.fixture(scope="module")
def layered(worlds):
    return worlds("periodic")


def fitted(world, convention: str) -> tuple[str, float, float]:
    """Fit under `convention`, save in z-lab format; (checkpoint dir, held-out streak under the
    training convention, under the reference)."""
    recipe, target = world["recipe"], world["target"]
    tokens, states = world["train"]
    drafter = cf.fit(recipe, convention, states, tokens, target)
    path = world["tmp"] / "runs" / convention
    drafter.save_pretrained(str(path))
    held, held_states = world["held"]
    own = cf.streak(recipe, drafter, convention, held_states, held, target)
    reference = cf.streak(recipe, drafter, "reference", held_states, held, target)
    return str(path), own, reference


def diagnose(layered, ckpt: str, *extra: str):
    out = str(layered["tmp"] / "diagnose")
    args = ["diagnose", "--ckpt", ckpt, "--shards", layered["shards"], "--out", out, "--limit", str(HELD_OUT)]
    run = CliRunner().invoke(main, [*args, "--no-progress", "--force", *extra])
    assert run.exit_code == 0, run.output
    directory = os.path.join(out, results.result_dir_name(ckpt))
    rows = pq.read_table(os.path.join(directory, results.FILES["diagnose"])).to_pylist()
    with open(os.path.join(directory, results.FILES["diagnose_run"])) as f:
        return run.output, rows, json.load(f)


def tau_rows(rows: list[dict]) -> dict[str, dict]:
    return {r["variant"]: r for r in rows if r["metric"] == "tau"}


@pytest.mark.parametrize("convention", ["positions+1", "layers-1", "context+1", "causal-block"])
def test_diagnose_names_the_convention_a_drafter_was_trained_under(worlds, convention):
    world = worlds(cf.RECIPE_OF[convention])
    ckpt, own, reference = fitted(world, convention)
    assert own - reference >= GAP, f"the test target does not make {convention} matter: {own:.2f} vs {reference:.2f}"

    output, rows, record = diagnose(world, ckpt)
    tau = tau_rows(rows)
    conventions = [v for v in tau if v != CONFIGURED and VARIANTS[v].convention and tau[v]["delta"] is not None]
    best = max(conventions, key=lambda v: tau[v]["delta"])
    # a z-lab checkpoint's ids one lower are its ids read in the other (before-layer) convention
    expected = "layers-convention" if convention == "layers-1" else convention
    assert best == expected, {v: round(tau[v]["delta"], 3) for v in conventions}
    assert tau[best]["ci_low"] > 0
    assert tau[best]["samples"] == HELD_OUT
    assert record["verdict"][0].startswith(f"tau {tau[CONFIGURED]['value']:.2f} as configured")
    assert VARIANTS[expected].finding in record["verdict"][0]
    assert record["verdict"][0] in output.replace("\n         ", " ")  # the console says it, first


def test_drafter_trained_under_the_reference_is_called_consistent(layered):
    ckpt, own, reference = fitted(layered, "reference")
    assert own == reference and own > 1.5  # a good drafter, nothing to find

    output, rows, record = diagnose(layered, ckpt)
    tau = tau_rows(rows)
    assert all(tau[v]["ci_low"] is None or tau[v]["ci_low"] <= 0 for v in tau if VARIANTS[v].convention)
    assert max(tau, key=lambda v: tau[v]["value"] or 0) == CONFIGURED
    assert record["verdict"][0].startswith("the configuration is consistent")
    by_position = [r for r in rows if r["metric"] == "accept_by_position"]
    assert [r["position"] for r in by_position] == list(range(1, layered["recipe"].block))
    assert f"1: {by_position[0]['value']:.2f}" in record["verdict"][0]  # where acceptance dies
    assert "verdict: the configuration is consistent" in output


def test_diagnose_output_schema_and_no_silent_overwrite(layered):
    ckpt = fitted(layered, "positions+1")[0]
    _, rows, _ = diagnose(layered, ckpt, "--variants", "positions+1,context-1")
    directory = os.path.join(str(layered["tmp"] / "diagnose"), results.result_dir_name(ckpt))
    table = pq.read_table(os.path.join(directory, results.FILES["diagnose"]))
    assert table.schema.equals(results.diagnose_schema())
    assert sorted({r["variant"] for r in rows}) == sorted([CONFIGURED, "positions+1", "context-1"])
    before = os.path.getmtime(os.path.join(directory, results.FILES["diagnose_run"]))
    args = ["diagnose", "--ckpt", ckpt, "--shards", layered["shards"], "--out", str(layered["tmp"] / "diagnose")]
    again = CliRunner().invoke(main, [*args, "--no-progress"])
    assert again.exit_code == 2 and "--force" in again.output and "Traceback" not in again.output
    assert os.path.getmtime(os.path.join(directory, results.FILES["diagnose_run"])) == before


def test_missing_neighbour_layers_say_which_extract_to_run(layered, tmp_path):
    """Shards without the neighbouring layers: layers-1 asked for is an error naming the extract
    command, which run as printed makes shards on which layers-1 is measured; by default the
    variant is listed as not measured, with the same command."""
    held, _ = layered["held"]
    prompts = write_prompts(tmp_path / "few.jsonl", cf.prompt_records(held[:3], layered["recipe"].prompt_len))
    shards = str(tmp_path / "plain")
    extract = ["extract", "--model", layered["model_dir"], "--prompts", prompts, "--out", shards]
    assert CliRunner().invoke(main, [*extract, "--layer-ids", "1,3", "--top-k", "4", "--quiet"]).exit_code == 0
    ckpt = fitted(layered, "layers-1")[0]
    base = ["diagnose", "--ckpt", ckpt, "--out", str(tmp_path / "d"), "--no-progress", "--force"]
    asked = CliRunner().invoke(main, [*base, "--shards", shards, "--variants", "layers-1"])
    assert asked.exit_code == 2, asked.output
    assert "layers [0, 2] not in the shards" in asked.output and "Traceback" not in asked.output
    command = asked.output.split("`")[1].split()  # <program> extract --neighbour-layers ...
    args = command[command.index("extract") :]
    assert args[1] == "--neighbour-layers" and f"{shards}-neighbours" in args
    everything = CliRunner().invoke(main, [*base, "--shards", shards])
    assert everything.exit_code == 0, everything.output
    # by default layers-convention (for a z-lab checkpoint the same replay as layers-1) says it
    assert (
        f"not measured: layers-convention: layers [0, 2] not in the shards; store them with `{' '.join(command)}`"
        in everything.output
    )
    assert "the same replay as layers-convention" in everything.output
    assert CliRunner().invoke(main, [*args, "--quiet"]).exit_code == 0  # as printed
    now = CliRunner().invoke(main, [*base, "--shards", f"{shards}-neighbours", "--variants", "layers-1"])
    assert now.exit_code == 0, now.output
    assert "layers-1*" in now.output


def assert_as_configured_equals_score(rows: list[dict], results_dir: str, sampled: bool) -> None:
    """diagnose's as-configured numbers are score's, on the same samples: pooled chain tau,
    the all-anchor streak and acceptance by block position."""
    summary = pq.read_table(os.path.join(results_dir, results.FILES["summary"])).to_pylist()
    chain = next(r for r in summary if r["dataset"] == results.ALL_DATASETS and r["method"] == CHAIN)
    mine = {r["metric"]: r["value"] for r in rows if r["variant"] == CONFIGURED and r["position"] is None}
    assert mine["tau"] == pytest.approx(chain["tau"], abs=1e-9)
    streak = chain["anchor_expected_accepted_len_mean" if sampled else "anchor_accepted_len_mean"]
    assert mine["streak"] == pytest.approx(streak, abs=1e-6)
    positions = acceptance_by_position(rows)  # null (never reached) read as NaN
    assert positions == pytest.approx(chain["accept_rate_by_position"], abs=1e-9, nan_ok=True)


def test_report_shows_the_diagnosis_and_it_agrees_with_score(layered, tmp_path):
    """A Diagnose section (verdict first, the variant table) in the report, with score results
    or from diagnoses alone; as-configured equals what `score` reports on the same samples."""
    from scoring.report.page import write_report

    ckpt = fitted(layered, "positions+1")[0]
    _, rows, record = diagnose(layered, ckpt)
    score = CliRunner().invoke(
        main, ["score", "--ckpt", ckpt, "--shards", layered["shards"], "--out", str(tmp_path / "results"), "--quiet"]
    )
    assert score.exit_code == 0, score.output
    assert_as_configured_equals_score(rows, str(tmp_path / "results" / results.result_dir_name(ckpt)), sampled=False)
    for inputs in ([str(tmp_path / "results"), str(layered["tmp"] / "diagnose")], [str(layered["tmp"] / "diagnose")]):
        page = open(write_report(inputs, str(tmp_path / "report.html")).path, encoding="utf-8").read()
        section = page[page.index('<h2 id="diagnose">') :]
        assert html.escape(record["verdict"][0]) in section
        assert "positions+1*" in section  # the significant variant marked, as on the console
        assert ("<h2>Summary</h2>" in page) == (len(inputs) == 2)


def test_sampled_shards_use_expected_tau(tmp_path, tiny_qwen3_dir):
    """On shards sampled at T > 0 the numbers are expectations under rejection sampling, equal to
    score's, and the console says "expected tau"."""
    from scoring.fit import save_drafter
    from tests.helpers.drafters import random_drafter

    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"Count to {i}."} for i in range(3)])
    shards = str(tmp_path / "sampled")
    extract = ["extract", "--model", tiny_qwen3_dir, "--prompts", prompts, "--out", shards, "--layer-ids", "1,3"]
    sampling = ["--temperature", "0.8", "--num-samples", "3", "--max-new-tokens", "12", "--top-k", "8"]
    assert CliRunner().invoke(main, [*extract, *sampling, "--dtype", "fp32", "--quiet"]).exit_code == 0
    ckpt = save_drafter(random_drafter(seed=4), str(tmp_path / "runs" / "random"))
    out = str(tmp_path / "d")
    run = CliRunner().invoke(main, ["diagnose", "--ckpt", ckpt, "--shards", shards, "--out", out, "--no-progress"])
    assert run.exit_code == 0, run.output
    assert "expected tau" in run.output.splitlines()[1]
    rows = pq.read_table(os.path.join(out, results.result_dir_name(ckpt), results.FILES["diagnose"])).to_pylist()
    score = ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(tmp_path / "r"), "--quiet", "--sample", "8"]
    assert CliRunner().invoke(main, score).exit_code == 0
    assert_as_configured_equals_score(rows, str(tmp_path / "r" / results.result_dir_name(ckpt)), sampled=True)


def test_neighbour_layers_extract(layered):
    """--neighbour-layers stores ids - 1 and + 1 after the requested ones, records which were
    requested (fit's default), and stores each layer's real hidden states."""
    from pipeline.common.layer_ids import requested_layer_ids
    from pipeline.shards import ShardSet

    shardset = ShardSet(layered["shards"])
    settings = shardset.settings
    assert settings["layer_ids"] == [1, 3, 0, 2, 4]
    assert requested_layer_ids(settings) == [1, 3]
    held, held_states = layered["held"]
    sample = next(iter(shardset.samples(tensors=["features"])))
    row = int(sample.sample_id.removeprefix("p"))
    stored = sample.features.view(sample.features.shape[0], 5, -1)
    for column, layer in enumerate(settings["layer_ids"]):
        expected = held_states[layer + 1][row, : stored.shape[0]]
        assert (stored[:, column] - expected).abs().max() <= 1e-3 * expected.abs().max()
    inspect = CliRunner().invoke(main, ["inspect", layered["shards"]])
    assert "[1, 3, 0, 2, 4] (with neighbours, for diagnose)" in inspect.output
