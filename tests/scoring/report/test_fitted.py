"""A drafter `specreplay fit` trained on the very samples it is scored on is named as such in the
report: fit records the shards' identity in the checkpoint's config.json (the checkpoint still
loads and scores), and the report marks that checkpoint's figures, but not the same checkpoint
scored on other shards, nor a checkpoint whose config records nothing."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner

from pipeline.shards import ShardSet
from scoring.report.data import fitted_on_scored_shards
from scoring.score.record import shards_identity
from specreplay.cli import main
from tests.helpers.shards import tiny_shards


def _run(*args) -> str:
    result = CliRunner().invoke(main, [*map(str, args)])
    assert result.exit_code == 0, result.output
    return result.output


def _records(prefix: str) -> list[dict]:
    return [{"id": f"{prefix}{i}", "prompt": f"Count from {i} to {i + 9}, please."} for i in range(3)]


def test_fit_records_its_shards_and_the_report_says_so(tmp_path, tiny_qwen3_dir):
    own = tiny_shards(tmp_path / "own", tiny_qwen3_dir, _records("a"), max_new_tokens=12)
    other = tiny_shards(tmp_path / "other", tiny_qwen3_dir, _records("b"), max_new_tokens=12)
    _run("fit", "--shards", own, "--out", tmp_path / "runs", "--steps", 3, "--block-size", 4, "--quiet")
    ckpt = tmp_path / "runs" / "step_3"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["specreplay_fit"] == {"shards_identity": shards_identity(ShardSet(own).manifest)}
    for name, shards in (("own", own), ("other", other)):  # the extra field loads: both score
        _run("score", "--ckpt", ckpt, "--shards", shards, "--out", tmp_path / "results" / name, "--quiet")
    report = tmp_path / "report.html"
    _run("report", tmp_path / "results", "--out", report)
    text = report.read_text(encoding="utf-8")
    summary = text.split("<table class=summary>", 1)[1].split("</table>", 1)[0].replace("<wbr>", "")
    labels = re.findall(r"<tr[^>]*><td>[^<]*</td><td>([^<&]*?)(?:&nbsp;)?(<sup class=\"fitted\"|</td>)", summary)
    assert {label for label, _ in labels} == {"runs/step_3 [own/runs_step_3]", "runs/step_3 [other/runs_step_3]"}
    assert {label for label, end in labels if end != "</td>"} == {
        "runs/step_3 [own/runs_step_3]"
    }  # on its own shards only
    note = text.split('<p class="note fitted">', 1)[1].split("</p>", 1)[0].replace("<wbr>", "")
    assert "runs/step_3 [own/runs_step_3] was fitted by" in note and "very samples it is scored on" in note
    assert "other/" not in note and "not what a real drafter reaches" in note


def test_only_a_matching_fit_record_marks_a_checkpoint():
    run = {"checkpoint": {"config": {"specreplay_fit": {"shards_identity": "abc"}}}, "shards": {"identity": "abc"}}
    assert fitted_on_scored_shards(run)
    assert not fitted_on_scored_shards({**run, "shards": {"identity": "def"}})  # fitted on other shards
    assert not fitted_on_scored_shards({**run, "checkpoint": {"config": {"block_size": 8}}})  # no fit record
    assert not fitted_on_scored_shards({**run, "shards": {}})  # an older run.json without the identity
    assert not fitted_on_scored_shards({})
