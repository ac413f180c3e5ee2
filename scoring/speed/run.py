"""`specreplay speed`: the predicted speed of every configuration in results directories, from a
cost profile (profile.py, predict.py); speed.parquet and the console table around it."""

from __future__ import annotations

import os
from dataclasses import replace

import pyarrow.parquet as pq

from pipeline.common.errors import UserError
from pipeline.shards import ShardSet
from scoring import results
from scoring.methods.chain import CHAIN
from scoring.speed.predict import Configuration, Prediction, configurations, predict, walk_drafted
from scoring.speed.profile import Profile


def target_facts(record: dict, directory: str) -> dict:
    """The target's sizes a result was scored against: run.json's, else its shards' manifest."""
    facts = record["shards"].get("target_facts")
    if facts:
        return facts
    uri = record["shards"].get("uri")
    try:
        return ShardSet(uri).manifest["settings"]["target"]
    except (UserError, OSError, KeyError, TypeError):  # moved, deleted or unreadable: no check, said so
        raise UserError(
            f"{directory}: its run.json does not record the target's sizes and its shards ({uri}) are not readable; "
            "rescore it (`specreplay score --force`) to check a speed profile against its target"
        ) from None


def result_configurations(directory: str, profile: Profile) -> list[Configuration]:
    """The configurations of one results directory, after checking the profile's target is its."""
    record = results.read_run_record(directory)
    if record is None:
        raise UserError(f"{directory}: no {results.FILES['run']}; score the checkpoint first")
    profile.check_target(target_facts(record, directory), f"the shards of {directory}")
    summary = pq.read_table(os.path.join(directory, results.FILES["summary"])).to_pylist()
    name = record["checkpoint"].get("name") or os.path.basename(os.path.normpath(directory))
    drafted = walk_drafted(directory)
    found = [replace(c, drafted=drafted) if c.method == CHAIN else c for c in configurations(summary, record, name)]
    if not found:
        raise UserError(f"{directory}: no pooled chain tau in {results.FILES['summary']}; nothing to predict")
    return found


def predict_results(
    paths: list[str], profile: Profile, batches: list[int] | None = None, methods: list[str] | None = None
) -> list[Prediction]:
    """Every configuration (of `methods`, when given) of every results directory under `paths`,
    at each batch size."""
    directories = [d for path in paths for d in results.results_dirs_below(path)]
    if not directories:
        raise UserError(f"no results directory (with {results.FILES['summary']}) under {', '.join(paths)}")
    configs = [c for directory in directories for c in result_configurations(directory, profile)]
    kept = [c for c in configs if not methods or c.method in methods]
    if not kept:
        raise UserError(f"no scored configuration is one of {', '.join(methods)} under {', '.join(paths)}")
    return predict(profile, kept, batches)


def fastest_line(directory: str, profile: Profile) -> str:
    """'predicted speedup: batch 1 2.31x (ddtree-16), batch 8 1.12x (chain)': the fastest
    configuration of one result per measured batch size (score's headline with --profile)."""
    from scoring.speed.predict import best_per_batch

    best = best_per_batch(predict(profile, result_configurations(directory, profile)))
    parts = [f"batch {b} {p.speedup:.2f}x ({p.method})" for b, p in sorted(best.items())]
    return f"predicted speedup ({profile.source}): " + ", ".join(parts)
