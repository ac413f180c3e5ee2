"""What the fault tests (tests/faults/) and tools/fault_sweeps.py share: the CLI in a fresh
process (optionally under a file-size limit), extracts compared sample by sample, results
directories compared by their content."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch

from pipeline.shards import ShardSet
from tests.helpers.processes import REPO

PAGE = 4096  # a tmpfs holds whole pages per file
TABLES = ("anchors.parquet", "walk.parquet", "samples.parquet", "summary.parquet")


def cli(*args: str, limit: int | None = None) -> subprocess.CompletedProcess:
    """`python -m specreplay ARGS` from the repository root; `limit` sets RLIMIT_FSIZE (bytes)."""

    def file_size_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run(
        [sys.executable, "-m", "specreplay", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=file_size_limit if limit else None,
    )


def samples_of(out) -> dict:
    return {s.sample_id: s for s in ShardSet(str(out)).samples()}


def assert_same_extract(got, want) -> None:
    got, want = samples_of(got), samples_of(want)
    assert sorted(got) == sorted(want)
    for sample_id, sample in want.items():
        assert torch.equal(got[sample_id].input_ids, sample.input_ids)
        for name, tensor in sample.tensors.items():
            assert torch.equal(got[sample_id].tensors[name], tensor), (sample_id, name)


def content(directory: Path) -> str:
    """A results directory's tables and the settings in its run.json (not times or paths), as
    text (repr makes NaN equal NaN)."""
    tables = {name: pq.read_table(directory / name).to_pylist() for name in TABLES}
    record = json.loads((directory / "run.json").read_text())
    settings = {k: record[k] for k in ("ddtree_budgets", "anchor_set", "selection", "dtype", "anchors")}
    return repr((tables, settings, record["checkpoint"]["content_hash"], record["shards"]["identity"]))


def visible_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if not p.name.startswith(".")) if out.exists() else []
