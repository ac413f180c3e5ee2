"""`specreplay log` into real TensorBoard, MLflow and W&B (offline) stores, read back with each
tool's own reader: the values and steps there equal summary.parquet's, at each checkpoint's
training step, and logging twice adds nothing. The results come from a real `score` of two
fitted tiny checkpoints, plus one synthetic directory whose checkpoint has no training step."""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import subprocess
import sys
import time

import polars as pl
import pytest
from click.testing import CliRunner

from pipeline.common.errors import UserError
from scoring.results import MIN_ANCHORS, summary_schema
from scoring.track.ledger import Ledger
from scoring.track.loggers import (
    LEDGER_NAME,
    LoggerOptions,
    expected_reach,
    log_results,
    open_loggers,
    position_reach,
    results_dirs_under,
    scalars_of,
)
from specreplay.cli import main
from tests.helpers.drafters import fitted_drafters
from tests.helpers.fake_results import write_fake_results
from tests.helpers.loggers import read_tensorboard
from tests.helpers.processes import REPO
from tests.helpers.shards import tiny_shards

EXTRA = "pip install -e '.[loggers]'"
# mlflow's sqlite store warns about its own SQLAlchemy usage; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


# ---------------------------------------------------------------- results to log


@pytest.fixture(scope="module")
def scored(tmp_path_factory, tiny_qwen3_dir) -> str:
    """A real `score` of two checkpoints (steps 10 and 20) of a drafter fitted to tiny shards of
    two datasets, plus a synthetic results directory whose checkpoint has no step; returns --out."""
    tmp = tmp_path_factory.mktemp("loggers")
    records = [
        {"id": f"q{i}", "prompt": f"What is {i} + {i}?", "dataset": "alpha" if i < 2 else "mt-bench"} for i in range(4)
    ]
    shards = tiny_shards(tmp, tiny_qwen3_dir, records)
    fitted_drafters(shards, tmp / "runs", block_size=4, layer_ids=[1, 3], steps=20, save_every=10, anchors_per_step=16)
    out = str(tmp / "results")
    args = ["score", "--ckpt", str(tmp / "runs" / "step_*"), "--shards", shards, "--out", out]
    result = CliRunner().invoke(main, [*args, "--ddtree-budgets", "4,8", "--quiet"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    identity = {"checkpoint": "notes/final", "checkpoint_hash": "00000000000000aa", "checkpoint_step": None}
    row = {"dataset": "(all)", "method": "chain", "tau": 1.5, "anchor_accepted_len_mean": 0.5}
    write_fake_results(os.path.join(out, "notes_final"), identity, [], [row], run={})
    return out


def reached(results_dir: str, positions: int) -> dict[str, list[int]]:
    """dataset ('(all)' too) -> the anchors that reached each block position, counted here row by
    row from anchors.parquet: position k is reached when the target is known there (k <= the
    length of draft_match) and the draft's first k - 1 tokens were accepted."""
    counts: dict[str, list[int]] = {}
    for row in pl.read_parquet(os.path.join(results_dir, "anchors.parquet")).iter_rows(named=True):
        for dataset in (row["dataset"], "(all)"):
            mine = counts.setdefault(dataset, [0] * positions)
            for k in range(1, positions + 1):
                mine[k - 1] += int(len(row["draft_match"]) >= k and row["accepted_len"] >= k - 1)
    return counts


def wilson(accepted: int, reached: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval (Wilson 1927; E. B. Wilson, JASA 22:209), as textbooks write it."""
    p = accepted / reached
    centre = (p + z**2 / (2 * reached)) / (1 + z**2 / reached)
    half = z / (1 + z**2 / reached) * math.sqrt(p * (1 - p) / reached + z**2 / (4 * reached**2))
    return centre - half, centre + half


def expected(out: str) -> dict[int, dict[str, float]]:
    """step -> the scalars summary.parquet holds, read here without scoring.track.loggers: per dataset
    ('(all)' as 'all') tau per method, the chain streak and every non-NaN acceptance rate of a
    position at least MIN_ANCHORS anchors reached."""
    summary = pl.read_parquet(os.path.join(out, "runs_step_*", "summary.parquet"))
    found: dict[int, dict[str, float]] = {}
    for row in summary.iter_rows(named=True):
        base = "specreplay/" + ("all" if row["dataset"] == "(all)" else row["dataset"])
        scalars = found.setdefault(row["checkpoint_step"], {})
        if row["method"] == "chain":
            scalars[f"{base}/tau_chain"] = row["tau"]
            scalars[f"{base}/streak"] = row["anchor_accepted_len_mean"]
            rates = row["accept_rate_by_position"]
            counts = reached(os.path.join(out, f"runs_step_{row['checkpoint_step']}"), len(rates))[row["dataset"]]
            for k, rate in enumerate(rates, start=1):
                if not math.isnan(rate) and counts[k - 1] >= MIN_ANCHORS:
                    scalars[f"{base}/accept_rate_pos_{k}"] = rate
                    scalars[f"{base}/accept_anchors_pos_{k}"] = counts[k - 1]
                    low, high = wilson(round(rate * counts[k - 1]), counts[k - 1])
                    scalars[f"{base}/accept_rate_pos_{k}_low"], scalars[f"{base}/accept_rate_pos_{k}_high"] = low, high
        else:
            scalars[f"{base}/tau_ddtree_{row['method'].split('-')[1]}"] = row["tau"]
    return found


def copy_results(scored: str, tmp_path) -> str:
    """A fresh copy of the results, so each test starts without a ledger."""
    import shutil

    return shutil.copytree(scored, tmp_path / "results")


def log_cli(*args: str):
    return CliRunner().invoke(main, ["log", *args])


# ---------------------------------------------------------------- scalars


def test_scalars_of_tags_every_dataset_method_and_position(scored):
    path = os.path.join(scored, "runs_step_20", "summary.parquet")
    want = expected(scored)[20]
    assert {t.split("/")[1] for t in want} == {"all", "alpha", "mt-bench"}
    assert {"specreplay/all/tau_ddtree_4", "specreplay/all/tau_ddtree_8", "specreplay/all/accept_rate_pos_1"} <= set(
        want
    )
    counts = position_reach(os.path.dirname(path), pl.read_parquet(path))
    assert counts == reached(os.path.dirname(path), 3)  # block 4: positions 1..3
    assert scalars_of(pl.read_parquet(path), counts) == pytest.approx(want, rel=1e-12, abs=1e-12)
    import pyarrow.parquet as pq

    assert scalars_of(pq.read_table(path), counts) == pytest.approx(
        want, rel=1e-12, abs=1e-12
    )  # a pyarrow Table reads the same


def test_positions_few_anchors_reached_are_not_logged(scored, tmp_path):
    """A rate at a block position reached by fewer than MIN_ANCHORS anchors is no reading: it is
    not sent to the tracker, whatever its value; the well-reached positions are."""
    results, logdir = copy_results(scored, tmp_path), tmp_path / "tb"
    assert log_cli("--results", str(results), "--tensorboard", str(logdir)).exit_code == 0
    logged = read_tensorboard(logdir)[20]
    summary = pl.read_parquet(os.path.join(scored, "runs_step_20", "summary.parquet"))
    chain = {
        r["dataset"]: r["accept_rate_by_position"] for r in summary.iter_rows(named=True) if r["method"] == "chain"
    }
    counts = reached(os.path.join(scored, "runs_step_20"), 3)
    thin = [(d, k) for d, rates in chain.items() for k in range(1, 4) if counts[d][k - 1] < MIN_ANCHORS]
    thin = [(d, k) for d, k in thin if not math.isnan(chain[d][k - 1])]  # a rate that used to be logged
    assert thin, counts  # the fixture must have some: 16-token responses, block 4
    tag = lambda d, k: f"specreplay/{'all' if d == '(all)' else d}/accept_rate_pos_{k}"  # noqa: E731
    assert not [tag(d, k) for d, k in thin if tag(d, k) in logged]
    assert counts["(all)"][0] >= MIN_ANCHORS and tag("(all)", 1) in logged


def test_expected_reach_on_sampled_results_multiplies_the_rates_before():
    # anchors whose position k is known, times P(1..k-1 accepted); a NaN rate (never reached) is 0
    assert expected_reach([100.0, 90.0, 80.0], [0.5, float("nan"), 0.3]) == [100.0, 45.0, 0.0]


def test_scalars_of_leaves_out_nan_and_null():
    import pyarrow as pa

    rows = [
        {"dataset": "(all)", "method": "chain", "tau": 2.0, "anchor_accepted_len_mean": None},
        {"dataset": "gsm/8k", "method": "chain", "tau": float("nan"), "accept_rate_by_position": [0.5, float("nan")]},
        {"dataset": "(all)", "method": "ddtree-16", "tau": None},
    ]
    table = pa.Table.from_pylist(rows, schema=pa.schema([summary_schema().field(k) for k in rows[1]]))
    # '/' in a dataset name would add a tag level; it becomes '_'
    reached = {"gsm/8k": [MIN_ANCHORS, MIN_ANCHORS]}
    assert scalars_of(table, reached) == {
        "specreplay/all/tau_chain": 2.0,
        "specreplay/gsm_8k/accept_rate_pos_1": 0.5,
        "specreplay/gsm_8k/accept_anchors_pos_1": MIN_ANCHORS,
    }
    # without counts (no anchors.parquet) no position is logged: nothing says it is a reading
    assert scalars_of(table) == {"specreplay/all/tau_chain": 2.0}


# ---------------------------------------------------------------- TensorBoard


def assert_close(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], rel: float = 0.0) -> None:
    assert sorted(got) == sorted(want)
    for step in want:
        assert sorted(got[step]) == sorted(want[step]), step
        assert got[step] == pytest.approx(want[step], rel=rel, abs=1e-12), step


def test_tensorboard_events_equal_the_summary_at_each_step_and_twice_adds_nothing(scored, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    results, logdir = copy_results(scored, tmp_path), tmp_path / "train_logs"
    trainer = SummaryWriter(str(logdir))  # the training run's own log directory, loss in it
    for step in range(0, 30, 5):
        trainer.add_scalar("train/loss", 3.0 - step / 10, global_step=step)
    trainer.close()
    result = log_cli("--results", str(results), "--tensorboard", str(logdir))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    # step order, then the directory without a step
    assert len(lines) == 3 and lines[0].startswith("step 10: ") and lines[1].startswith("step 20: ")
    assert lines[2].startswith("skipped notes/final (") and "no training step" in lines[2]
    # TensorBoard stores float32 (simple_value)
    assert_close(read_tensorboard(logdir), expected(scored), rel=1e-6)
    # one run in TensorBoard: the curves beside the training loss, which is untouched
    assert sorted(read_tensorboard(logdir, "train/")) == [0, 5, 10, 15, 20, 25]
    files = sorted(os.listdir(logdir))
    assert len(files) == 2

    again = log_cli("--results", str(results), "--tensorboard", str(logdir))
    assert again.exit_code == 0, again.output
    assert again.output.count("already logged to tensorboard:") == 2 and "logged " not in again.output.replace(
        "already logged", ""
    )
    assert sorted(os.listdir(logdir)) == files  # not even an empty event file
    assert_close(read_tensorboard(logdir), expected(scored), rel=1e-6)


# ---------------------------------------------------------------- MLflow


def mlflow_history(uri: str, run_id: str) -> dict[int, dict[str, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        if key.startswith("specreplay/"):
            for metric in client.get_metric_history(run_id, key):
                assert key not in found.setdefault(metric.step, {}), f"{key} logged twice at step {metric.step}"
                found[metric.step][key] = metric.value
    return found


def test_mlflow_metrics_equal_the_summary_and_the_named_run_is_reused(scored, tmp_path):
    from mlflow.tracking import MlflowClient

    results, uri = copy_results(scored, tmp_path), f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert log_cli("--results", str(results / "runs_step_20"), "--mlflow-uri", uri).exit_code == 0
    # a second invocation over the parent logs step 10 into the same run, and step 20 not again
    result = log_cli("--results", str(results), "--mlflow-uri", uri)
    assert result.exit_code == 0, result.output
    assert "already logged to mlflow:" in result.output.splitlines()[1]
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("specreplay")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_name for r in runs] == ["specreplay"] and runs[0].info.status == "FINISHED"
    assert_close(mlflow_history(uri, runs[0].info.run_id), expected(scored))


def test_mlflow_appends_to_a_training_run_and_leaves_it_running(scored, tmp_path):
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    results, uri = copy_results(scored, tmp_path), f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    training = client.create_run(client.create_experiment("drafter-training"), run_name="run7").info.run_id
    client.log_batch(training, metrics=[Metric("train/loss", 3.0 - s / 10, 0, s) for s in range(0, 30, 5)])
    for _ in range(2):
        result = log_cli("--results", str(results), "--mlflow-uri", uri, "--mlflow-run-id", training)
        assert result.exit_code == 0, result.output
    assert_close(mlflow_history(uri, training), expected(scored))
    assert len(client.get_metric_history(training, "train/loss")) == 6
    assert client.get_run(training).info.status == "RUNNING"  # the trainer's to finish
    missing = log_cli("--results", str(results), "--mlflow-uri", uri, "--mlflow-run-id", "0" * 32)
    assert missing.exit_code == 2 and "no such run" in missing.output


# ---------------------------------------------------------------- Weights & Biases


def wandb_records(path: str):
    """The records of a W&B transaction log (run-<id>.wandb): a 7-byte header (':W&B', 0xBEE1,
    version), then LevelDB-log chunks (crc32 4 bytes, length 2, type 1 = full / 2 first / 3
    middle / 4 last) that never cross a 32 KiB block, each block's tail under 7 bytes zeroed."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # padding or a preallocated tail
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_wandb(wandb_dir, run_id: str) -> dict[int, dict[str, float]]:
    """specreplay/step -> {tag: value} over every offline run directory of `run_id`."""
    import wandb

    # wandb's service closes a finished run's file (flushing its buffer) after `finish` returns;
    # a CLI process waits for that on exit, an in-process CliRunner call does not
    wandb.teardown()
    found: dict[int, dict[str, float]] = {}
    for path in sorted(glob.glob(os.path.join(str(wandb_dir), "wandb", f"offline-run-*-{run_id}", "*.wandb"))):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "run":
                assert record.run.run_id == run_id
            if record.WhichOneof("record_type") != "history":
                continue
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = items.pop("specreplay/step")
            assert step not in found, f"step {step} logged twice"
            found[step] = {k: v for k, v in items.items() if not k.startswith("_")}
    return found


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path / "wandb-home"


def test_wandb_offline_run_equals_the_summary_with_checkpoints_out_of_order(scored, tmp_path, wandb_offline):
    results = copy_results(scored, tmp_path)
    # the later checkpoint first, then the earlier one appended to the same (resumed) run: the
    # x-axis is specreplay/step, so a lower step after a higher one is kept, not dropped
    first = log_cli("--results", str(results / "runs_step_20"), "--wandb-project", "drafter", "--wandb-run-id", "run7")
    assert first.exit_code == 0, first.output
    # wandb names an offline run's directory by the second it started: two in one second share one
    second_starts = math.floor(time.time()) + 1
    time.sleep(max(0.0, second_starts - time.time()))
    second = log_cli("--results", str(results), "--wandb-project", "drafter", "--wandb-run-id", "run7")
    assert second.exit_code == 0, second.output
    assert "logged" in second.output.splitlines()[0] and "already logged to wandb:drafter/run7" in second.output
    assert len(glob.glob(str(wandb_offline / "wandb" / "offline-run-*-run7"))) == 2
    assert_close(read_wandb(wandb_offline, "run7"), expected(scored))
    third = log_cli("--results", str(results), "--wandb-project", "drafter", "--wandb-run-id", "run7")
    assert third.exit_code == 0 and len(glob.glob(str(wandb_offline / "wandb" / "offline-run-*"))) == 2


# ---------------------------------------------------------------- errors and API


@pytest.mark.parametrize(
    "module, option", [("tensorboard", "--tensorboard"), ("wandb", "--wandb-project"), ("mlflow", "--mlflow-uri")]
)
def test_a_logger_whose_package_is_missing_names_the_extra(scored, tmp_path, monkeypatch, module, option):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    result = log_cli("--results", scored, option, str(tmp_path / "dest"))
    assert result.exit_code == 2
    assert f"error: {option} needs the `{module}` package" in result.output and EXTRA in result.output
    with pytest.raises(UserError, match=r"\.\[loggers\]"):
        open_loggers(LoggerOptions(**{option.lstrip("-").replace("-", "_"): str(tmp_path / "dest")}))
    assert not os.path.exists(os.path.join(scored, LEDGER_NAME))


def test_no_logger_is_a_clear_error(scored, tmp_path):
    result = log_cli("--results", scored)
    assert result.exit_code == 2 and "nothing to log to: pass --tensorboard DIR" in result.output
    assert log_results(results_dirs_under(scored), []) == []  # the API: nothing to do, nothing written
    assert not os.path.exists(os.path.join(scored, LEDGER_NAME))
    assert log_cli("--results", scored, "--wandb-run-id", "x").exit_code == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    result = log_cli("--results", str(empty), "--tensorboard", str(tmp_path / "tb"))
    assert result.exit_code == 2 and "no results directory" in result.output


def test_an_unreadable_ledger_is_refused_not_overwritten(scored, tmp_path):
    results = copy_results(scored, tmp_path)
    (results / LEDGER_NAME).write_text("{half a ledg")
    result = log_cli("--results", str(results), "--tensorboard", str(tmp_path / "tb"))
    assert result.exit_code == 2 and "not a specreplay log ledger" in result.output
    assert (results / LEDGER_NAME).read_text() == "{half a ledg" and not (tmp_path / "tb").exists()


def test_two_writers_of_one_ledger_keep_each_others_entries(tmp_path):
    # `watch` and a manual `log` both holding the ledger open: each add merges with the file
    path = str(tmp_path / LEDGER_NAME)
    watcher, manual = Ledger(path), Ledger(path)
    watcher.add("tensorboard:/runs/tb", "00ab", 10, "run/step_10", str(tmp_path), 5)
    manual.add("mlflow:sqlite:///m.db run 1", "00ab", 10, "run/step_10", str(tmp_path), 5)
    manual.add("tensorboard:/runs/tb", "00ab", 10, "run/step_10", str(tmp_path), 5)  # already there: once
    entries = Ledger(path).entries
    assert sorted(e["destination"] for e in entries) == ["mlflow:sqlite:///m.db run 1", "tensorboard:/runs/tb"]
    assert Ledger(path).find("tensorboard:/runs/tb", "00ab", 10)["checkpoint"] == "run/step_10"


def _add_entries(path: str, writer: int, count: int) -> None:
    ledger = Ledger(path)
    for step in range(count):
        ledger.add(f"tensorboard:/w{writer}", "00ab", step, f"run/step_{step}", "/results", 5)


def test_writers_in_several_processes_lose_no_entry_and_leave_no_lock_file(tmp_path):
    """Real processes adding to one ledger at once: every entry is kept (the flock), and the lock
    file is removed by whoever holds it last, so nothing is left beside the results."""
    import multiprocessing

    path = str(tmp_path / LEDGER_NAME)
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_add_entries, args=(path, w, 15)) for w in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(120)
        assert writer.exitcode == 0
    entries = Ledger(path).entries
    assert len(entries) == 60 and {(e["destination"], e["step"]) for e in entries} == {
        (f"tensorboard:/w{w}", s) for w in range(4) for s in range(15)
    }
    assert sorted(os.listdir(tmp_path)) == [LEDGER_NAME]


def test_log_help_imports_no_heavy_package():
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "specreplay", "log", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "beside its loss" in proc.stdout, proc.stderr[-2000:]
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if "|" in line}
    heavy = {"torch", "pyarrow", "polars", "transformers", "tensorboard", "wandb", "mlflow"}
    assert "click" in loaded and not loaded & heavy, loaded & heavy
