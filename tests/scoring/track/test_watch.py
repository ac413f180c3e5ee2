"""`specreplay watch` beside a real training run: a writer process (tests/helpers/watch_writer.py) writes
checkpoints of a tiny drafter over time, atomically, in place, truncated and sharded with a late
shard; `watch` runs in another process. Each complete checkpoint is scored once, with results
equal to a plain `score`, never while incomplete; a truncated one is reported once and never
scored; SIGTERM and SIGKILL leave nothing a later run takes as done, and the restart finishes
the job without scoring anything twice."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from scoring.config import ScoreConfig
from scoring.score.run import run_score
from scoring.track.watch import Tracker, candidate_paths
from specreplay.cli import main
from tests.helpers.drafters import fitted_drafters
from tests.helpers.processes import REPO
from tests.helpers.shards import tiny_shards

WRITER = os.path.join(REPO, "tests", "helpers", "watch_writer.py")
BUDGETS = "4,8"
DEADLINE_S = 240  # a busy 2-core CI machine; the whole file normally takes well under a minute
TABLES = ("anchors", "walk", "samples", "summary")


@dataclass
class Setup:
    tmp: Path
    shards: str
    fitted: list[str]  # three fitted checkpoints (different weights), z-lab directories


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_qwen3_dir) -> Setup:
    tmp = tmp_path_factory.mktemp("watch")
    shards = tiny_shards(tmp, tiny_qwen3_dir, [{"id": f"q{i}", "prompt": f"What is {i} + {i}?"} for i in range(4)])
    fitted = fitted_drafters(
        shards, tmp / "fitted", block_size=4, layer_ids=[1, 3], steps=30, save_every=10, anchors_per_step=16
    )
    return Setup(tmp, shards, fitted)


# --------------------------------------------------------------------------- source checkpoints


def with_step(config_path: str, step: int | None) -> dict:
    """The fitted config with its training step set (None: no step field, the path says it)."""
    config = json.loads(Path(config_path).read_text())
    config.pop("step", None)
    return config if step is None else {**config, "step": step}


def source_dir(fitted: str, dst: Path, step: int) -> str:
    """A complete z-lab checkpoint directory: fitted's weights, its config saying `step`."""
    dst.mkdir(parents=True)
    shutil.copyfile(os.path.join(fitted, "model.safetensors"), dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(with_step(os.path.join(fitted, "config.json"), step)))
    return str(dst)


def sharded_dir(fitted: str, dst: Path, step: int) -> str:
    """The same as source_dir, the weights split over two shards named by an index."""
    dst.mkdir(parents=True)
    state = load_file(os.path.join(fitted, "model.safetensors"))
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(dst / file))
    weight_map = {k: file for file, keys in halves.items() for k in keys}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / "config.json").write_text(json.dumps(with_step(os.path.join(fitted, "config.json"), step)))
    return str(dst)


def pt_file(fitted: str, dst: Path) -> tuple[str, str]:
    """(a .pt training checkpoint nesting the state dict under "model", a config without a step
    for beside it): its step comes from its file name."""
    dst.mkdir(parents=True)
    torch.save({"model": load_file(os.path.join(fitted, "model.safetensors"))}, dst / "weights.pt")
    (dst / "config.json").write_text(json.dumps(with_step(os.path.join(fitted, "config.json"), None)))
    return str(dst / "weights.pt"), str(dst / "config.json")


# --------------------------------------------------------------------------- processes


def start_watch(setup: Setup, pattern: str, out: str, output: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "specreplay", "watch", "--ckpt", pattern, "--shards", setup.shards]
    command += ["--out", out, "--interval", "0.2", "--ddtree-budgets", BUDGETS, "--no-progress", *extra]
    with open(output, "w") as handle:  # the child keeps its own descriptor
        return subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)


