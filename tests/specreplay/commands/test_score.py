"""`specreplay score` as a user runs it: several checkpoints, skip/--force, output schema,
console table, clear errors, and torchrun data parallelism giving identical results."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import polars as pl
import pytest
from click.testing import CliRunner

from pipeline.extract.run import ExtractConfig, run_extract
from scoring.results import MIN_ANCHORS
from scoring.score.console import FLOOR_STREAK
from specreplay.cli import main
from tests.helpers.drafters import fitted_drafters
from tests.helpers.processes import REPO
from tests.helpers.shards import tiny_shards


@pytest.fixture(scope="module")
def scored_setup(tmp_path_factory, tiny_qwen3_dir):
    tmp = tmp_path_factory.mktemp("score_cli")
    # two datasets, the first three prompts one, the last two the other: --limit takes the
    # first N, --sample spreads N over both
    records = [
        {"id": f"q{i}", "prompt": f"Question {i}: what is {i} + {i}?", "dataset": "alpha" if i < 3 else "beta"}
        for i in range(5)
    ]
    shards = tiny_shards(tmp, tiny_qwen3_dir, records, max_new_tokens=24)
    written = fitted_drafters(
        shards, tmp / "runs", block_size=4, layer_ids=[1, 3], steps=60, save_every=30, anchors_per_step=32
    )
    return tmp, shards, written


def _score(args):
    return CliRunner().invoke(main, ["score", *args], catch_exceptions=False)


def test_several_checkpoints_by_glob_then_skip_and_force(scored_setup):
    tmp, shards, written = scored_setup
    out = str(tmp / "results")
    result = _score(
        ["--ckpt", str(tmp / "runs" / "step_*"), "--shards", shards, "--out", out, "--ddtree-budgets", "4,8"]
    )
    assert result.exit_code == 0, result.output
    assert "tau" in result.output and "ddtree-8" in result.output
    dirs = sorted(os.listdir(out))
    assert dirs == ["runs_step_30", "runs_step_60"]
    summary = pl.read_parquet(os.path.join(out, "*", "summary.parquet"))
    assert {"checkpoint", "checkpoint_step", "dataset", "method", "tau"} <= set(summary.columns)
    assert sorted(summary["checkpoint_step"].unique().to_list()) == [30, 60]
    assert set(summary["method"]) == {"chain", "ddtree-4", "ddtree-8"}
    walk = pl.read_parquet(os.path.join(out, "runs_step_60", "walk.parquet"))
    assert {"sample_id", "method", "step", "anchor", "produced"} <= set(walk.columns)
    # tau in the summary is the mean over samples of the per-sample mean `produced`
    chain = walk.filter(pl.col("method") == "chain")
    per_sample = chain.group_by("sample_id").agg(pl.col("produced").mean())["produced"].mean()
    s = summary.filter(
        (pl.col("checkpoint_step") == 60) & (pl.col("method") == "chain") & (pl.col("dataset") == "(all)")
    )
    assert s["tau"][0] == pytest.approx(per_sample)
    # the console table prints the summary's numbers: step_60's "(all)" row, cell by cell
    block = result.output[
        result.output.index("runs/step_30 (DFlash, z-lab layout): tau chain") :
    ]  # step_60's table follows
    lines = [line.strip() for line in block.splitlines()]
    header = next(line.split() for line in lines if line.startswith("dataset"))
    cells = dict(zip(header, next(line.split() for line in lines if line.startswith("(all)"))))
    for method in ("chain", "ddtree-4", "ddtree-8"):
        tau = summary.filter(
            (pl.col("checkpoint_step") == 60) & (pl.col("method") == method) & (pl.col("dataset") == "(all)")
        )["tau"][0]
        assert cells[method] == f"{tau:.3f}", (method, cells)

    again = _score(
        ["--ckpt", str(tmp / "runs" / "step_*"), "--shards", shards, "--out", out, "--ddtree-budgets", "4,8"]
    )
    assert again.output.count("already scored with these settings") == 2, again.output
    forced = _score(["--ckpt", written[0], "--shards", shards, "--out", out, "--ddtree-budgets", "4,8", "--force"])
    assert "already scored" not in forced.output and "tau" in forced.output
    assert sorted(os.listdir(out)) == ["runs_step_30", "runs_step_60"]  # one layout, whatever the count


def _pooled(out_dir: str) -> dict:
    summary = pl.read_parquet(os.path.join(out_dir, "summary.parquet"))
    return {r["method"]: r for r in summary.filter(pl.col("dataset") == "(all)").iter_rows(named=True)}


def _digest(directory: str) -> dict:
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def test_other_settings_are_refused_unless_forced(scored_setup, tmp_path):
    """A full run is never silently replaced by a partial one: the refusal lists what differs
    and leaves the files as they were; --force replaces them (atomically: no staging left)."""
    tmp, shards, written = scored_setup
    out = str(tmp_path / "results")
    assert _score(["--ckpt", written[-1], "--shards", shards, "--out", out, "--ddtree-budgets", "4,8"]).exit_code == 0
    target = os.path.join(out, "runs_step_60")
    before = _digest(target)
    refused = _score(["--ckpt", written[-1], "--shards", shards, "--out", out, "--limit", "2", "--ddtree-budgets", "4"])
    assert refused.exit_code == 1, refused.output
    assert f"{target} holds results scored with other settings" in refused.output
    assert "ddtree budgets: [4, 8] -> [4]" in refused.output and "samples: 5 -> 2" in refused.output
    assert "--force" in refused.output and "Traceback" not in refused.output
    assert _digest(target) == before
    forced = _score(
        ["--ckpt", written[-1], "--shards", shards, "--out", out, "--limit", "2", "--ddtree-budgets", "4", "--force"]
    )
    assert forced.exit_code == 0, forced.output
    assert set(_pooled(target)) == {"chain", "ddtree-4"} and _pooled(target)["chain"]["samples"] == 2
    assert os.listdir(out) == ["runs_step_60"]  # no .partial / .replaced directory left behind


def test_sample_selection_limit_stratified_and_datasets(scored_setup, tmp_path):
    tmp, shards, written = scored_setup

    def chosen(*options):
        out = str(tmp_path / "-".join(options))
        result = _score(["--ckpt", written[-1], "--shards", shards, "--out", out, "--ddtree-budgets", "", *options])
        assert result.exit_code == 0, result.output
        samples = pl.read_parquet(os.path.join(out, "runs_step_60", "samples.parquet"))
        record = json.load(open(os.path.join(out, "runs_step_60", "run.json")))
        return sorted(samples["sample_id"].to_list()), record["selection"]

    assert chosen("--limit", "2")[0] == ["q0", "q1"]  # the first two: both dataset alpha
    ids, selection = chosen("--sample", "2", "--seed", "3")
    assert len([i for i in ids if i in ("q0", "q1", "q2")]) == 1 and len(ids) == 2  # one of each dataset
    assert selection["sample"] == 2 and selection["seed"] == 3 and selection["samples"] == 2
    assert chosen("--datasets", "beta")[0] == ["q3", "q4"]
    # the draw depends on the seed and only on it
    draws = {tuple(chosen("--sample", "3", "--seed", str(seed))[0]) for seed in range(6)}
    assert len(draws) > 1
    bad = _score(["--ckpt", written[-1], "--shards", shards, "--out", str(tmp_path / "x"), "--datasets", "gamma"])
    assert bad.exit_code == 1 and "no dataset named gamma" in bad.output and "alpha, beta" in bad.output


def test_headline_quiet_no_progress_and_json(scored_setup, tmp_path):
    """The headline states the pooled chain tau, exactness, the best DDTree budget and the
    streak from summary.parquet; --quiet prints only that; --json gives the same numbers."""
    tmp, shards, written = scored_setup
    out = str(tmp_path / "results")
    quiet = _score(["--ckpt", written[-1], "--shards", shards, "--out", out, "--ddtree-budgets", "4,8", "--quiet"])
    assert quiet.exit_code == 0, quiet.output
    pooled = _pooled(os.path.join(out, "runs_step_60"))
    best = max(("ddtree-4", "ddtree-8"), key=lambda m: pooled[m]["tau"])
    expected = (
        f"runs/step_60 (DFlash, z-lab layout): tau chain {pooled['chain']['tau']:.3f} (all, 5 samples, exact 5/5, "
        f"K {len(pooled['chain']['accept_rate_by_position'])}), "
        f"best {best} {pooled[best]['tau']:.3f}, streak {pooled['chain']['anchor_accepted_len_mean']:.3f}"
    )
    lines = quiet.output.splitlines()
    assert lines[0] == expected, quiet.output
    assert "dataset" not in quiet.output and "%|" not in quiet.output  # no table, no bar
    assert lines[1].startswith("next: ") and f"report {out}" in lines[1]
    as_json = _score(["--ckpt", written[-1], "--shards", shards, "--out", out, "--ddtree-budgets", "4,8", "--json"])
    items = json.loads(as_json.output)
    assert [i["status"] for i in items] == ["skipped"] and items[0]["headline"] == expected
    assert items[0]["tau"]["ddtree-8"] == pooled["ddtree-8"]["tau"] and items[0]["exact_samples"] == 5
    table = _score(
        ["--ckpt", written[-1], "--shards", shards, "--out", out, "--ddtree-budgets", "4,8", "--no-progress", "--force"]
    )
    assert "streak = mean draft tokens accepted" in table.output and "%|" not in table.output


def test_incompatible_checkpoint_is_a_clear_error(scored_setup, tmp_path):
    tmp, shards, written = scored_setup
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(written[0]):
        data = open(os.path.join(written[0], name), "rb").read()
        open(bad / name, "wb").write(data)
    config = json.load(open(bad / "config.json"))
    config["dflash_config"]["target_layer_ids"] = [1, 4]
    json.dump(config, open(bad / "config.json", "w"))
    result = CliRunner().invoke(main, ["score", "--ckpt", str(bad), "--shards", shards, "--out", str(tmp_path / "r")])
    # a failed checkpoint (exit 1, one line, no traceback) naming both layer lists, the missing layer and the fix
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"error: {bad}: ") and "Traceback" not in result.output, result.output
    for needle in ("target_layer_ids [1, 4]", "store layer ids [1, 3]", "(missing [4])", "--layer-ids 1,3,4"):
        assert needle in result.output, (needle, result.output)
    assert not (tmp_path / "r").exists()


def test_swapped_ckpt_and_shards_are_said_as_such(scored_setup, tmp_path):
    tmp, shards, written = scored_setup
    results = tmp_path / "r"
    assert _score(["--ckpt", str(written[0]), "--shards", shards, "--out", str(results)]).exit_code == 0
    [scored] = [str(p) for p in results.iterdir()]
    cases = [
        (
            ["--ckpt", shards, "--shards", str(written[0])],
            f"--ckpt {shards} holds an extract (manifest.json)",
            "swapped",
        ),
        (["--ckpt", str(written[0]), "--shards", str(written[0])], f"--shards {written[0]} holds a drafter", "swapped"),
        (["--ckpt", scored, "--shards", shards], f"--ckpt {scored} holds score results (run.json)", "it scored"),
        (["--ckpt", str(written[0]), "--shards", scored], f"--shards {scored} holds score results", "scored on"),
    ]
    for args, *needles in cases:
        result = CliRunner().invoke(main, ["score", *args, "--out", str(tmp_path / "x")])
        assert result.exit_code == 2 and result.output.count("error: ") == 1, result.output
        assert all(n in result.output for n in needles) and "Traceback" not in result.output, (needles, result.output)
        assert not (tmp_path / "x").exists()
    diagnosed = CliRunner().invoke(main, ["diagnose", "--ckpt", shards, "--shards", str(written[0])])
    assert diagnosed.exit_code == 2 and "swapped --ckpt and --shards?" in diagnosed.output, diagnosed.output


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one_process(scored_setup, tmp_path):
    tmp, shards, written = scored_setup
    one = str(tmp_path / "one")
    two = str(tmp_path / "two")
    assert _score(["--ckpt", written[-1], "--shards", shards, "--out", one, "--quiet"]).exit_code == 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    # --standalone: a free rendezvous port, so two test runs on one machine do not collide
    run = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "specreplay",
            "score",
            "--ckpt",
            written[-1],
            "--shards",
            shards,
            "--out",
            two,
            "--quiet",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for name in ("walk", "samples", "anchors", "summary"):
        a = pl.read_parquet(os.path.join(one, "runs_step_60", f"{name}.parquet"))
        b = pl.read_parquet(os.path.join(two, "runs_step_60", f"{name}.parquet"))
        assert a.equals(b, null_equal=True), name
    assert json.load(open(os.path.join(two, "runs_step_60", "run.json")))["world_size"] == 2


def test_fp8_shards_score_close_to_lossless(scored_setup, tiny_qwen3_dir):
    """The same prompts extracted with fp8 features score without complaint; run.json and the
    console say the features are lossy; every anchor's expected acceptance and the chain tau
    stay within what fp8 rounding moves them on this data."""
    tmp, shards, written = scored_setup
    fp8 = str(tmp / "shards-fp8")
    run_extract(
        ExtractConfig(
            model=tiny_qwen3_dir,
            prompts=str(tmp / "prompts.jsonl"),
            out=fp8,
            max_new_tokens=24,
            layer_ids=[1, 3],
            top_k=8,
            dtype="fp32",
            feature_dtype="fp8",
        )
    )
    runs, anchors, tau = {}, {}, {}
    for name, source in (("lossless", shards), ("fp8", fp8)):
        result = _score(
            ["--ckpt", written[-1], "--shards", source, "--out", str(tmp / f"results-{name}"), "--ddtree-budgets", "4"]
        )
        out = str(tmp / f"results-{name}" / "runs_step_60")
        assert result.exit_code == 0, result.output
        runs[name] = (json.load(open(os.path.join(out, "run.json"))), result.output)
        anchors[name] = pl.read_parquet(os.path.join(out, "anchors.parquet")).sort("sample_id", "anchor")
        summary = pl.read_parquet(os.path.join(out, "summary.parquet"))
        tau[name] = summary.filter((pl.col("method") == "chain") & (pl.col("dataset") == "(all)"))["tau"][0]
    assert runs["fp8"][0]["shards"]["feature_dtype"] == "float8_e4m3fn" and "lossy fp8" in runs["fp8"][1]
    assert runs["lossless"][0]["shards"]["feature_dtype"] == "float32" and "lossy" not in runs["lossless"][1]
    assert anchors["fp8"].select("sample_id", "anchor").equals(anchors["lossless"].select("sample_id", "anchor"))
    # Measured on this fixture: fp8 moves an anchor's expected accepted length by at most 1.1e-4,
    # while the 30 fitting steps between step_30 and step_60 move it by up to 0.13; 1e-3 keeps
    # 10x headroom over fp8 rounding and fails on any real change of the drafter's output.
    moved = (anchors["fp8"]["expected_accepted_len"] - anchors["lossless"]["expected_accepted_len"]).abs().max()
    assert moved <= 1e-3, moved
    # Measured difference 0 (no walk step changes). One step changing by one token moves tau by
    # 1 / (5 samples x that sample's steps), 0.029 in the shortest sample (7 steps): allow one.
    assert tau["fp8"] == pytest.approx(tau["lossless"], abs=0.03)


def test_anchor_drafts_on_request(scored_setup, tmp_path):
    """walk.parquet always keeps the walk's draft blocks; anchors.parquet keeps every anchor's
    only with --anchor-drafts, and the two agree where the walk stepped; asking for them is a
    different setting, not 'already scored'."""
    tmp, shards, written = scored_setup
    out = str(tmp_path / "results")
    assert _score(["--ckpt", written[-1], "--shards", shards, "--out", out, "--ddtree-budgets", "4"]).exit_code == 0
    target = os.path.join(out, "runs_step_60")
    assert "draft_tokens" not in pl.read_parquet(os.path.join(target, "anchors.parquet")).columns
    again = _score(
        ["--ckpt", written[-1], "--shards", shards, "--out", out, "--ddtree-budgets", "4", "--anchor-drafts"]
    )
    assert again.exit_code == 1 and "anchor drafts: False -> True" in again.output
    forced = _score(
        ["--ckpt", written[-1], "--shards", shards, "--out", out, "--ddtree-budgets", "4", "--anchor-drafts", "--force"]
    )
    assert forced.exit_code == 0, forced.output
    anchors = pl.read_parquet(os.path.join(target, "anchors.parquet"))
    walk = pl.read_parquet(os.path.join(target, "walk.parquet"))
    assert (
        walk.filter(pl.col("method") == "ddtree-4")["draft_tokens"].null_count()
        == walk.filter(pl.col("method") == "ddtree-4").height
    )
    joined = walk.filter(pl.col("method") == "chain").join(
        anchors.select("sample_id", "anchor", "draft_match", anchor_drafts="draft_tokens"),
        on=["sample_id", "anchor"],
    )
    assert joined.height == walk.filter(pl.col("method") == "chain").height > 0
    assert joined["draft_tokens"].to_list() == joined["anchor_drafts"].to_list()
    for row in joined.iter_rows(named=True):
        # the accepted length is the run of leading matches of the stored draft block
        matches = row["draft_match"] + [False]
        assert row["accepted_len"] == matches.index(False)
        assert len(row["draft_tokens"]) >= len(row["draft_match"])


def test_truncated_checkpoint_fails_alone(scored_setup, tmp_path):
    """A checkpoint still being written (model.safetensors cut short) is one error line; the
    checkpoints around it are scored; the command ends with what failed and exits 1."""
    tmp, shards, written = scored_setup
    runs = tmp_path / "run"
    for source, name in zip(written, ("step_1", "step_3")):
        (runs / name).mkdir(parents=True)
        for file in os.listdir(source):
            (runs / name / file).write_bytes(open(os.path.join(source, file), "rb").read())
    (runs / "step_2").mkdir()
    (runs / "step_2" / "config.json").write_bytes((runs / "step_1" / "config.json").read_bytes())
    weights = (runs / "step_1" / "model.safetensors").read_bytes()
    (runs / "step_2" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    out = tmp_path / "results"
    result = _score(["--ckpt", str(runs / "step_*"), "--shards", shards, "--out", str(out), "--ddtree-budgets", "4"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(runs / "step_2") in errors[0] and "model.safetensors" in errors[0], errors
    assert sorted(os.listdir(out)) == ["run_step_1", "run_step_3"]
    assert "1 of 3 checkpoints failed (errors above):" in result.output
    assert result.output.index("run/step_3 (DFlash, z-lab layout): tau chain") > result.output.index(errors[0])


def _ckpt_lines(output: str) -> list[str]:
    """Each scored checkpoint's first table line: '  5 samples, 120 anchors, fp32 on cpu, <time> -> <dir>'."""
    return [line for line in output.splitlines() if " anchors, " in line and " -> " in line]


