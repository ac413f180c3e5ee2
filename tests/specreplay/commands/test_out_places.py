"""Output given a directory of the wrong kind (issue: user experience, item 3): `score --out` a
results directory or an extract, `extract --out` results (`report --out` a directory: tests/scoring/report/test_page.py). Each is one
`error:` line naming the path and what it holds, exit 2, and nothing is written."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from specreplay.cli import main


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def refused(args: list[str], root: Path, *words: str) -> str:
    before = listing(root)
    result = CliRunner().invoke(main, args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for word in words:
        assert word in lines[0], lines[0]
    assert listing(root) == before  # nothing written
    return lines[0]


def layout(tmp_path: Path) -> dict[str, Path]:
    """An extract (manifest.json), a checkpoint (config.json), a results root with one results directory."""
    paths = {"shards": tmp_path / "shards", "ckpt": tmp_path / "runs" / "step_300", "root": tmp_path / "results"}
    paths["results"] = paths["root"] / "runs_step_300"
    for path in paths.values():
        path.mkdir(parents=True, exist_ok=True)
    (paths["shards"] / "manifest.json").write_text("{}")
    (paths["ckpt"] / "config.json").write_text("{}")
    (paths["results"] / "run.json").write_text(json.dumps({}))
    (paths["results"] / "summary.parquet").write_bytes(b"")
    return paths


def score_args(paths, out) -> list[str]:
    return ["score", "--ckpt", str(paths["ckpt"]), "--shards", str(paths["shards"]), "--out", str(out)]


def test_score_out_a_results_directory_is_refused_naming_its_parent(tmp_path):
    paths = layout(tmp_path)
    line = refused(score_args(paths, paths["results"]), tmp_path, str(paths["results"]), "results directory")
    assert f"--out {paths['root']}" in line and "run.json" in line


def test_score_out_an_extract_is_refused(tmp_path):
    paths = layout(tmp_path)
    refused(score_args(paths, paths["shards"]), tmp_path, str(paths["shards"]), "manifest.json")


def test_extract_out_results_is_refused(tmp_path):
    paths = layout(tmp_path)
    for out, words in ((paths["root"], ("runs_step_300",)), (paths["results"], ("results directory", "run.json"))):
        args = ["extract", "--model", str(tmp_path / "no-model"), "--prompts", "default", "--out", str(out)]
        refused(args, tmp_path, f"--out {out}", *words)
