"""Disk full (issue: reliability under faults, item 1), for real: `extract` and `score` writing
onto a small tmpfs (mounted by the test when it runs as root) run out of space in the target
head, in a shard, or at the manifest (extract) and in a results file (score). Each time: one
`error:` line naming the file and the space, no partial file taken as complete, and after the
filesystem is grown the same command finishes with exactly the uninterrupted run's output.
Without mount rights the file-size limit (RLIMIT_FSIZE, EFBIG) stands in for the full disk.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.helpers.drafters import random_drafter
from tests.helpers.faults import PAGE, assert_same_extract, cli
from tests.helpers.filesystems import can_mount, resize, tmpfs
from tests.helpers.prompts import write_prompts


@pytest.fixture(scope="module")
def extract_args(tiny_qwen3_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diskfull")
    prompts = write_prompts(tmp / "p.jsonl", [{"id": f"q{i:02d}", "prompt": f"Count to {i}."} for i in range(24)])
    args = ["--model", tiny_qwen3_dir, "--prompts", prompts, "--layer-ids", "1,3", "--max-new-tokens", "24"]
    return [*args, "--shard-bytes", "60000", "--quiet"]


@pytest.fixture(scope="module")
def reference(extract_args, tmp_path_factory):
    """An uninterrupted extract: its samples and its size on a tmpfs (whole pages per file)."""
    out = tmp_path_factory.mktemp("reference") / "out"
    assert cli("extract", *extract_args, "--out", str(out)).returncode == 0
    pages = sum(-(-p.stat().st_size // PAGE) for p in out.rglob("*") if p.is_file())
    return out, pages * PAGE


def assert_disk_full_error(result: subprocess.CompletedProcess, out: Path) -> str:
    """One error line naming a file under `out`; returns the file's name."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "free some space and run the same command again" in lines[0].lower()
    assert "no space left" in lines[0] or "file-size limit" in lines[0]
    match = re.search(re.escape(str(out)) + r"[^\s;]*", lines[0])
    assert match, lines[0]
    return os.path.basename(match.group(0))


@pytest.mark.skipif(not can_mount(), reason="mounting a tmpfs needs root")
def test_extract_fills_the_disk_then_resumes_to_the_same_output(extract_args, reference, tmp_path):
    ref_out, ref_bytes = reference
    named = []
    # where it runs out: the target head (written first), a shard, the final manifest (written last)
    for size in (200_000, 400_000, ref_bytes):
        mount = tmp_path / f"fs{size}"
        with tmpfs(str(mount), size):
            out = mount / "out"
            named.append(assert_disk_full_error(cli("extract", *extract_args, "--out", str(out)), out))
            assert not (out / "manifest.json").exists() or '"complete": false' in (out / "manifest.json").read_text()
            resize(str(mount), 4 * ref_bytes)  # free space
            again = cli("extract", *extract_args, "--out", str(out))
            assert again.returncode == 0, again.stderr
            assert_same_extract(out, ref_out)
            assert not list(out.rglob("*.tmp"))
    assert named[0] == "target_head.safetensors"
    assert named[1].endswith(".arrow.tmp")
    assert named[2] == "manifest.json"


def test_extract_hits_the_file_size_limit_then_resumes(extract_args, reference, tmp_path):
    """RLIMIT_FSIZE: a file may not grow past 50 KB (EFBIG), so the 256 KB target head cannot be written."""
    ref_out, _ = reference
    out = tmp_path / "out"
    named = assert_disk_full_error(cli("extract", *extract_args, "--out", str(out), limit=50_000), out)
    assert named == "target_head.safetensors"
    again = cli("extract", *extract_args, "--out", str(out))
    assert again.returncode == 0, again.stderr
    assert_same_extract(out, ref_out)


def results_of(directory: Path) -> str:
    """The results tables as text (repr makes NaN equal NaN)."""
    return repr({name: pq.read_table(directory / name).to_pylist() for name in ("summary.parquet", "samples.parquet")})


@pytest.mark.skipif(not can_mount(), reason="mounting a tmpfs needs root")
def test_score_fills_the_disk_then_redoes_the_checkpoint(reference, tmp_path):
    from scoring.fit import save_drafter

    ref_out, _ = reference
    ckpts = [save_drafter(random_drafter(seed=s), str(tmp_path / "runs" / f"step_{s}")) for s in (1, 2)]
    args = ["score", "--ckpt", str(tmp_path / "runs" / "step_*"), "--shards", str(ref_out), "--quiet"]
    args += ["--ddtree-budgets", "4"]
    whole = tmp_path / "whole"
    assert cli(*args, "--out", str(whole)).returncode == 0
    mount = tmp_path / "fs"
    with tmpfs(str(mount), 3 * PAGE):
        result = cli(*args, "--out", str(mount / "results"))
        assert result.returncode == 1  # each checkpoint failed on its own; the run went on
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == len(ckpts) and all("no space left on the device writing" in e for e in errors)
        assert "Traceback" not in result.stderr
        assert list(mount.rglob("*")) == []  # no half directory, no staging, no lock left
        resize(str(mount), 64 << 20)
        again = cli(*args, "--out", str(mount / "results"))
        assert again.returncode == 0, again.stderr
        for ckpt in ckpts:
            name = f"runs_{os.path.basename(ckpt)}"
            assert results_of(mount / "results" / name) == results_of(whole / name)
