"""What `specreplay diagnose` says on a real tiny extract and a drafter fitted to it: advice the
user can follow when the samples are few, acceptance by block position only where enough
anchors reached it (the report's MIN_ANCHORS), and a `next:` command naming directories that
exist, which runs as printed."""

from __future__ import annotations

import os
import re

import polars as pl
import pytest
from click.testing import CliRunner

from scoring import results
from scoring.compare.bootstrap import FEW_SAMPLES
from scoring.diagnose.view import anchors_by_position, format_positions_row, load
from scoring.results import MIN_ANCHORS
from specreplay.cli import main
from tests.helpers.drafters import fitted_drafters
from tests.helpers.shards import tiny_shards

PROMPTS = 6  # samples the shards hold: fewer than FEW_SAMPLES
BLOCK = 8  # 7 block positions: the far ones are reached by few anchors


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_qwen3_dir):
    tmp = tmp_path_factory.mktemp("diagnose_console")
    shards = tiny_shards(
        tmp, tiny_qwen3_dir, [{"id": f"q{i}", "prompt": f"Spell {i} twice."} for i in range(PROMPTS)], 24
    )
    [ckpt] = fitted_drafters(shards, tmp / "runs", block_size=BLOCK, layer_ids=[1, 3], steps=60, anchors_per_step=32)
    return tmp, shards, ckpt


def diagnose(shards: str, ckpt: str, out: str, *extra: str):
    args = ["diagnose", "--ckpt", ckpt, "--shards", shards, "--out", out, "--variants", "context+1"]
    run = CliRunner().invoke(main, [*args, "--no-progress", "--force", *extra])
    assert run.exit_code == 0, run.output
    return run.output, *load(os.path.join(out, results.result_dir_name(ckpt)))


def test_few_samples_advice_is_one_the_user_can_follow(world, tmp_path):
    tmp, shards, ckpt = world
    assert PROMPTS < FEW_SAMPLES
    output, _, record = diagnose(shards, ckpt, str(tmp_path / "d"), "--limit", "40")
    assert record["samples"] == PROMPTS
    few = next(line for line in record["verdict"] if "samples are rough" in line)
    assert few.startswith(f"{PROMPTS} samples, all the shards hold (prompt set ") and "--limit 40 asked for more" in few
    assert "extract more prompts (a larger --prompts set, or a larger extract --limit)" in few
    assert "pass --limit" not in output  # more of it cannot help: the shards hold no more
    _, _, fewer = diagnose(shards, ckpt, str(tmp_path / "d"), "--limit", "3")
    assert f"3 samples: intervals from fewer than {FEW_SAMPLES} samples are rough; pass --limit {PROMPTS} " in (
        "\n".join(fewer["verdict"])
    )


def reached_in_score_results(results_dir: str) -> list[int]:
    """Anchors reaching each block position in score's anchors.parquet, counted row by row: the
    target known there and the draft's first k - 1 tokens accepted."""
    counts = [0] * (BLOCK - 1)
    for row in pl.read_parquet(os.path.join(results_dir, "anchors.parquet")).iter_rows(named=True):
        for k in range(1, BLOCK):
            counts[k - 1] += int(len(row["draft_match"]) >= k and row["accepted_len"] >= k - 1)
    return counts


def test_positions_few_anchors_reached_are_left_out_not_shown_as_readings(world, tmp_path):
    tmp, shards, ckpt = world
    output, rows, record = diagnose(shards, ckpt, str(tmp_path / "d"), "--limit", str(PROMPTS))
    score = CliRunner().invoke(
        main, ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(tmp_path / "r"), "--quiet"]
    )
    assert score.exit_code == 0, score.output
    anchors = anchors_by_position(rows)
    assert anchors == reached_in_score_results(str(tmp_path / "r" / results.result_dir_name(ckpt)))  # the same samples
    thin = [k for k, n in enumerate(anchors, start=1) if n < MIN_ANCHORS]
    assert thin and len(thin) < len(anchors), anchors  # the test needs both kinds
    text = format_positions_row(rows)
    shown = [int(k) for k in re.findall(r"(?:^|, )(\d+): ", text)]
    assert shown == [k for k in range(1, BLOCK) if k not in thin], text
    assert f"positions {thin[0]}-{thin[-1]} left out (fewer than {MIN_ANCHORS} anchors reached each)" in text
    if record["verdict"][0].startswith("the configuration is consistent"):  # the console shows them there
        assert text in record["verdict"][0] and text in output.replace("\n         ", " ")


def next_command(output: str) -> list[str]:
    """The `next:` line's command, from the subcommand on, without its comment."""
    words = next(line for line in output.splitlines() if line.startswith("next: ")).split("#")[0].split()
    return words[words.index("report") :]


def test_next_names_directories_that_exist_and_runs_as_printed(world, tmp_path, monkeypatch):
    tmp, shards, ckpt = world
    monkeypatch.chdir(tmp_path)  # relative --out, as a user types it
    alone = next_command(diagnose(shards, ckpt, "diag")[0])
    assert alone == ["report", "diag", "--out", os.path.join("diag", "report.html")]
    assert CliRunner().invoke(main, alone).exit_code == 0 and os.path.exists(alone[-1])

    score = CliRunner().invoke(main, ["score", "--ckpt", ckpt, "--shards", shards, "--out", "results", "--quiet"])
    assert score.exit_code == 0, score.output
    beside = next_command(diagnose(shards, ckpt, "diag")[0])
    assert beside == ["report", "results", "diag", "--out", "report.html"]  # the scores found beside --out
    assert all(os.path.isdir(path) for path in beside[1:3])
    run = CliRunner().invoke(main, beside)
    assert run.exit_code == 0, run.output
    page = open("report.html", encoding="utf-8").read()
    assert '<h2 id="diagnose">' in page and "<h2>Summary</h2>" in page
