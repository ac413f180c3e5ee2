"""Rebuild the bundled prompt sets in this folder from the raw benchmark files.

    .venv/bin/python data/prompts/build_prompts.py [RAW_DIR]   (default RAW_DIR: ../shared/datasets)

Writes humaneval.jsonl.gz, gsm8k.jsonl.gz ({"id", "prompt"} per line), mt-bench.jsonl.gz
({"id", "turns"}: both user turns, the second answered after the target's own first answer),
spec-bench.jsonl.gz ({"id", "dataset", "prompt"} or, for its MT-Bench questions, "turns": each
category a dataset) and copies the licence files. The prompt formats are those of the public DFlash benchmark
(z-lab/dflash `benchmark.py`), so acceptance numbers compare with published ones. Output is
byte-for-byte reproducible (gzip mtime 0, fixed key order).
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_RAW_DIR = HERE.parents[2] / "shared" / "datasets"

GSM8K_FORMAT = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
HUMANEVAL_FORMAT = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)
LICENCES = {
    "LICENSE.humaneval": "LICENSE.humaneval",
    "LICENSE.gsm8k": "LICENSE.gsm8k",
    "LICENSE.mt_bench": "LICENSE.mt-bench",
    "LICENSE.spec_bench": "LICENSE.spec-bench",
}


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_jsonl_gz(path: Path, records: list[dict]) -> None:
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    buffer = io.BytesIO()
    # mtime=0 and no file name in the header: the same input gives the same bytes.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as handle:
        handle.write(text.encode("utf-8"))
    path.write_bytes(buffer.getvalue())


def humaneval(raw_dir: Path) -> list[dict]:
    rows = read_jsonl(raw_dir / "humaneval.jsonl.gz")
    # Row i is task HumanEval/i; the id keeps that number, zero-padded so ids sort in file order.
    return [
        {
            "id": f"humaneval/{int(row['task_id'].split('/')[1]):04d}",
            "prompt": HUMANEVAL_FORMAT.format(prompt=row["prompt"]),
        }
        for row in rows
    ]


def gsm8k(raw_dir: Path) -> list[dict]:
    rows = read_jsonl(raw_dir / "gsm8k_test.jsonl")
    return [
        {"id": f"gsm8k/{i:04d}", "prompt": GSM8K_FORMAT.format(question=row["question"])} for i, row in enumerate(rows)
    ]


def user_turns(row: dict) -> dict:
    """A question's user turns: "turns" when there are several (extract answers each in turn,
    the target's own earlier answers fed back, as the DFlash benchmark runs MT-Bench), else "prompt"."""
    return {"turns": row["turns"]} if len(row["turns"]) > 1 else {"prompt": row["turns"][0]}


def mt_bench(raw_dir: Path) -> list[dict]:
    rows = read_jsonl(raw_dir / "mt_bench_questions.jsonl")
    return [{"id": f"mt-bench/{row['question_id']}", **user_turns(row)} for row in rows]


def spec_bench(raw_dir: Path) -> list[dict]:
    rows = read_jsonl(raw_dir / "spec_bench_questions.jsonl")
    # Each category its own dataset in the results; its MT-Bench questions two turns, as mt-bench's.
    return [
        {"id": f"spec-bench/{row['question_id']}", "dataset": f"spec-bench/{row['category']}", **user_turns(row)}
        for row in rows
    ]


def main(raw_dir: Path, out_dir: Path = HERE) -> None:
    builds = (("humaneval", humaneval), ("gsm8k", gsm8k), ("mt-bench", mt_bench), ("spec-bench", spec_bench))
    for name, build in builds:
        records = build(raw_dir)
        write_jsonl_gz(out_dir / f"{name}.jsonl.gz", records)
        print(f"{name}: {len(records)} prompts")
    for source, target in LICENCES.items():
        shutil.copyfile(raw_dir / source, out_dir / target)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_RAW_DIR)
