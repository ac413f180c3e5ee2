"""Permissions and paths (issue: reliability under faults, item 7), through the CLI: a read-only
output directory, an output path that is a file, a prompts path that is a directory, a URI
missing a slash. Each is one `error:` line naming the option, the path and the fix, exit 2, no
traceback, and nothing is written anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.filesystems import tmpfs
from tests.helpers.processes import REPO
from tests.helpers.prompts import write_prompts


def cli(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "specreplay", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture
def prompts(tmp_path) -> str:
    return write_prompts(tmp_path / "p.jsonl", [{"id": "q0", "prompt": "Hello?"}])


def test_read_only_output_directory(tiny_qwen3_dir, prompts, tmp_path):
    out = tmp_path / "ro"
    with tmpfs(str(out), 1 << 20, readonly=True) as mounted:
        if not mounted:
            out.mkdir(exist_ok=True)
            out.chmod(0o555)
            if os.access(out, os.W_OK):
                pytest.skip("cannot make a read-only directory here (root without mount)")
        result = cli("extract", "--model", tiny_qwen3_dir, "--prompts", prompts, "--out", str(out / "shards"))
        assert_one_line_error(result, "--out", str(out), "not writable")
        assert listing(out) == []


def test_output_path_that_is_a_file(tiny_qwen3_dir, prompts, tmp_path):
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    before = listing(tmp_path)
    for args in (
        ("extract", "--model", tiny_qwen3_dir, "--prompts", prompts, "--out", str(target)),
        ("score", "--ckpt", str(tmp_path), "--shards", str(tmp_path), "--out", str(target)),
    ):
        assert_one_line_error(cli(*args), "--out", str(target), "is a file")
    assert listing(tmp_path) == before and target.read_text() == "keep me"


def test_prompts_path_that_is_a_directory(tiny_qwen3_dir, tmp_path):
    (tmp_path / "prompts").mkdir()
    out = tmp_path / "out"
    result = cli("extract", "--model", tiny_qwen3_dir, "--prompts", str(tmp_path / "prompts"), "--out", str(out))
    assert_one_line_error(result, "--prompts", "is a directory", "JSONL file", "gsm8k")
    assert not out.exists()


def test_uri_missing_a_slash(tiny_qwen3_dir, prompts, tmp_path):
    for args in (
        ("extract", "--model", tiny_qwen3_dir, "--prompts", prompts, "--out", "s3:/bucket/shards"),
        ("score", "--ckpt", str(tmp_path), "--shards", "gs:/bucket/shards", "--out", str(tmp_path / "r")),
        ("inspect", "s3:/bucket/shards"),
    ):
        result = cli(*args, cwd=tmp_path)
        assert_one_line_error(result, "missing a slash", "://bucket/shards")
    assert listing(tmp_path) == ["p.jsonl"]  # no local directory named "s3:" or "gs:"
