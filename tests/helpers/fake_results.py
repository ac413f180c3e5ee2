"""Results directories as `specreplay score` writes them, built from the declared schemas in
scoring/results.py, for the compare and report tests. A column renamed or retyped there changes
these fakes too; a fake column the schema lacks is an error."""

from __future__ import annotations

import json
import os

from scoring import results


def write_fake_results(
    directory,
    identity: dict,
    samples: list[dict],
    summary: list[dict],
    walk: list[dict] | None = None,
    run: dict | None = None,
) -> str:
    """Write samples.parquet, summary.parquet, optionally walk.parquet and run.json. Rows give
    the non-identity columns (missing ones are null); `identity` fills checkpoint,
    checkpoint_hash and checkpoint_step on every row."""
    os.makedirs(directory, exist_ok=True)
    tables = {"samples": (samples, results.samples_schema()), "summary": (summary, results.summary_schema())}
    if walk is not None:
        tables["walk"] = (walk, results.walk_schema())
    for kind, (rows, schema) in tables.items():
        results.write_table(results.rows_table([{**identity, **row} for row in rows], schema), str(directory), kind)
    if run is not None:
        with open(os.path.join(directory, results.FILES["run"]), "w") as f:
            json.dump(run, f)
    return str(directory)