def test_a_shared_pass_is_timed_once_as_shared(scored_setup, tmp_path):
    """Two checkpoints replayed in one pass over the shards: the pass's time is said once, as
    shared, not as each checkpoint's own; one checkpoint alone keeps its run.json wall time."""
    tmp, shards, written = scored_setup
    out = str(tmp_path / "results")
    both = _score(["--ckpt", str(tmp / "runs" / "step_*"), "--shards", shards, "--out", out])  # one pass: both fit
    assert both.exit_code == 0, both.output
    first, second = _ckpt_lines(both.output)
    assert re.search(r", \d+\.\ds for a pass shared by 2 checkpoints \(the shards decoded once for all\) -> ", first)
    assert ", in the shared pass above -> " in second and not re.search(r"\d\.\ds", second)
    for name in ("runs_step_30", "runs_step_60"):  # no checkpoint is given the pass's time as its own
        wall = json.load(open(os.path.join(out, name, "run.json")))["wall_time_s"]
        assert f"{wall:.1f}s -> " not in both.output
    assert (
        len(re.findall(r"^time: target head prepared once in \d+\.\ds; pass over the shards", both.output, re.M)) == 1
    )
    alone = _score(["--ckpt", written[0], "--shards", shards, "--out", str(tmp_path / "alone")])
    wall = json.load(open(os.path.join(tmp_path / "alone", "runs_step_30", "run.json")))["wall_time_s"]
    assert _ckpt_lines(alone.output)[0].endswith(f", {wall:.1f}s -> {tmp_path / 'alone' / 'runs_step_30'}")
    assert "time: " not in alone.output


