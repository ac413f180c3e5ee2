"""`make faults`: the longer runs behind bench/README.md's Faults table, beyond the CI tests.

    .venv/bin/python tools/fault_sweeps.py [--disk-full 8] [--score-disk-full 4] [--kills 16] [--races 4]

- disk-full: extract onto a tmpfs of N sizes spread from 64 KiB to a whole extract; each run
  must stop with one error naming a file under --out (which file is tallied), then, with the
  filesystem grown, the same command must finish with the uninterrupted extract's samples.
- score-disk-full: score two checkpoints into tmpfs of N sizes; every results directory that
  exists must equal the uninterrupted run's, and the rerun completes them all.
- kills: score of 4 checkpoints killed with -9 at N seeded random moments; after each kill every
  results directory that exists must equal the uninterrupted run's; the last run completes them.
- races: two extracts started at the same moment on one --out, N times: one runs, the other is
  refused naming it (or, started after the first finished, finds it done), and the output
  equals the uninterrupted extract.
Needs root (tmpfs mounts). Prints one line per kind: trials, held, and the tally.
"""

from __future__ import annotations

import argparse
import collections
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the product and tests.helpers
    sys.path.insert(0, str(REPO))

from tests.helpers.drafters import random_drafter  # noqa: E402
from tests.helpers.faults import PAGE, assert_same_extract, cli, content, visible_dirs  # noqa: E402
from tests.helpers.filesystems import can_mount, resize, tmpfs  # noqa: E402
from tests.helpers.models import build_tiny_qwen3  # noqa: E402
from tests.helpers.prompts import write_prompts  # noqa: E402


