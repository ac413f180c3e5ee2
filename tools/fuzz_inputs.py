"""Damaged inputs, fuzzed (issue "Reliability under faults", item 5): flip random bytes in the
files `score` reads, truncate them, append garbage; every trial must end in a clear error naming
the damaged file, or in results identical to the undamaged run. Never a traceback, never
different numbers.

Built once: a tiny random Qwen3 target extracted into several small shards (each of several
record batches, with its .json sidecar), manifest.json and the target head; a drafter fitted to
them for 40 steps; the undamaged `score` results (chain + DDTree budget 4) as the reference.
Each trial copies the pristine extract, applies one damage, runs `specreplay score` in-process
(click's CliRunner, so a Python exception shows as `result.exception`) into a fresh --out, and
classifies:

  error     exit 2 (or 1 with a per-checkpoint `error:` line) whose message names the damaged
            file, no traceback: ok
  identical exit 0 and every results table (and what run.json says was scored) equal to the
            reference's: ok
  anything else (an exception, an error not naming the file, different numbers): a failure,
  printed with what reproduces it (`--seed S --only TRIAL`)

`score` reads the manifest's copy of the shard entries, never the sidecars; so each trial also
lists the sidecars as extract's resume does (finished_shard_entries), with the same verdicts.

Damage kinds: flip-<region> (1-4 consecutive bytes, each XORed with a random nonzero byte) for
the regions shard-body (record batches), shard-schema (the magic and schema message at the
start), shard-footer (the Arrow footer at the end), sidecar (a shard's .json), manifest,
head-header (the target head's length and JSON header), head-data (its tensors); truncate (any
of those files at a random point); append (1-64 random bytes at the end of one).

    .venv/bin/python tools/fuzz_inputs.py --trials 1000          # `make fuzz`: prints the tally
    .venv/bin/python tools/fuzz_inputs.py --seed 7 --only 123 -v # one trial again, verbose
tests/faults/test_fuzz.py runs a fixed-seed subset in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the product and tests.helpers (the tiny target's builders)
    sys.path.insert(0, str(REPO))

REGIONS = ["shard-body", "shard-schema", "shard-footer", "sidecar", "manifest", "head-header", "head-data"]
KINDS = [f"flip-{region}" for region in REGIONS] + ["truncate", "append"]
RESULT_TABLES = ["anchors", "walk", "samples", "summary"]
# run.json facts that must not change with a damage the reader tolerates (wall time, the command
# and the extract's path may: every trial scores its own copy)
RUN_FACTS = ["checkpoint", "shards", "ddtree_budgets", "anchor_set", "selection", "anchors"]
SCORE_ARGS = ["--ddtree-budgets", "4", "--device", "cpu", "--quiet"]


@dataclass
class Pristine:
    shards: str  # the undamaged extract directory
    ckpt: str  # the drafter checkpoint
    reference: dict  # table name -> pyarrow Table of the undamaged results
    run_facts: dict  # the run.json facts compared
    files: dict[str, list[str]]  # role -> paths relative to `shards`
    regions: dict[str, dict]  # relative shard path -> {"schema": (start, end), "body": ..., "footer": ...}
    listing: list[dict]  # finished_shard_entries of the undamaged extract (the sidecars, as resume reads them)


@dataclass
class Damage:
    kind: str
    file: str  # relative to the extract directory
    offset: int
    detail: str  # what was done, for the reproduction line


@dataclass
class Outcome:
    trial: int
    damage: Damage
    verdict: str  # of `score`: "error", "identical" (both ok) or "failure: ..."
    message: str
    listing: str  # of the sidecar listing extract's resume reads (finished_shard_entries), the same words
    listing_message: str

    @property
    def ok(self) -> bool:
        return not self.verdict.startswith("failure") and not self.listing.startswith("failure")


# --------------------------------------------------------------------------------------------
# the pristine extract and its reference results


def build_pristine(work: Path, prompts: int = 8, max_new_tokens: int = 12) -> Pristine:
    """Tiny target, several shards of several record batches each, a drafter fitted to them (so
    it accepts tokens and damaged features or tokens would change the numbers), the reference."""
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.run import run_extract
    from pipeline.shards import MANIFEST_NAME, TARGET_HEAD_NAME, ShardSet, finished_shard_entries
    from tests.helpers.drafters import fitted_drafters
    from tests.helpers.models import build_tiny_qwen3
    from tests.helpers.prompts import write_prompts

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = build_tiny_qwen3(work / "target")
    records = [{"id": f"q{i}", "prompt": f"Question {i}: what is {i} + {i}? Say it twice."} for i in range(prompts)]
    shards = str(work / "shards")
    run_extract(
        ExtractConfig(
            model=model,
            prompts=write_prompts(work / "prompts.jsonl", records),
            out=shards,
            max_new_tokens=max_new_tokens,
            layer_ids=[1, 3],
            top_k=8,
            dtype="fp32",
            shard_bytes=48 << 10,  # several shards
            memory_bytes=192 << 10,  # chunks of a few samples: several record batches a shard
            quiet=True,
        )
    )
    (ckpt,) = fitted_drafters(shards, work / "drafter", block_size=4, layer_ids=[1, 3], steps=40, anchors_per_step=32)
    shardset = ShardSet(shards)
    entries = shardset.entries
    files = {
        "shard": [e["file"] for e in entries],
        "sidecar": [e["file"][: -len(".arrow")] + ".json" for e in entries],
        "manifest": [MANIFEST_NAME],
        "head": [TARGET_HEAD_NAME],
    }
    regions = {}
    for entry in entries:
        schema_start, schema_len = entry["schema_block"][:2]
        body_start = entry["batches"][0][0]
        body_end = entry["batches"][-1][0] + entry["batches"][-1][1]
        regions[entry["file"]] = {
            "schema": (0, schema_start + schema_len),  # the file magic, then the schema message
            "body": (body_start, body_end),
            "footer": (body_end, entry["bytes"]),
        }
    head_path = Path(shards) / TARGET_HEAD_NAME
    with open(head_path, "rb") as f:
        header_end = 8 + int.from_bytes(f.read(8), "little")
    regions[TARGET_HEAD_NAME] = {"header": (0, header_end), "data": (header_end, head_path.stat().st_size)}
    out = work / "reference"
    result = run_score(shards, ckpt, str(out))
    if result.exit_code != 0:
        raise RuntimeError(f"the undamaged score failed: {result.output}")
    tables, facts = read_results(out)
    if len(entries) < 2 or any(len(e["batches"]) < 2 for e in entries):
        raise RuntimeError(f"wanted several shards of several batches, got {[len(e['batches']) for e in entries]}")
    return Pristine(shards, ckpt, tables, facts, files, regions, finished_shard_entries(shards))


def run_score(shards: str, ckpt: str, out: str):
    from click.testing import CliRunner

    from specreplay.cli import main

    return CliRunner().invoke(
        main, ["score", "--ckpt", ckpt, "--shards", shards, "--out", out, *SCORE_ARGS], catch_exceptions=True
    )


def read_results(out: Path) -> tuple[dict, dict]:
    """The results tables (wall-time columns dropped) and the run.json facts compared."""
    import pyarrow.parquet as pq

    from scoring import results

    (directory,) = [p for p in out.iterdir() if p.is_dir()]
    tables = {}
    for name in RESULT_TABLES:
        table = pq.read_table(directory / results.FILES[name])
        keep = [c for c in table.column_names if "wall" not in c and "seconds" not in c]
        tables[name] = table.select(keep).replace_schema_metadata(None)
    record = json.loads((directory / "run.json").read_text())
    facts = {key: record.get(key) for key in RUN_FACTS}
    facts["shards"] = {k: v for k, v in (facts["shards"] or {}).items() if k != "uri"}
    return tables, facts


# --------------------------------------------------------------------------------------------
# damage


def choose_damage(rng: random.Random, pristine: Pristine) -> Damage:
    kind = rng.choice(KINDS)
    if kind == "truncate" or kind == "append":
        role = rng.choice(["shard", "shard", "sidecar", "manifest", "head"])
        file = rng.choice(pristine.files[role])
        size = os.path.getsize(os.path.join(pristine.shards, file))
        if kind == "truncate":
            offset = rng.randrange(size)
            return Damage(kind, file, offset, f"truncated to {offset} of {size} bytes")
        garbage = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        return Damage(kind, file, size, f"appended {garbage.hex()}")
    region = kind[len("flip-") :]
    if region.startswith("shard-"):
        file = rng.choice(pristine.files["shard"])
        start, end = pristine.regions[file][region[len("shard-") :]]
    elif region.startswith("head-"):
        file = pristine.files["head"][0]
        start, end = pristine.regions[file][region[len("head-") :]]
    else:
        file = rng.choice(pristine.files[region])
        start, end = 0, os.path.getsize(os.path.join(pristine.shards, file))
    count = rng.randint(1, 4)
    offset = rng.randrange(start, max(start + 1, end - count + 1))
    flips = [(min(offset + i, end - 1), rng.randrange(1, 256)) for i in range(count)]
    detail = " ".join(f"{at}^{mask:02x}" for at, mask in flips)
    return Damage(kind, file, offset, f"xor {detail}")


def apply_damage(root: str, damage: Damage) -> None:
    path = os.path.join(root, damage.file)
    data = bytearray(Path(path).read_bytes())
    if damage.kind == "truncate":
        data = data[: damage.offset]
    elif damage.kind == "append":
        data += bytes.fromhex(damage.detail.split()[-1])
    else:
        for item in damage.detail.split()[1:]:
            at, mask = item.split("^")
            data[int(at)] ^= int(mask, 16)
    Path(path).write_bytes(bytes(data))


# --------------------------------------------------------------------------------------------
# trials


def classify(result, damage: Damage, out: Path, pristine: Pristine) -> tuple[str, str]:
    output = result.output or ""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        trace = "".join(traceback.format_exception(result.exception))
        return "failure: exception", trace[-3000:]
    if "Traceback" in output:
        return "failure: traceback printed", output[-3000:]
    name = os.path.basename(damage.file)
    if result.exit_code in (1, 2):
        errors = [line for line in output.splitlines() if "error:" in line]
        if not errors:
            return "failure: exit without an error line", output[-3000:]
        if not any(name in line for line in errors):
            return f"failure: error does not name {name}", "\n".join(errors)[-3000:]
        return "error", "\n".join(errors)[-600:]
    if result.exit_code != 0:
        return f"failure: exit code {result.exit_code}", output[-3000:]
    try:
        tables, facts = read_results(out)
    except Exception as error:  # noqa: BLE001 - reported as the trial's failure
        return "failure: results unreadable", repr(error)
    for table_name, table in pristine.reference.items():
        if not same(tables[table_name].to_pylist(), table.to_pylist()):
            return f"failure: {table_name} differs", output[-600:]
    if facts != pristine.run_facts:
        differ = [key for key in RUN_FACTS if facts.get(key) != pristine.run_facts.get(key)]
        return f"failure: run.json differs in {differ}", output[-600:]
    return "identical", ""


def classify_listing(shards: str, damage: Damage, pristine: Pristine) -> tuple[str, str]:
    """The sidecars as extract's resume and `inspect` of an unfinished extract read them (`score`
    reads the manifest's copy of the entries): an error naming the damaged file, or the same entries."""
    import traceback

    from pipeline.shards import ShardError, finished_shard_entries

    try:
        entries = finished_shard_entries(shards)
    except ShardError as error:
        if os.path.basename(damage.file) not in str(error):
            return f"failure: listing error does not name {os.path.basename(damage.file)}", str(error)
        return "error", str(error)[-600:]
    except Exception as error:  # noqa: BLE001 - reported as the trial's failure
        return "failure: listing exception", "".join(traceback.format_exception(error))[-3000:]
    if not same(entries, pristine.listing):
        return "failure: listing differs", ""
    return "identical", ""


