"""Work kept at a stop: a real `specreplay extract` process stopped by Ctrl-C (SIGINT) or a
scheduler's SIGTERM after it has captured some samples puts every captured sample on disk before
it exits, however short the chunk they fill (the writer buffers a chunk's worth before writing),
says exactly how many it kept, and a rerun of the same command generates only the others."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import zlib

import pytest

from pipeline.shards import ShardSet, finished_shard_entries
from tests.helpers.models import build_tiny_qwen3
from tests.helpers.processes import REPO, stopped_after_two_samples
from tests.helpers.prompts import write_prompts

pytestmark = pytest.mark.slow

PROMPTS = 16
MAX_NEW = 32
KEPT = re.compile(r"; (\d+) of (\d+) samples kept in ")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[str, str]:
    tmp = tmp_path_factory.mktemp("interrupt")
    records = [{"id": f"p{i:02d}", "prompt": f"Count from {i} to {i + 20}, one number a line."} for i in range(PROMPTS)]
    return build_tiny_qwen3(tmp / "target"), write_prompts(tmp / "prompts.jsonl", records)


def extract(target, out) -> list[str]:
    model, prompts = target
    return [sys.executable, "-m", "specreplay", "extract", "--model", model, "--prompts", prompts, "--out", str(out)] + [
        "--max-new-tokens", str(MAX_NEW), "--batch-size", "1", "--layer-ids", "1,3", "--dtype", "fp32",
    ]  # fmt: skip


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_a_stop_keeps_every_captured_sample_says_how_many_and_the_rerun_goes_on(target, tmp_path, signum, code):
    out = tmp_path / "shards"
    returncode, stderr = stopped_after_two_samples(extract(target, out), signum)
    assert returncode == code, stderr
    said = KEPT.search(stderr)
    assert said and int(said.group(2)) == PROMPTS, stderr
    assert "Traceback" not in stderr
    entries = finished_shard_entries(str(out))  # each sidecar's checksum verified on the way
    kept = [sample_id for entry in entries for sample_id in entry["sample_ids"]]
    assert len(kept) == int(said.group(1)) >= 2, (kept, stderr)
    for entry in entries:  # the shard files are whole: their bytes are the checksummed ones
        data = (out / entry["file"]).read_bytes()
        assert (len(data), zlib.crc32(data)) == (entry["bytes"], entry["crc32"])
    rerun = subprocess.run(extract(target, out), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    first = re.search(r"extract: \d+/(\d+) tok", rerun.stderr)
    assert first and int(first.group(1)) == (PROMPTS - len(kept)) * MAX_NEW, rerun.stderr  # only the others
    ids = [s.sample_id for s in ShardSet(str(out)).samples(tensors=[])]
    assert sorted(ids) == sorted(f"p{i:02d}" for i in range(PROMPTS))  # every sample once