def prepare(work: Path) -> dict:
    from scoring.fit import save_drafter

    model = build_tiny_qwen3(work / "model")
    prompts = write_prompts(work / "p.jsonl", [{"id": f"q{i:02d}", "prompt": f"Count to {i}."} for i in range(24)])
    args = ["--model", model, "--prompts", prompts, "--layer-ids", "1,3", "--max-new-tokens", "24"]
    args += ["--shard-bytes", "60000", "--quiet"]
    reference = work / "reference"
    assert cli("extract", *args, "--out", str(reference)).returncode == 0
    size = sum(-(-p.stat().st_size // PAGE) for p in reference.rglob("*") if p.is_file()) * PAGE
    for step in range(1, 5):
        save_drafter(random_drafter(seed=step), str(work / "runs" / f"step_{step}"))
    score = ["score", "--shards", str(reference), "--ddtree-budgets", "4,8", "--quiet"]
    results = work / "results"
    assert cli(*score, "--ckpt", str(work / "runs" / "step_*"), "--out", str(results)).returncode == 0
    return {"args": args, "reference": reference, "size": size, "score": score, "results": results, "work": work}


def kind_of(line: str, out: Path) -> str:
    named = line.split(str(out), 1)[1].split(" ", 1)[0].rstrip(";.")
    for kind in ("target_head", ".arrow", "manifest.json", ".json", "tokenizer", ".lock"):
        if kind in named:
            return {"target_head": "target head", ".arrow": "shard", ".json": "sidecar"}.get(kind, kind.strip("."))
    return named


def disk_full(env: dict, trials: int) -> tuple[int, collections.Counter]:
    held, tally = 0, collections.Counter()
    for size in [
        PAGE * round((64 << 10) / PAGE + i * (env["size"] - (64 << 10)) / PAGE / trials) for i in range(trials)
    ]:
        mount = env["work"] / f"fs{size}"
        with tmpfs(str(mount), size):
            out = mount / "out"
            first = cli("extract", *env["args"], "--out", str(out))
            lines = first.stderr.strip().splitlines()
            ok = first.returncode == 2 and len(lines) == 1 and str(out) in lines[0] and "Traceback" not in first.stderr
            tally[kind_of(lines[0], out) if ok else "FAILED"] += 1
            resize(str(mount), 4 * env["size"])
            again = cli("extract", *env["args"], "--out", str(out))
            try:
                assert again.returncode == 0
                assert_same_extract(out, env["reference"])
                held += ok
            except AssertionError:
                tally["FAILED on resume"] += 1
    return held, tally


def score_disk_full(env: dict, trials: int) -> tuple[int, collections.Counter]:
    want = {p.name: content(p) for p in visible_dirs(env["results"])}
    total = sum(-(-p.stat().st_size // PAGE) for p in env["results"].rglob("*") if p.is_file()) * PAGE
    held, tally = 0, collections.Counter()
    for i in range(trials):
        size = PAGE * max(2, round((i + 1) * total / PAGE / (trials + 1)))
        mount = env["work"] / f"sfs{size}"
        with tmpfs(str(mount), size):
            out = mount / "results"
            first = cli(*env["score"], "--ckpt", str(env["work"] / "runs" / "step_*"), "--out", str(out))
            whole = all(content(d) == want[d.name] for d in visible_dirs(out))
            tally[f"{len(visible_dirs(out))} of {len(want)} complete"] += 1
            resize(str(mount), 64 << 20)
            again = cli(*env["score"], "--ckpt", str(env["work"] / "runs" / "step_*"), "--out", str(out))
            done = again.returncode == 0 and {d.name: content(d) for d in visible_dirs(out)} == want
            held += whole and done and "Traceback" not in first.stderr
    return held, tally


def kills(env: dict, trials: int) -> tuple[int, collections.Counter]:
    want = {p.name: content(p) for p in visible_dirs(env["results"])}
    command = [sys.executable, "-m", "specreplay", *env["score"], "--ckpt", str(env["work"] / "runs" / "step_*")]
    out = env["work"] / "killed"
    started = time.monotonic()
    cli(*env["score"], "--ckpt", str(env["work"] / "runs" / "step_*"), "--out", str(env["work"] / "timing"))
    duration = time.monotonic() - started
    rng, held, tally = random.Random(0), 0, collections.Counter()
    for _ in range(trials):
        process = subprocess.Popen(
            [*command, "--out", str(out)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(rng.uniform(0.2, duration))
        landed = process.poll() is None
        process.send_signal(signal.SIGKILL)
        process.wait()
        tally["killed mid-run" if landed else "finished before the kill"] += 1
        held += all(content(d) == want[d.name] for d in visible_dirs(out))
    final = cli(*env["score"], "--ckpt", str(env["work"] / "runs" / "step_*"), "--out", str(out))
    tally["final run complete and equal"] += int(
        final.returncode == 0 and {d.name: content(d) for d in visible_dirs(out)} == want
    )
    return held, tally


def races(env: dict, trials: int) -> tuple[int, collections.Counter]:
    held, tally = 0, collections.Counter()
    for i in range(trials):
        out = env["work"] / f"race{i}"
        command = [sys.executable, "-m", "specreplay", "extract", *env["args"], "--out", str(out)]
        both = [
            subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        codes = sorted(p.wait() for p in both)
        refused = [p for p in both if p.returncode == 2]
        named = bool(refused) and "being written by process" in refused[0].stderr.read()
        tally[f"exit codes {codes}"] += 1
        try:
            assert_same_extract(out, env["reference"])
            # [0, 0]: the second started after the first had finished, and found it done
            held += (codes == [0, 2] and named) or codes == [0, 0]
        except AssertionError:
            tally["output differs"] += 1
    return held, tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--disk-full", type=int, default=8)
    parser.add_argument("--score-disk-full", type=int, default=4)
    parser.add_argument("--kills", type=int, default=16)
    parser.add_argument("--races", type=int, default=4)
    options = parser.parse_args()
    if not can_mount():
        sys.exit("fault_sweeps needs root: it mounts small tmpfs filesystems")
    with tempfile.TemporaryDirectory(prefix="specreplay-faults-") as work:
        env = prepare(Path(work))
        for name, run, trials in (
            ("extract disk full", disk_full, options.disk_full),
            ("score disk full", score_disk_full, options.score_disk_full),
            ("score killed -9", kills, options.kills),
            ("two extracts at once", races, options.races),
        ):
            started = time.monotonic()
            held, tally = run(env, trials)
            print(
                f"{name}: {trials} trials, {held} held ({time.monotonic() - started:.0f} s): {dict(tally)}", flush=True
            )


if __name__ == "__main__":
    main()