def wait_until(predicate, process: subprocess.Popen, output: Path, what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert process.poll() is None, f"watch exited ({process.returncode}) before {what}:\n{output.read_text()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{output.read_text()}"
        time.sleep(0.02)


def stop(process: subprocess.Popen, signum: int) -> int:
    process.send_signal(signum)
    return process.wait(timeout=DEADLINE_S)  # a busy machine finishes its torch op before the handler runs


def scored_lines(text: str, step: int) -> list[str]:
    return re.findall(rf"^scored step {step}: .*$", text, re.M)


# --------------------------------------------------------------------------- results


def plain_score(ckpt: str, shards: str, out: str) -> str:
    """The results directory a plain `score` writes for ckpt."""
    config = ScoreConfig(ckpts=[ckpt], shards=shards, out=out, tree_nodes=[int(b) for b in BUDGETS.split(",")])
    [outcome] = run_score(config)
    assert outcome.status == "scored", outcome.error
    return outcome.out_dir


def assert_same_results(watched: str, plain: str) -> None:
    """Every table equal, run.json equal but for the wall time and the command line."""
    for kind in TABLES:
        a, b = (pl.read_parquet(os.path.join(d, f"{kind}.parquet")) for d in (watched, plain))
        assert a.equals(b), (kind, watched)
    records = [json.loads(Path(d, "run.json").read_text()) for d in (watched, plain)]
    for record in records:
        del record["wall_time_s"], record["command"]
    assert records[0] == records[1]


def assert_no_half_directory(out: str) -> None:
    """No staging directory left, and every results directory complete (run.json present)."""
    names = os.listdir(out)
    assert not [n for n in names if ".partial-" in n], names
    for name in names:
        if os.path.isdir(os.path.join(out, name)):
            assert os.path.exists(os.path.join(out, name, "run.json")), name


def stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns


# --------------------------------------------------------------------------- tests


def run7_plan(setup: Setup, src: Path, run: Path, output: Path, log: Path) -> dict:
    """The writer's plan: step_200 in place (its weights in two halves), step_100 atomically
    (tmp-step_100/ renamed), step_300 truncated for good, step_400 sharded with its last shard
    late, step_500.pt a .pt file in two halves. Each incomplete one stays so until the watcher
    has said it is waiting for it."""
    pt, pt_config = pt_file(setup.fitted[0], src / "pt")
    waits = {name: f"waiting for {run}/{name}" for name in ("step_200", "step_400", "step_500.pt")}
    checkpoints = [
        {"kind": "in_place", "name": "step_200", "src": source_dir(setup.fitted[1], src / "200", 200)},
        {"kind": "atomic", "name": "step_100", "src": source_dir(setup.fitted[0], src / "100", 100)},
        {"kind": "truncated", "name": "step_300", "src": source_dir(setup.fitted[2], src / "300", 300)},
        {"kind": "late_shard", "name": "step_400", "src": sharded_dir(setup.fitted[2], src / "400", 400)},
        {"kind": "file", "name": "step_500.pt", "src": pt, "config": pt_config},
    ]
    for item in checkpoints:
        if item["name"] in waits:
            item["wait_for"] = waits[item["name"]]
    return {"run": str(run), "log": str(log), "pause": 0.3, "watch_output": str(output), "checkpoints": checkpoints}


@pytest.mark.slow
def test_watch_scores_each_checkpoint_of_a_training_run_once_as_it_lands(setup, tmp_path):
    run, out, output = tmp_path / "run7", str(tmp_path / "results"), tmp_path / "watch.log"
    plan = run7_plan(setup, tmp_path / "src", run, output, tmp_path / "writer.jsonl")
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    run.mkdir()
    watch = start_watch(setup, f"{run}/step_*", out, output)
    try:
        wait_until(lambda: "watching" in output.read_text(), watch, output, "the watcher's start")
        writer = subprocess.Popen([sys.executable, WRITER, str(tmp_path / "plan.json")], cwd=REPO)
        everything = lambda: all(scored_lines(output.read_text(), s) for s in (100, 200, 400, 500))  # noqa: E731
        wait_until(everything, watch, output, "every complete checkpoint scored")
        assert writer.wait(timeout=60) == 0
        time.sleep(1.0)  # five more polls: nothing else may be scored
        assert stop(watch, signal.SIGTERM) == 128 + signal.SIGTERM
    finally:
        watch.kill()
    text = output.read_text()
    assert "stopped by SIGTERM" in text, text
    check_run7(setup, run, out, text, tmp_path)


def check_run7(setup: Setup, run: Path, out: str, text: str, tmp_path: Path) -> None:
    """What test_watch_scores_each_checkpoint... checks once the watcher is stopped."""
    completed = {}
    for line in (tmp_path / "writer.jsonl").read_text().splitlines():
        event = json.loads(line)
        completed.setdefault(event.get("name"), event.get("complete"))
    for step, name in ((100, "step_100"), (200, "step_200"), (400, "step_400"), (500, "step_500")):
        assert len(scored_lines(text, step)) == 1, text  # scored once, and only once
        watched = os.path.join(out, f"run7_{name}")
        ckpt = str(run / (name + (".pt" if step == 500 else "")))
        # never scored while incomplete: its results were written after the writer finished it
        assert os.stat(os.path.join(watched, "run.json")).st_mtime >= completed[os.path.basename(ckpt)], name
        assert_same_results(watched, plain_score(ckpt, setup.shards, str(tmp_path / "plain")))
    for name in ("step_200", "step_300", "step_400", "step_500.pt"):  # each seen incomplete, reported once
        assert text.count(f"waiting for {run}/{name}:") == 1, (name, text)
    assert re.search(rf"waiting for {run}/step_300: .*truncated", text), text
    assert not scored_lines(text, 300) and not os.path.exists(os.path.join(out, "run7_step_300"))
    assert "tmp-step_100" not in text  # the atomic writer's staging name is never a candidate
    # the change against the previous step: step_200 was ready long before step_400's last shard
    assert re.search(r"^scored step 400: .*; vs step 200: [+-]\d.*\(95% CI [+-]\d.* to [+-]\d", text, re.M), text
    assert re.search(r"^scored step 500: .*; vs step 400: [+-]\d.*\(95% CI [+-]\d.* to [+-]\d", text, re.M), text
    report = Path(out, "report.html").read_text()
    assert "newest" in report and "training step" in report
    assert_no_half_directory(out)
    assert sorted(os.listdir(out)) == [
        "report.html",
        "run7_step_100",
        "run7_step_200",
        "run7_step_400",
        "run7_step_500",
    ]


def kill_when_staged(process: subprocess.Popen, out_dir: str, timeout: float = DEADLINE_S) -> list[str]:
    """SIGKILL the watcher as soon as out_dir's staging directory appears (write_results holds it
    for a few milliseconds, so this loop only lists the directory), or once out_dir exists when
    the window was missed. Returns the staging directories the kill left (none when missed)."""
    parent, name = os.path.split(out_dir)
    staging = lambda: [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(f".{name}.partial-")]  # noqa: E731
    deadline = time.monotonic() + timeout
    while not (staging() or os.path.exists(out_dir) or process.poll() is not None or time.monotonic() > deadline):
        pass
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    return staging()


def leave_dead_staging(out_dir: str, finished: str) -> str:
    """What a process killed inside write_results leaves: a staging directory named for its pid
    (of a process that has ended) holding the parquet files but no run.json."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    parent, name = os.path.split(out_dir)
    staging = os.path.join(parent, f".{name}.partial-{dead.pid}")
    if not os.path.exists(out_dir):
        os.makedirs(staging, exist_ok=True)
        for kind in TABLES:
            shutil.copyfile(os.path.join(finished, f"{kind}.parquet"), os.path.join(staging, f"{kind}.parquet"))
    return staging


def complete_run(setup: Setup, run: Path) -> dict[int, str]:
    """A run directory already holding three complete checkpoints whose names sort against
    their steps (step_1000 before step_900 by name)."""
    steps = {900: setup.fitted[0], 1000: setup.fitted[1], 1100: setup.fitted[2]}
    return {step: source_dir(fitted, run / f"step_{step}", step) for step, fitted in steps.items()}


def terminate_inside_first(setup: Setup, run: Path, out: str, output: Path, first: str, first_dir: str) -> None:
    """SIGTERM the watcher while it scores `first`: exit 143, nothing half-written left."""
    watch = start_watch(setup, f"{run}/step_*", out, output)
    try:
        wait_until(lambda: f"scoring {first}" in output.read_text(), watch, output, "scoring to start")
        assert stop(watch, signal.SIGTERM) == 128 + signal.SIGTERM, output.read_text()
    finally:
        watch.kill()
    text = output.read_text()
    assert "stopped by SIGTERM" in text, text
    if "while scoring" in text:  # the usual case: the signal came before its results were written
        assert not os.path.exists(first_dir), text
    if os.path.isdir(out):
        assert_no_half_directory(out)


def kill_inside_second(setup: Setup, run: Path, out: str, output: Path, ckpts: dict, dirs: dict) -> str:
    """SIGKILL the watcher inside step 1000's write_results (step 900 done by then); returns the
    staging directory the kill left, or, when the window was missed, one made as it would be."""
    watch = start_watch(setup, f"{run}/step_*", out, output)
    first_done = lambda: re.search(rf"^(scored step 900|already scored: {ckpts[900]})", output.read_text(), re.M)  # noqa: E731
    try:
        wait_until(first_done, watch, output, "step 900 done")
        wait_until(lambda: f"scoring {ckpts[1000]}" in output.read_text(), watch, output, "step 1000 started")
        left = kill_when_staged(watch, dirs[1000])
    finally:
        watch.kill()
    assert len(left) <= 1, left
    assert all(os.path.exists(os.path.join(d, "run.json")) for d in dirs.values() if os.path.isdir(d))
    return left[0] if left else leave_dead_staging(dirs[1100], dirs[900])


@pytest.mark.slow
def test_stopped_or_killed_mid_checkpoint_then_restarted_scores_everything_once(setup, tmp_path):
    run, out = tmp_path / "run9", str(tmp_path / "results")
    ckpts = complete_run(setup, run)
    dirs = {step: os.path.join(out, f"run9_step_{step}") for step in ckpts}
    terminate_inside_first(setup, run, out, tmp_path / "term.log", ckpts[900], dirs[900])
    leftover = kill_inside_second(setup, run, out, tmp_path / "kill.log", ckpts, dirs)
    before = {step: stamp(os.path.join(d, "run.json")) for step, d in dirs.items() if os.path.isdir(d)}
    assert 900 in before
    # restart with --once: what was finished is skipped, the rest scored in step order
    result = once(setup, f"{run}/step_*", out)
    assert result.exit_code == 0, result.output
    for step in ckpts:
        assert len(scored_lines(result.output, step)) == (0 if step in before else 1), result.output
        assert (f"already scored: {ckpts[step]}" in result.output) == (step in before), result.output
    order = [int(s) for s in re.findall(r"^scored step (\d+):", result.output, re.M)]
    assert order == sorted(order), result.output  # oldest step first, whatever the names' order
    for step, previous in before.items():
        assert stamp(os.path.join(dirs[step], "run.json")) == previous  # not scored twice
    assert_no_half_directory(out)
    assert not os.path.exists(leftover)
    for step, ckpt in ckpts.items():
        assert_same_results(dirs[step], plain_score(ckpt, setup.shards, str(tmp_path / "plain")))


def once(setup: Setup, pattern: str, out: str, *extra: str):
    """`specreplay watch --once` in this process."""
    args = ["watch", "--ckpt", pattern, "--shards", setup.shards, "--out", out, "--once", "--interval", "0.2"]
    return CliRunner().invoke(
        main, args + ["--ddtree-budgets", BUDGETS, "--no-progress", *extra], catch_exceptions=False
    )


def test_once_logs_every_checkpoint_to_tensorboard_at_its_step_and_never_twice(setup, tmp_path):
    pytest.importorskip("tensorboard")
    from tests.helpers.loggers import read_tensorboard

    run, out, tb = tmp_path / "run5", str(tmp_path / "results"), tmp_path / "tb"
    ckpts = complete_run(setup, run)
    first = once(setup, f"{run}/step_*", out, "--tensorboard", str(tb))
    assert first.exit_code == 0 and "once: 3 scored, 0 already scored" in first.output, first.output
    again = once(setup, f"{run}/step_*", out, "--tensorboard", str(tb))  # all skipped; the ledger says logged
    assert again.exit_code == 0 and "once: 0 scored, 3 already scored" in again.output, again.output
    logged = read_tensorboard(tb)  # fails on a tag logged twice at one step
    assert sorted(logged) == sorted(ckpts)
    for step in ckpts:
        summary = pl.read_parquet(os.path.join(out, f"run5_step_{step}", "summary.parquet"))
        pooled = {r["method"]: r["tau"] for r in summary.filter(pl.col("dataset") == "(all)").iter_rows(named=True)}
        assert logged[step]["specreplay/all/tau_chain"] == pytest.approx(pooled["chain"], rel=1e-6)
        assert logged[step]["specreplay/all/tau_ddtree_8"] == pytest.approx(pooled["ddtree-8"], rel=1e-6)


def test_once_says_it_looks_once_keeps_the_report_and_leaves_no_lock_file(setup, tmp_path):
    """--once says it looks once (not "every 60 s"); a run with nothing new still leaves
    report.html over the results there; no lock file is left under --out (the results locks,
    the loggers' ledger lock)."""
    pytest.importorskip("tensorboard")
    run, out, tb = tmp_path / "run", tmp_path / "results", tmp_path / "tb"
    source_dir(setup.fitted[0], run / "step_900", 900)
    first = once(setup, f"{run}/step_*", str(out), "--tensorboard", str(tb))
    assert first.exit_code == 0 and "once: 1 scored, 0 already scored" in first.output, first.output
    assert f"looking once at {run}/step_*" in first.output and "every 60 s" not in first.output
    report = out / "report.html"
    assert report.exists()
    report.unlink()
    again = once(setup, f"{run}/step_*", str(out), "--tensorboard", str(tb))
    assert again.exit_code == 0 and "once: 0 scored, 1 already scored" in again.output, again.output
    assert report.exists() and f"report: {report}" in again.output  # written although nothing was new
    assert "specreplay watch: newest run/step_900 (step 900)" in report.read_text(encoding="utf-8")
    left = [p.name for p in out.rglob("*") if ".lock" in p.name]
    assert left == [] and (out / ".specreplay-logged.json").exists(), left


def test_once_on_a_glob_that_matches_nothing_exits_0_saying_so(tmp_path):
    result = CliRunner().invoke(
        main,
        ["watch", "--ckpt", str(tmp_path / "run" / "step_*"), "--shards", str(tmp_path / "shards")]
        + ["--out", str(tmp_path / "out"), "--once"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert "no checkpoint matches" in result.output and "nothing to score" in result.output


def test_candidates_and_completeness_from_real_files(setup, tmp_path):
    """Temporary, hidden and non-weight names are never candidates; a complete checkpoint is
    ready at the poll after it stopped changing; one that changes between polls waits."""
    run = tmp_path / "run"
    source_dir(setup.fitted[0], run / "step_1", 1)
    source_dir(setup.fitted[0], run / "tmp-step_2", 2)
    source_dir(setup.fitted[0], run / ".step_3", 3)
    pt, config = pt_file(setup.fitted[1], tmp_path / "pt")
    shutil.copyfile(pt, run / "step_4.pt")
    shutil.copyfile(config, run / "config.json")
    assert candidate_paths([f"{run}/*"]) == [str(run / "step_1"), str(run / "step_4.pt")]
    tracker, notes = Tracker([f"{run}/*"]), []
    assert tracker.poll(notes.append) == []  # first sight: not yet seen unchanged
    weights = run / "step_1" / "model.safetensors"
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))  # rewritten in place since
    assert tracker.poll(notes.append) == [str(run / "step_4.pt")]
    # both now, oldest step first; step_4.pt again since nothing marked it finished
    assert tracker.poll(notes.append) == [str(run / "step_1"), str(run / "step_4.pt")]
    assert notes == []


def test_watch_help_imports_nothing_heavy():
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "specreplay", "watch", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if "|" in line}
    assert "click" in loaded and not loaded & {"torch", "pyarrow", "polars", "transformers"}


# --------------------------------------------------------------------------- baselines


LOOKUP_NAME = "ngram:vllm:k=3,min=1,max=2"
LOOKUP = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
VERSUS = r"tau (\S+) vs {name} (\S+), (\S+) \[(\S+), (\S+)\]"


def pooled_difference(drafter_dir, baseline_dir) -> tuple[float, float, float]:
    """(drafter tau, baseline tau, mean paired difference) of chain tau over the samples, from
    samples.parquet directly."""
    taus = [
        pl.read_parquet(os.path.join(d, "samples.parquet"))
        .filter(pl.col("method") == "chain")
        .select("sample_id", "tau")
        for d in (drafter_dir, baseline_dir)
    ]
    both = taus[0].join(taus[1], on="sample_id", suffix="_base")
    assert both.height == 4, both
    return both["tau"].mean(), both["tau_base"].mean(), (both["tau"] - both["tau_base"]).mean()


def assert_versus(numbers: tuple, drafter_dir, baseline_dir) -> None:
    tau, base, delta, low, high = (float(x) for x in numbers)
    want = pooled_difference(drafter_dir, baseline_dir)
    assert (tau, base, delta) == pytest.approx(want, abs=0.006), (numbers, want)  # printed to 2 decimals
    assert low <= delta <= high, numbers


def test_baselines_by_name_stand_beside_each_checkpoint_in_watch_score_and_report(setup, tmp_path):
    """`watch --baseline NAME` scores the named n-gram once, then puts each checkpoint beside it with
    the paired interval; `score` with checkpoints and the baseline prints the same line; the report
    has the same numbers; the name scores exactly what its JSON file does."""
    run, out = tmp_path / "run", tmp_path / "results"
    ckpts = complete_run(setup, run)
    first = once(setup, f"{run}/step_*", str(out), "--baseline", LOOKUP_NAME)
    assert first.exit_code == 0 and "once: 3 scored" in first.output, first.output
    base_dir = out / "ngram_vllm_k=3_min=1_max=2"
    assert f"scoring baseline {LOOKUP_NAME}" in first.output and (base_dir / "run.json").exists()
    for step in ckpts:
        pattern = rf"^scored step {step}: .*\n  step {step}: " + VERSUS.format(name=re.escape(LOOKUP_NAME)) + "$"
        found = re.search(pattern, first.output, re.M)
        assert found, first.output
        assert_versus(found.groups(), out / f"run_step_{step}", base_dir)
    again = once(setup, f"{run}/step_*", str(out), "--baseline", LOOKUP_NAME)  # a restart rescoring nothing
    assert "scoring baseline" not in again.output and "once: 0 scored, 3 already scored" in again.output

    page = (out / "report.html").read_text(encoding="utf-8")
    section = page.split('<h2 id="baselines">')[1].split("<h2")[0]
    rows = re.findall(
        r"<tr><td>(.*?)</td><td>(.*?)</td>" + "<td>(.*?)</td>" * 3 + r"<td>([^<]+) to ([^<]+)</td>", section
    )
    assert [r[0].replace("<wbr>", "") for r in rows] == [f"run/step_{s}" for s in sorted(ckpts)], rows  # by step
    for label, baseline, *numbers in rows:
        assert baseline == LOOKUP_NAME
        assert_versus(numbers, out / f"run_step_{label.rsplit('_', 1)[1]}", base_dir)

    config = tmp_path / "lookup.json"
    config.write_text(json.dumps(LOOKUP))
    other = tmp_path / "scored"
    args = ["score", "--ckpt", str(run / "step_900"), "--ckpt", str(config), "--ckpt", LOOKUP_NAME]
    scored = CliRunner().invoke(main, [*args, "--shards", setup.shards, "--out", str(other), "--ddtree-budgets", ""])
    assert scored.exit_code == 0, scored.output
    for name in (LOOKUP_NAME, f"{tmp_path.name}/lookup.json"):
        line = re.search(r"^  run/step_900: " + VERSUS.format(name=re.escape(name)) + "$", scored.output, re.M)
        assert line, scored.output
        assert_versus(line.groups(), other / "run_step_900", base_dir)
    named, filed = (
        pl.read_parquet(other / d / "walk.parquet") for d in ("ngram_vllm_k=3_min=1_max=2", f"{tmp_path.name}_lookup")
    )
    assert named.drop("checkpoint").equals(filed.drop("checkpoint"))  # one rule, one hash: only the name differs


def test_a_stop_a_library_turns_into_its_own_error_still_stops_the_watch(setup, tmp_path, monkeypatch):
    """SIGTERM inside pydantic's schema builder came out as a SchemaError (seen in a test run): the
    watcher took it for a failed checkpoint and went on. A real SIGTERM is sent here while the
    checkpoint is being scored, from inside a stand-in library that wraps whatever is raised."""
    from scoring.track import watch as module

    real = module.score_checkpoint

    def swallowing(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises Stopped here
            time.sleep(5)
        except BaseException as error:  # noqa: BLE001 - what a wrapping library does
            raise ValueError(f"Error building `model` serializer: {error}") from None
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "score_checkpoint", swallowing)
    run, out = tmp_path / "run", tmp_path / "results"
    source_dir(setup.fitted[0], run / "step_900", 900)
    config = ScoreConfig(ckpts=[f"{run}/step_*"], shards=setup.shards, out=str(out), tree_nodes=[4])
    lines = []
    options = module.WatchOptions(interval=0.2, once=True, echo=lines.append, warn=lines.append)
    result = module.run_watch(config, options)
    assert result.stopped_by == signal.SIGTERM and result.failed == [], lines
    assert not any(line.startswith("error:") for line in lines), lines
    assert not (out / "run_step_900").exists()
