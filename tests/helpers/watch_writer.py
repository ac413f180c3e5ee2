"""A training run writing drafter checkpoints over time, for tests/scoring/track/test_watch.py.

    python tests/helpers/watch_writer.py PLAN.json

Started with subprocess beside `specreplay watch`, it copies complete checkpoints prepared by
the test into a run directory the ways trainers write them. Standard library only, so it starts
at once. PLAN is JSON: {"run": DIR, "log": FILE, "pause": SECONDS, "watch_output": FILE,
"checkpoints": [...]}, each checkpoint {"kind": KIND, "src": PATH, "name": NAME} written in order:

  atomic      every file under tmp-NAME/, pausing between files, then one rename to NAME/
  in_place    NAME/ file by file, each weight file in two halves; in between, the midway
  truncated   NAME/ with its config and the first half of its weights, never finished
  late_shard  a sharded NAME/ (config, index, every shard but the last), the midway, the last shard
  file        the weight file NAME (e.g. step_500.pt) in two halves beside the run's config.json
              (copied from "config" first); in between, the midway

The midway of a checkpoint is a pause, or, when it has "wait_for": TEXT, the moment TEXT appears
in the watcher's output (so the test knows the watcher saw the checkpoint incomplete). Each
finished checkpoint appends {"name": NAME, "complete": time.time()} to the log (JSON lines); the
last line is {"done": time.time()}.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

WAIT_S = 120  # the longest a midway waits for the watcher before giving up


def log(path: str, **event) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(event) + "\n")


def midway_of(plan: dict, item: dict):
    """The midway of a checkpoint: wait for its "wait_for" text in the watcher's output, or pause."""

    def wait() -> None:
        deadline = time.monotonic() + WAIT_S
        while "wait_for" in item and time.monotonic() < deadline:
            with open(plan["watch_output"], errors="replace") as handle:
                if item["wait_for"] in handle.read():
                    return
            time.sleep(0.05)
        if "wait_for" in item:
            sys.exit(f"watch_writer: {item['wait_for']!r} never appeared in {plan['watch_output']}")
        time.sleep(plan["pause"])

    return wait


def write_halves(src: str, dst: str, midway) -> None:
    """Copy src to dst in place: the first half, the midway (dst is truncated meanwhile), the rest."""
    with open(src, "rb") as handle:
        data = handle.read()
    with open(dst, "wb") as out:
        out.write(data[: len(data) // 2])
        out.flush()
        midway()
        out.write(data[len(data) // 2 :])


def weight_names(src: str) -> list[str]:
    return sorted(name for name in os.listdir(src) if name.endswith((".safetensors", ".pt")))


def other_names(src: str) -> list[str]:
    """The config first (trainers save it with or before the weights), then any index."""
    return sorted((name for name in os.listdir(src) if name not in weight_names(src)), key=lambda n: n != "config.json")


def copy(src: str, target: str, names: list[str]) -> None:
    for name in names:
        shutil.copyfile(os.path.join(src, name), os.path.join(target, name))


def atomic(src: str, run: str, name: str, plan: dict, midway) -> None:
    staging = os.path.join(run, f"tmp-{name}")
    os.makedirs(staging)
    for file in other_names(src) + weight_names(src):
        copy(src, staging, [file])
        time.sleep(plan["pause"])
    os.rename(staging, os.path.join(run, name))


def in_place(src: str, run: str, name: str, plan: dict, midway) -> None:
    target = os.path.join(run, name)
    os.makedirs(target)
    for file in other_names(src):
        copy(src, target, [file])
        time.sleep(plan["pause"])
    for file in weight_names(src):
        write_halves(os.path.join(src, file), os.path.join(target, file), midway)


def truncated(src: str, run: str, name: str, plan: dict, midway) -> None:
    target = os.path.join(run, name)
    os.makedirs(target)
    copy(src, target, ["config.json"])
    weights = weight_names(src)[0]
    with open(os.path.join(src, weights), "rb") as handle, open(os.path.join(target, weights), "wb") as out:
        out.write(handle.read(os.path.getsize(os.path.join(src, weights)) // 2))


def late_shard(src: str, run: str, name: str, plan: dict, midway) -> None:
    target = os.path.join(run, name)
    os.makedirs(target)
    *first, last = weight_names(src)
    copy(src, target, other_names(src) + first)
    midway()
    copy(src, target, [last])


def weight_file(src: str, run: str, name: str, plan: dict, midway, config: str) -> None:
    shutil.copyfile(config, os.path.join(run, "config.json"))
    write_halves(src, os.path.join(run, name), midway)


KINDS = {"atomic": atomic, "in_place": in_place, "truncated": truncated, "late_shard": late_shard}


def main(plan_path: str) -> None:
    with open(plan_path) as handle:
        plan = json.load(handle)
    os.makedirs(plan["run"], exist_ok=True)
    for item in plan["checkpoints"]:
        args = (item["src"], plan["run"], item["name"], plan, midway_of(plan, item))
        if item["kind"] == "file":
            weight_file(*args, item["config"])
        else:
            KINDS[item["kind"]](*args)
        if item["kind"] != "truncated":
            log(plan["log"], name=item["name"], complete=time.time())
    log(plan["log"], done=time.time())


if __name__ == "__main__":
    main(sys.argv[1])