def test_acceptance_at_the_floor_is_warned_with_the_commands_to_look(scored_setup, tmp_path, monkeypatch):
    """A random drafter accepts ~nothing: score says so, what usually causes it, and how to look
    into it (diagnose on the very checkpoint and shards, which runs as printed); a fitted
    drafter gets no such warning."""
    from scoring.fit import save_drafter
    from tests.helpers.drafters import random_drafter

    tmp, shards, written = scored_setup
    random_ckpt = save_drafter(random_drafter(seed=3), str(tmp_path / "runs" / "random"))
    result = _score(["--ckpt", random_ckpt, "--shards", shards, "--out", str(tmp_path / "r"), "--no-progress"])
    assert result.exit_code == 0, result.output
    pooled = _pooled(str(tmp_path / "r" / "runs_random"))["chain"]
    assert pooled["anchor_accepted_len_mean"] < FLOOR_STREAK, pooled  # what makes it the floor
    assert "warning: acceptance is at the floor" in result.output, result.output
    for cause in ("another target or tokenizer", "layer-numbering convention", "randomly initialised"):
        assert cause in result.output
    assert f"inspect {shards}" in result.output
    command = next(line for line in result.output.splitlines() if " diagnose --ckpt " in line).split("#")[0].split()
    assert command[command.index("diagnose") :] == ["diagnose", "--ckpt", random_ckpt, "--shards", shards]
    monkeypatch.chdir(tmp_path)  # diagnose's default --out is relative
    ran = CliRunner().invoke(main, [*command[command.index("diagnose") :], "--no-progress", "--variants", "context+1"])
    assert ran.exit_code == 0 and "verdict:" in ran.output, ran.output
    as_json = json.loads(
        _score(["--ckpt", random_ckpt, "--shards", shards, "--out", str(tmp_path / "r"), "--json"]).output
    )
    assert as_json[0]["acceptance_at_floor"] is True

    fitted = _score(["--ckpt", written[-1], "--shards", shards, "--out", str(tmp_path / "f"), "--no-progress"])
    assert fitted.exit_code == 0 and "at the floor" not in fitted.output, fitted.output
    assert _pooled(str(tmp_path / "f" / "runs_step_60"))["chain"]["anchor_accepted_len_mean"] > 3 * FLOOR_STREAK
    as_json = json.loads(
        _score(["--ckpt", written[-1], "--shards", shards, "--out", str(tmp_path / "f"), "--json"]).output
    )
    assert as_json[0]["acceptance_at_floor"] is False


