"""Where a score run's results go: one directory per checkpoint, locked while it is scored,
written whole or not at all (staged beside it, renamed into place, run.json last), skipped when
it already holds these settings and refused when it holds others."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow.parquet as pq

from pipeline.common.errors import UserError
from pipeline.common.lock import OutputLock, pid_exists
from pipeline.common.space import writing
from scoring import results
from scoring.score.console import describe_nonfinite
from scoring.score.outcome import Outcome, Status
from scoring.score.record import differences, read_record


def output_dirs(paths: list[str], out: str) -> dict[str, str]:
    """checkpoint path -> its results directory; two checkpoints may not share one."""
    dirs: dict[str, str] = {}
    for path in paths:
        target = os.path.join(out, results.result_dir_name(path))
        clash = [other for other, d in dirs.items() if d == target]
        if clash:
            raise UserError(
                f"--ckpt {clash[0]} and {path} would both write {target}; score them into different --out directories"
            )
        dirs[path] = target
    return dirs


def check_previous(out_dir: str, planned: dict, force: bool) -> bool:
    """True when out_dir already holds these results (skip). Results of other settings are
    never replaced silently: an error lists what differs, unless --force."""
    previous = read_record(out_dir)
    if previous is None or force:
        return False
    changed = differences(previous, planned)
    if not changed:
        return True
    raise UserError(
        f"{out_dir} holds results scored with other settings ({'; '.join(changed)}); "
        f"pass --force to replace them, or choose another --out"
    )


def write_results(out_dir: str, tables: dict, record: dict) -> None:
    """Write the files into a hidden staging directory beside out_dir, run.json last, then
    rename it into place: a results directory that exists is complete, whenever the process
    dies. Results being replaced (--force) are moved aside first and deleted after."""
    parent, name = os.path.split(os.path.normpath(out_dir))
    staging = results.staging_dir(out_dir, os.getpid())
    remove_dead_staging(out_dir)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        _write_staged(staging, tables, record)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a disk-full or killed write leaves no half directory
        raise
    if os.path.exists(out_dir):
        replaced = os.path.join(parent, f".{name}.replaced-{os.getpid()}")
        os.replace(out_dir, replaced)
        os.replace(staging, out_dir)
        shutil.rmtree(replaced)
    else:
        os.replace(staging, out_dir)


def _write_staged(staging: str, tables: dict, record: dict) -> None:
    for kind in ("anchors", "walk", "samples", "summary"):
        if tables[kind] is not None:
            results.write_table(tables[kind], staging, kind)
    run_path = os.path.join(staging, results.FILES["run"])
    with writing(run_path, resume="results are kept only once whole, so it redoes them"), open(run_path, "w") as f:
        json.dump(record, f, indent=1)


def remove_dead_staging(out_dir: str) -> list[str]:
    """Remove the staging directories of out_dir whose process is gone (killed mid-write): they
    will never be renamed into place. A live process's (ours included) is left alone."""
    removed = []
    for path, pid in results.staging_dirs(out_dir):
        if pid.isdigit() and int(pid) != os.getpid() and not pid_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def results_lock(out_dir: str):
    """The lock file beside a results directory (`.<name>.lock`), held while it is scored."""
    parent, name = os.path.split(os.path.normpath(out_dir))
    return OutputLock(os.path.join(parent, f".{name}.lock"), f"results directory {out_dir}")


class NonFiniteLogitsError(UserError):
    """The drafter produced NaN/Inf logits on every sample scored: there is nothing to average."""

    def __init__(self, records: list[dict]):
        super().__init__(
            f"no sample left to score: {describe_nonfinite(records)}; the checkpoint is damaged or "
            f"overflows (fp16 overflow in training?): score another checkpoint, or try --dtype fp32"
        )


def skipped(ckpt: str, out_dir: str) -> Outcome:
    """The outcome of a checkpoint already scored with the same settings, from its files."""
    record = read_record(out_dir)
    summary = pq.read_table(os.path.join(out_dir, results.FILES["summary"]))
    return Outcome(ckpt, out_dir, Status.SKIPPED, record, summary, name=record["checkpoint"]["name"])
