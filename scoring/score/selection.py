"""Which samples `score` replays: all of them, the first N, a seeded sample stratified by
dataset, or only some datasets.

`--limit N` keeps the first N in manifest order, which are often all one dataset (extract
writes prompt sets one after another); `--sample N --seed S` draws N spread over the datasets
in proportion to their sizes, so a quick score looks like the full one. The selection is
recorded in run.json (`selection`, with a hash of the chosen sample ids), which is how a later
`score` into the same directory knows whether it would redo the same work.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass

import numpy as np

from pipeline.common.errors import UserError
from pipeline.shards import ShardSet, read_shard


@dataclass(frozen=True)
class Selection:
    limit: int | None = None  # the first N (after --datasets)
    sample: int | None = None  # N drawn at random, stratified by dataset
    seed: int = 0
    datasets: tuple[str, ...] | None = None  # only these datasets


_INDEX: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ShardSet -> its sample index


def sample_index(shardset: ShardSet) -> list[tuple[str, str]]:
    """(sample_id, dataset) of every sample in manifest order. From the shard entries when they
    list datasets (extracts since specreplay 0.4); older ones are read once per ShardSet (no
    tensor is decoded), not once per checkpoint scored against it."""
    if shardset not in _INDEX:
        _INDEX[shardset] = _read_index(shardset)
    return _INDEX[shardset]


def _read_index(shardset: ShardSet) -> list[tuple[str, str]]:
    index = []
    for entry in shardset.entries:
        datasets = entry.get("datasets")
        if datasets is None:
            datasets = [s.dataset for s in read_shard(shardset.uri, entry, shardset.tensor_dtypes, tensors=[])]
        index.extend(zip(entry["sample_ids"], datasets))
    return index


def stratified_counts(sizes: dict[str, int], n: int) -> dict[str, int]:
    """n split over datasets in proportion to their sizes (largest remainder; ties by name)."""
    total = sum(sizes.values())
    exact = {name: n * size / total for name, size in sizes.items()}
    counts = {name: int(value) for name, value in exact.items()}
    by_remainder = sorted(sizes, key=lambda name: (-(exact[name] - counts[name]), name))
    for name in by_remainder[: n - sum(counts.values())]:
        counts[name] += 1
    return counts


def _check(selection: Selection, available: list[str]) -> None:
    if selection.limit is not None and selection.sample is not None:
        raise UserError("--limit and --sample both given: --limit takes the first N, --sample draws N; pick one")
    for option, value in (("--limit", selection.limit), ("--sample", selection.sample)):
        if value is not None and value < 1:
            raise UserError(f"{option} {value}: expected a number of samples >= 1")
    unknown = sorted(set(selection.datasets or ()) - set(available))
    if unknown:
        raise UserError(
            f"--datasets: no dataset named {', '.join(unknown)} in the shards; they hold {', '.join(available)}"
        )


def select_samples(index: list[tuple[str, str]], selection: Selection) -> list[int]:
    """Indices (manifest order, ascending) of the samples to replay."""
    available = sorted({dataset for _, dataset in index})
    _check(selection, available)
    wanted = set(selection.datasets) if selection.datasets else set(available)
    chosen = [i for i, (_, dataset) in enumerate(index) if dataset in wanted]
    if selection.limit is not None:
        return chosen[: selection.limit]
    if selection.sample is None or selection.sample >= len(chosen):
        return chosen
    by_dataset: dict[str, list[int]] = {}
    for i in chosen:
        by_dataset.setdefault(index[i][1], []).append(i)
    counts = stratified_counts({name: len(ids) for name, ids in by_dataset.items()}, selection.sample)
    rng = np.random.default_rng(selection.seed)
    picked = [int(i) for name in sorted(by_dataset) for i in rng.choice(by_dataset[name], counts[name], replace=False)]
    return sorted(picked)


def selection_record(selection: Selection, index: list[tuple[str, str]], chosen: list[int]) -> dict:
    """run.json's `selection`: the options and a hash of the sample ids they chose."""
    ids = "\n".join(index[i][0] for i in chosen)
    return {
        "limit": selection.limit,
        "sample": selection.sample,
        "seed": selection.seed if selection.sample is not None else None,
        "datasets": list(selection.datasets) if selection.datasets else None,
        "samples": len(chosen),
        "ids_hash": hashlib.sha256(ids.encode()).hexdigest()[:16],
    }
