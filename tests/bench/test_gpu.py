"""`make bench-gpu` (bench/gpu.py) runs without a GPU: its CPU mode at the tiny size, in a fresh
process as `make bench-gpu` starts it, writes a results JSON with every part's rows, and the
rows only a GPU gives say so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.processes import REPO

pytestmark = pytest.mark.slow  # ~30 s of CPU in a subprocess: `make test` and CI run it, test-fast skips it


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench-gpu")
    # CUDA hidden, so the CPU path runs wherever the suite does; one thread, as the suite's other
    # subprocesses, so parallel test workers do not fight over the cores.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--size", "tiny", "--budgets", "16,1024", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = out.glob("bench-gpu-*.json")
    assert not list(out.glob("work-gpu-*")), "the work directory is removed"
    return json.loads(path.read_text()), done.stdout


def test_every_part_writes_its_figures(results):
    figures = results[0]["figures"]
    assert set(figures) == {"parity", "throughput", "ddtree", "extract", "speed"}
    assert not results[0]["failed"]
    parity = figures["parity"]
    for dtype in ("fp32", "bf16"):
        assert parity[dtype]["samples"] == 2 and parity[dtype]["draft_positions"] > 0
    # the eager flex path and dense attention give the same walks in fp32
    assert parity["fp32"]["walks_identical"] == parity["fp32"]["samples"]
    throughput = figures["throughput"]
    assert throughput["anchors"] > 0 and throughput["anchors_per_s"] > 0
    assert throughput["peak"]["peak_gflop_s"] > 0 and 0 < throughput["fraction_of_peak"]
    assert {g["name"] for g in throughput["peak"]["gemms"]} >= {"lm_head", "q_proj", "down_proj", "fc"}
    assert figures["ddtree"]["replay_ratio"] > 0 and figures["ddtree"]["budgets"] == [16, 1024]
    assert figures["extract"]["overhead_ratio"] > 0


def test_speed_part_serves_transformers_loops(results):
    """transformers' prompt lookup and assisted generation served the stored responses (fp32, greedy),
    each proposer accepted tokens, and each K has a measured and a predicted speedup."""
    speed = results[0]["figures"]["speed"]
    assert set(speed["table"]) == {"prompt lookup", "assisted"}
    for proposer, ks in speed["table"].items():
        assert sorted(ks) == ["1", "2"]  # JSON keys
        for k, row in ks.items():
            assert row["differing"] == 0, (proposer, k)
            assert row["tau"] > 1.0 and row["measured_speedup"] > 0 and row["predicted_speedup"] > 0
            walk, served = speed["steps"][f"{proposer} K={k}"].values()
            assert len(walk) == len(served) == 2 and min(served) > 0
    assert speed["table"]["assisted"]["1"]["tau"] > 1.5  # the fitted draft model accepts most drafts


def test_rows_printed_and_cuda_rows_skipped(results):
    data, stdout = results
    names = [row["figure"].strip() for row in data["rows"]]
    for expected in (
        "fp32: walks identical, every method",
        "bf16: max |tau flex - tau dense| over methods",
        "useful FLOP/s / peak (replay; whole call)",
        "chain + DDTree / chain only (replay; whole call)",
        "extract overhead",
    ):
        assert expected in names
    assert any(name.startswith("assisted K=2: tau") for name in names)
    skipped = {row["figure"]: row["value"] for row in data["rows"] if row["value"] == "skipped: no CUDA"}
    assert set(skipped) == set(data["skipped"]) and len(skipped) >= 4
    assert "skipped: no CUDA" in stdout and "extract overhead" in stdout
