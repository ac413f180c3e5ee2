"""A user's mistake is said before the heavy imports (torch, the replay) and model loads: the
error returns in a second, not after the stage has loaded (checked by what the process imported,
not by timing it: these machines are noisy)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.processes import REPO

PROBE = """
import json, sys
from specreplay.cli import main
try:
    main({args!r}, standalone_mode=True)
except SystemExit as stop:
    code = stop.code
print(json.dumps({{"code": code, "torch": "torch" in sys.modules}}))
"""


def run_cli(args: list[str]) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True, cwd=REPO)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize(
    "args, said",
    [
        (["score", "--ckpt", "ngram", "--shards", "{tmp}", "--out", "{tmp}/r"], "--ckpt ngram: no such file"),
        (
            ["score", "--ckpt", "ngram:vllm", "--shards", "{tmp}/none", "--out", "{tmp}/r"],
            "no such directory: {tmp}/none",
        ),
        (["score", "--ckpt", "{tmp}/step_*", "--shards", "{tmp}", "--out", "{tmp}/r"], "matches nothing"),
    ],
)
def test_a_missing_checkpoint_or_shards_is_said_before_torch_loads(tmp_path, args, said):
    result, stderr = run_cli([a.format(tmp=tmp_path) for a in args])
    assert result["code"] != 0 and said.format(tmp=tmp_path) in stderr, stderr
    assert not result["torch"], "torch was imported before the arguments were checked"