def same(a, b) -> bool:
    """Equal values, NaN equal to NaN (results hold NaN where a position was never reached)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def run_trial(pristine: Pristine, seed: int, trial: int, scratch: Path) -> Outcome:
    rng = random.Random(f"{seed}/{trial}")
    damage = choose_damage(rng, pristine)
    root = scratch / f"t{trial}"
    shards = root / "shards"
    shutil.copytree(pristine.shards, shards, ignore=shutil.ignore_patterns("tokenizer"))
    apply_damage(str(shards), damage)
    out = root / "results"
    result = run_score(str(shards), pristine.ckpt, str(out))
    verdict, message = classify(result, damage, out, pristine)
    listing, listing_message = classify_listing(str(shards), damage, pristine)
    shutil.rmtree(root, ignore_errors=True)
    return Outcome(trial, damage, verdict, message, listing, listing_message)


def run_trials(pristine: Pristine, seed: int, trials, scratch: Path, on_outcome=None) -> list[Outcome]:
    outcomes = []
    for trial in trials:
        outcome = run_trial(pristine, seed, trial, scratch)
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)
    return outcomes


def tally(outcomes: list[Outcome]) -> str:
    """Per damage kind: trials; what `score` did (a clear error, identical results, a failure);
    what the sidecar listing did; and the trials that failed either."""
    rows = defaultdict(Counter)
    for outcome in outcomes:
        for kind in (outcome.damage.kind, "(all)"):
            row = rows[kind]
            row["trials"] += 1
            row["score " + outcome.verdict.split(":")[0]] += 1
            row["listing " + outcome.listing.split(":")[0]] += 1
            row["failed"] += not outcome.ok
    columns = [f"{stage} {what}" for stage in ("score", "listing") for what in ("error", "identical", "failure")]
    header = f"{'damage':<18} {'trials':>6}  {'score: error identical failure':>31}  {'listing: error identical failure':>33}  {'failed':>6}"
    lines = [header]
    for kind in [*KINDS, "(all)"]:
        if kind in rows:
            row = rows[kind]
            score, listing = ([row[c] for c in columns[i : i + 3]] for i in (0, 3))
            lines.append(
                f"{kind:<18} {row['trials']:>6}  {score[0]:>14} {score[1]:>9} {score[2]:>7}"
                f"  {listing[0]:>16} {listing[1]:>9} {listing[2]:>7}  {row['failed']:>6}"
            )
    return "\n".join(lines)


def describe(outcome: Outcome, seed: int) -> str:
    d = outcome.damage
    return (
        f"trial {outcome.trial} (--seed {seed} --only {outcome.trial}): {d.kind} {d.file} at {d.offset}: "
        f"{d.detail[:120]} -> score {outcome.verdict}, listing {outcome.listing}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, action="append", help="run just this trial number (repeatable)")
    parser.add_argument("--work", default=None, help="keep the pristine extract here (default: a temporary dir)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every trial and each failure's output")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from transformers.utils import logging as transformers_logging

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    transformers_logging.disable_progress_bar()  # building the tiny target, not news
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="specreplay-fuzz-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        pristine = build_pristine(work / "pristine")
        built = time.monotonic() - started
        trials = args.only or range(args.trials)

        def report(outcome: Outcome) -> None:
            if args.verbose or not outcome.ok:
                print(describe(outcome, args.seed), flush=True)
                for message in (outcome.message, outcome.listing_message):
                    if message:
                        print("    " + message.replace("\n", "\n    "), flush=True)

        outcomes = run_trials(pristine, args.seed, trials, work / "trials", report)
    failures = [o for o in outcomes if not o.ok]
    wall = time.monotonic() - started
    print(tally(outcomes))
    print(
        f"{len(outcomes)} trials (seed {args.seed}), {len(failures)} failures; "
        f"{wall:.0f} s wall ({built:.0f} s building the extract and the reference)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