def test_thinly_reached_positions_are_left_out_of_the_console(scored_setup, tmp_path):
    """summary.parquet's reached_by_position counts the anchors behind each acceptance rate (as
    anchors.parquet says, counted here independently); the console shows a rate only where at
    least MIN_ANCHORS anchors reached the position, and says which it left out."""
    tmp, shards, written = scored_setup
    out = str(tmp_path / "results")
    result = _score(["--ckpt", written[-1], "--shards", shards, "--out", out, "--ddtree-budgets", "4", "--no-progress"])
    assert result.exit_code == 0, result.output
    directory = os.path.join(out, "runs_step_60")
    reached = _pooled(directory)["chain"]["reached_by_position"]
    anchors = pl.read_parquet(os.path.join(directory, "anchors.parquet"))
    for k in range(1, len(reached) + 1):
        by_hand = anchors.filter((pl.col("accepted_len") >= k - 1) & (pl.col("draft_match").list.len() >= k)).height
        assert reached[k - 1] == by_hand, k
    line = result.output.split("given the position was reached):\n")[1].splitlines()[0]
    thin = [k for k, n in enumerate(reached, start=1) if n < MIN_ANCHORS]
    assert thin, f"the fixture has no thinly reached position: {reached}"
    for k in range(1, len(reached) + 1):
        assert (f"{k}: " in line.split(";")[0]) == (k not in thin), line
    assert f"left out (fewer than {MIN_ANCHORS} anchors reached" in line


