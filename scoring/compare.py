"""`specreplay compare A B`: is checkpoint B better than checkpoint A, by how much, and is it real?

Definitions (A and B are two results directories written by `specreplay score`):

- A sample's tau is its `tau` in samples.parquet: mean tokens produced per walk step
  (accepted draft tokens + the target's bonus token), null when the sample had no step.
- Samples are paired by (dataset, sample_id). A pair where either tau is null is dropped and
  counted in `dropped_null`; samples present in only one run are counted in `unmatched`.
- `tau_a`, `tau_b`: mean over the n paired samples of per-sample tau (the README's tau,
  restricted to the pairs, so it can differ from summary.parquet when samples were dropped).
- `delta` = tau_b - tau_a. `ci_low`, `ci_high`: paired percentile-bootstrap interval: resample
  the n pairs with replacement, recompute mean(tau_b) - mean(tau_a), take the
  (1 - confidence) / 2 and (1 + confidence) / 2 quantiles over the resamples.
- Dataset `(all)` pools every pair of every dataset (as summary.parquet's `(all)` does).
- Verdict: B (A) is better when the whole interval lies above (below) zero; otherwise no
  significant difference.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import polars as pl

from pipeline.errors import UserError
from scoring import results
from scoring.results import ALL_DATASETS

REQUIRED_COLUMNS = ("dataset", "sample_id", "method", "tau")  # of results.SAMPLES, what pairing needs
OUTPUT_SCHEMA = {
    "dataset": pl.String,
    "method": pl.String,
    "n": pl.Int64,
    "tau_a": pl.Float64,
    "tau_b": pl.Float64,
    "delta": pl.Float64,
    "ci_low": pl.Float64,
    "ci_high": pl.Float64,
    "verdict": pl.String,
    "dropped_null": pl.Int64,
    "unmatched": pl.Int64,
    "checkpoint_a": pl.String,
    "checkpoint_b": pl.String,
}
# indices drawn per bootstrap chunk: bounds memory at ~32 MiB of int64 whatever n and resamples are
_CHUNK_ELEMENTS = 1 << 22


class CompareError(UserError):
    """The inputs cannot be compared; the message names the file or field and the fix."""


class ShardsDifferWarning(UserWarning):
    """A and B were not scored on the same shards (or that cannot be checked)."""


def paired_bootstrap(
    a: np.ndarray, b: np.ndarray, resamples: int = 2000, seed: int = 0, confidence: float = 0.95
) -> tuple[float, float, float]:
    """(delta, low, high) for delta = mean(b) - mean(a) over paired samples a[i], b[i].

    The interval is the paired percentile bootstrap: an index matrix [resamples, n] drawn
    with replacement (numpy, seeded; chunked over resamples to bound memory), the mean of
    b - a on each resample, and its (1 - confidence) / 2 and (1 + confidence) / 2 quantiles.
    mean(b[idx]) - mean(a[idx]) equals mean((b - a)[idx]), so the differences are resampled.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(
            f"a and b must be 1-d arrays of the same length (paired samples); got shapes {a.shape} and {b.shape}"
        )
    if a.size == 0:
        raise ValueError("no paired samples to compare (a and b are empty)")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("a and b must be finite; drop samples with a null/NaN tau before bootstrapping")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be between 0 and 1 (e.g. 0.95); got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1 (e.g. 2000); got {resamples}")
    diff = b - a
    n = diff.size
    rng = np.random.default_rng(seed)
    chunk = max(1, _CHUNK_ELEMENTS // n)
    means = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        index = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = diff[index].mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(diff.mean()), float(low), float(high)


def _digits(*values: float) -> int:
    """Decimals that show the smallest nonzero magnitude among values (2 at least, 4 at most)."""
    digits = 2
    smallest = min((abs(v) for v in values if v), default=1.0)
    while digits < 4 and round(smallest, digits) == 0:
        digits += 1
    return digits


def verdict(delta: float, low: float, high: float, confidence: float = 0.95, n: int | None = None) -> str:
    """Plain words for a B - A interval: 'B is better by 0.31 tau, 95% CI 0.22 to 0.40' when low > 0;
    'A is better by ...' (the interval of A - B) when high < 0; otherwise 'no significant
    difference (B - A = ..., 95% CI ... to ...)'. n < 2 pairs cannot support a verdict."""
    level = f"{confidence * 100:g}%"
    if n is not None and n < 2:
        return f"too few paired samples to judge (n = {n})"
    d = _digits(delta, low, high)
    if low > 0:
        return f"B is better by {delta:.{d}f} tau, {level} CI {low:.{d}f} to {high:.{d}f}"
    if high < 0:
        return f"A is better by {-delta:.{d}f} tau, {level} CI {-high:.{d}f} to {-low:.{d}f}"
    return f"no significant difference (B - A = {delta:.{d}f}, {level} CI {low:.{d}f} to {high:.{d}f})"


def _results_children(path: str) -> list[str]:
    """Subdirectories of path that hold a samples.parquet (to suggest in an error)."""
    try:
        entries = sorted(os.listdir(path))
    except OSError:
        return []
    return [os.path.join(path, e) for e in entries if os.path.isfile(os.path.join(path, e, results.FILES["samples"]))]


def load_results(path: str, label: str) -> tuple[pl.DataFrame, dict | None]:
    """(samples, run record or None) of one results directory; CompareError when it is not one."""
    if not os.path.isdir(path):
        raise CompareError(
            f"{label}: {path} is not a directory; pass a results directory written by "
            f"`specreplay score` (one holding samples.parquet and summary.parquet)"
        )
    samples_path = os.path.join(path, results.FILES["samples"])
    if not os.path.isfile(samples_path):
        children = _results_children(path)
        hint = (
            f"; it holds results directories, pass one of them: {', '.join(children)}"
            if children
            else "; pass a results directory written by `specreplay score` (the --out of one checkpoint, "
            "or one --out/<checkpoint> subdirectory when several were scored)"
        )
        raise CompareError(f"{label}: {samples_path} not found{hint}")
    try:
        samples = pl.read_parquet(samples_path)
    except Exception as error:  # noqa: BLE001 - polars raises several types for a bad file
        raise CompareError(
            f"{label}: cannot read {samples_path} ({error}); rescore that checkpoint with `specreplay score --force`"
        ) from error
    missing = [c for c in REQUIRED_COLUMNS if c not in samples.columns]
    if missing:
        raise CompareError(
            f"{label}: {samples_path} lacks column(s) {missing}; it is not a `specreplay score` "
            f"samples table (rescore with `specreplay score --force`)"
        )
    duplicated = samples.select("dataset", "sample_id", "method").is_duplicated()
    if duplicated.any():
        row = samples.filter(duplicated).row(0, named=True)
        raise CompareError(
            f"{label}: {samples_path} has several rows for dataset {row['dataset']!r}, sample "
            f"{row['sample_id']!r}, method {row['method']!r}; it must hold one checkpoint's "
            f"results (one row per sample and method)"
        )
    run_path = os.path.join(path, results.FILES["run"])
    record = None
    if os.path.isfile(run_path):
        try:
            with open(run_path) as f:
                record = json.load(f)
        except (OSError, ValueError) as error:
            raise CompareError(
                f"{label}: cannot read {run_path} ({error}); rescore that checkpoint with "
                f"`specreplay score --force`, or delete run.json to compare without the shards "
                f"check"
            ) from error
    return samples, record


def checkpoint_name(samples: pl.DataFrame, record: dict | None, path: str) -> str:
    """Display name of the checkpoint behind a results directory."""
    if "checkpoint" in samples.columns and samples.height:
        names = samples["checkpoint"].unique().to_list()
        if len(names) == 1 and names[0]:
            return str(names[0])
    if record and record.get("checkpoint", {}).get("name"):
        return str(record["checkpoint"]["name"])
    return os.path.basename(os.path.normpath(path))


def _check_shards(record_a: dict | None, record_b: dict | None, dir_a: str, dir_b: str) -> None:
    missing = [os.path.join(d, results.FILES["run"]) for d, r in ((dir_a, record_a), (dir_b, record_b)) if r is None]
    if missing:
        warnings.warn(
            f"cannot check that A and B were scored on the same shards: {', '.join(missing)} not found",
            ShardsDifferWarning,
            stacklevel=3,
        )
        return
    shards_a, shards_b = record_a.get("shards", {}), record_b.get("shards", {})
    if shards_a.get("identity") != shards_b.get("identity"):
        warnings.warn(
            f"A and B were scored on different shards (run.json shards.identity: A {shards_a.get('identity')} "
            f"from {shards_a.get('uri')}, B {shards_b.get('identity')} from {shards_b.get('uri')}); samples are "
            f"matched by (dataset, sample_id), so a matched pair may hold different prompts or responses. "
            f"For a clean comparison score both checkpoints on the same --shards.",
            ShardsDifferWarning,
            stacklevel=3,
        )


def _select(requested: list[str] | None, available: list[str], what: str, option: str) -> list[str]:
    if not requested:
        return available
    unknown = [r for r in requested if r not in available]
    if unknown:
        raise CompareError(f"{option} {unknown[0]!r}: no such {what} in both runs; choose from {available}")
    return [a for a in available if a in requested]


def compare_results(
    dir_a: str,
    dir_b: str,
    methods: list[str] | None = None,
    datasets: list[str] | None = None,
    resamples: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> pl.DataFrame:
    """One row per (dataset, method) present in both A and B, plus dataset '(all)', with the
    columns of OUTPUT_SCHEMA (definitions in the module docstring). `methods` / `datasets`
    keep only those rows ('(all)' always pools every dataset). Warns (ShardsDifferWarning) when
    A and B were scored on different shards; raises CompareError when nothing pairs up."""
    if not 0.0 < confidence < 1.0:
        raise CompareError(f"--confidence must be between 0 and 1 (e.g. 0.95); got {confidence}")
    if resamples < 1:
        raise CompareError(f"--resamples must be >= 1 (e.g. 2000); got {resamples}")
    samples_a, record_a = load_results(dir_a, "A")
    samples_b, record_b = load_results(dir_b, "B")
    _check_shards(record_a, record_b, dir_a, dir_b)
    _check_overlap(samples_a, samples_b, dir_a, dir_b)
    chosen_methods = _common_methods(samples_a, samples_b, methods)
    joined = _join(samples_a, samples_b, chosen_methods)
    shared = joined.filter(pl.col("in_a") & pl.col("in_b"))
    chosen_datasets = _select(
        datasets, sorted(shared["dataset"].unique().to_list()) + [ALL_DATASETS], "dataset", "--dataset"
    )
    names = {
        "checkpoint_a": checkpoint_name(samples_a, record_a, dir_a),
        "checkpoint_b": checkpoint_name(samples_b, record_b, dir_b),
    }
    rows = []
    for dataset in chosen_datasets:
        subset = joined if dataset == ALL_DATASETS else joined.filter(pl.col("dataset") == dataset)
        for method in chosen_methods:
            row = compare_pairs(subset.filter(pl.col("method") == method), resamples, seed, confidence)
            rows.append({"dataset": dataset, "method": method, **row, **names})
    return pl.DataFrame(rows, schema=OUTPUT_SCHEMA)


KEYS = ["dataset", "sample_id"]


def _check_overlap(samples_a: pl.DataFrame, samples_b: pl.DataFrame, dir_a: str, dir_b: str) -> None:
    ids_a, ids_b = samples_a.select(KEYS).unique(), samples_b.select(KEYS).unique()
    if ids_a.join(ids_b, on=KEYS, how="inner").height == 0:
        same_ids = set(ids_a["sample_id"].to_list()) & set(ids_b["sample_id"].to_list())
        hint = f" ({len(same_ids)} sample ids match but under different dataset names)" if same_ids else ""
        raise CompareError(
            f"no sample of A ({dir_a}) matches a sample of B ({dir_b}) by (dataset, sample_id){hint}; "
            f"score both checkpoints on the same --shards"
        )


def _common_methods(samples_a: pl.DataFrame, samples_b: pl.DataFrame, methods: list[str] | None) -> list[str]:
    """The methods in both runs (chain first, then DDTree by budget), narrowed to `methods`."""
    methods_a, methods_b = set(samples_a["method"].to_list()), set(samples_b["method"].to_list())
    common = sorted(methods_a & methods_b, key=results.method_order)
    if not common:
        raise CompareError(
            f"A and B share no method (A: {sorted(methods_a, key=results.method_order)}, "
            f"B: {sorted(methods_b, key=results.method_order)})"
        )
    only = sorted(methods_a ^ methods_b, key=results.method_order)
    if only and not methods:
        warnings.warn(f"method(s) {only} are in only one run and are not compared", UserWarning, stacklevel=3)
    return _select(methods, common, "method", "--method")


def _join(samples_a: pl.DataFrame, samples_b: pl.DataFrame, methods: list[str]) -> pl.DataFrame:
    """Full join of A's and B's taus by (dataset, sample_id, method), with in_a / in_b flags;
    warns about samples in only one run."""
    a = samples_a.select(*KEYS, "method", tau_a=pl.col("tau").cast(pl.Float64).fill_nan(None), in_a=pl.lit(True))
    b = samples_b.select(*KEYS, "method", tau_b=pl.col("tau").cast(pl.Float64).fill_nan(None), in_b=pl.lit(True))
    joined = (
        a.join(b, on=[*KEYS, "method"], how="full", coalesce=True)
        .filter(pl.col("method").is_in(methods))
        .with_columns(pl.col("in_a", "in_b").fill_null(False))
    )
    unmatched = joined.filter(~(pl.col("in_a") & pl.col("in_b")))
    if unmatched.height:
        ids = unmatched.select(KEYS).unique().sort(KEYS)
        warnings.warn(
            f"{ids.height} sample(s) are in only one run (e.g. dataset {ids['dataset'][0]!r}, sample "
            f"{ids['sample_id'][0]!r}); they are left out and counted in `unmatched`",
            UserWarning,
            stacklevel=3,
        )
    return joined


def compare_pairs(rows: pl.DataFrame, resamples: int, seed: int, confidence: float) -> dict:
    """n, tau_a, tau_b, delta, ci_low, ci_high, verdict, dropped_null, unmatched for one
    (dataset, method), from its rows of the full join of A and B (columns tau_a, tau_b, in_a, in_b)."""
    present = rows.filter(pl.col("in_a") & pl.col("in_b"))
    paired = present.filter(pl.col("tau_a").is_not_null() & pl.col("tau_b").is_not_null())
    counts = {"dropped_null": present.height - paired.height, "unmatched": rows.height - present.height}
    n = paired.height
    if n == 0:
        return {
            "n": 0,
            "tau_a": None,
            "tau_b": None,
            "delta": None,
            "ci_low": None,
            "ci_high": None,
            "verdict": "no paired samples with a tau in both runs",
            **counts,
        }
    tau_a, tau_b = paired["tau_a"].to_numpy(), paired["tau_b"].to_numpy()
    delta, low, high = paired_bootstrap(tau_a, tau_b, resamples=resamples, seed=seed, confidence=confidence)
    return {
        "n": n,
        "tau_a": float(tau_a.mean()),
        "tau_b": float(tau_b.mean()),
        "delta": delta,
        "ci_low": low,
        "ci_high": high,
        "verdict": verdict(delta, low, high, confidence, n),
        **counts,
    }