def test_walk_rules_change_the_tail_block_and_the_counts_not_the_path_formula(scored_setup, tmp_path):
    """--walk-rule llama.cpp runs the full block at every anchor (dflash_generate shortens it to the
    budget), cuts the drafts to remaining - 2 and decodes the budget's last token plainly (0
    drafted); another rule is another setting, refused without --force; --steps under it runs a
    shorter block everywhere (docs/walk-rules.md)."""
    tmp, shards, written = scored_setup
    out = str(tmp_path / "results")
    base = ["--ckpt", written[-1], "--shards", shards, "--out", out, "--ddtree-budgets", ""]
    assert _score(base).exit_code == 0
    target = os.path.join(out, "runs_step_60")
    reference = pl.read_parquet(os.path.join(target, "anchors.parquet"))
    refused = _score([*base, "--walk-rule", "llama.cpp"])
    assert refused.exit_code == 1 and "walk rule: 'dflash' -> 'llama.cpp'" in refused.output, refused.output
    assert _score([*base, "--walk-rule", "llama.cpp", "--force"]).exit_code == 0
    anchors = pl.read_parquet(os.path.join(target, "anchors.parquet"))
    assert reference["block_len"].min() < 4 and set(anchors["block_len"].to_list()) == {4}
    assert json.load(open(os.path.join(target, "run.json")))["walk_rule"] == "llama.cpp"
    walk = pl.read_parquet(os.path.join(target, "walk.parquet")).filter(pl.col("method") == "chain")
    prompt_len = walk.filter(pl.col("step") == 0).select("sample_id", prompt_len="anchor")
    remaining = walk.join(prompt_len, on="sample_id").select(pl.col("prompt_len") + 24 - pl.col("anchor")).to_series()
    assert (walk["drafted"] == (remaining - 2).clip(0, 3)).all()
    assert (walk["counted_accepted"] <= walk["drafted"]).all() and walk["counted_exact"].all()
    assert _score([*base, "--walk-rule", "llama.cpp", "--steps", "2", "--force"]).exit_code == 0
    shorter = pl.read_parquet(os.path.join(target, "anchors.parquet"))
    assert set(shorter["block_len"].to_list()) == {3}


def test_sample_over_the_shards_says_it_scores_them_all(scored_setup, tmp_path):
    _, shards, written = scored_setup
    args = ["--ckpt", written[-1], "--shards", shards, "--out", str(tmp_path / "r"), "--ddtree-budgets", ""]
    with pytest.warns(UserWarning, match=r"^--sample 64: the shards hold 5 samples; scoring all 5$"):
        assert _score([*args, "--sample", "64", "--quiet"]).exit_code == 0


def test_an_unquoted_glob_is_told_to_be_quoted(tmp_path):
    steps = [tmp_path / "runs" / f"step_{i}" for i in (1, 2)]  # what the shell made of runs/step_*
    result = CliRunner().invoke(main, ["score", "--ckpt", *map(str, steps), "--shards", "s", "--out", "o"])
    assert result.exit_code == 2, result.output
    assert f"unexpected extra argument ({steps[1]})" in result.output, result.output
    assert "quote it (--ckpt 'runs/*/step_*')" in result.output, result.output
