"""What `specreplay compare` compares: the two results directories located and loaded, the checks
that they can be compared (same shards, same or duplicate checkpoint content), the samples paired
by their tokens, and the per-sample sums of the all-anchor streak from anchors.parquet.

Inputs, Shards, Pairing and the all-anchor streak are defined in scoring/compare/run.py's docstring.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from enum import Enum

import polars as pl

from pipeline.common.errors import UserError
from pipeline.common.schema import SchemaError
from scoring import results
from scoring.methods.registry import method_order

REQUIRED_COLUMNS = ("dataset", "sample_id", "method", "tau")  # of results.SAMPLES, what pairing needs
TOKEN_COLUMNS = {"tokens_hash": pl.String, "prompt_len": pl.Int64, "response_len": pl.Int64, "prompt_text": pl.String}
KEYS = ["dataset", "sample_id"]


class CompareError(UserError):
    """The inputs cannot be compared; the message names the file or field and the fix."""


class CompareWarning(UserWarning):
    """Something the reader of a comparison must know."""


class ShardsDifferWarning(CompareWarning):
    """A and B were not scored on the same shards (or that cannot be checked), allowed by the flag."""


class DifferingSamplesWarning(CompareWarning):
    """Samples of the same (dataset, sample_id) hold different tokens in A and B; left out."""


class SameCheckpointWarning(CompareWarning):
    """A and B hold the same checkpoint content, or a directory held duplicates of one."""


class StreakWarning(CompareWarning):
    """The all-anchor streak is not compared (or only partly)."""


# --------------------------------------------------------------------------- results directories


@dataclass
class Side:
    """One results directory, resolved and loaded."""

    label: str  # "A" or "B"
    given: str  # the path as passed
    path: str  # the results directory compared
    samples: pl.DataFrame
    record: dict | None  # run.json, None when absent
    name: str = ""
    content_hash: str | None = None
    shards_identity: str | None = None


def _read_run(path: str, label: str) -> dict | None:
    """run.json of a results directory; None when absent, CompareError when it cannot be trusted."""
    try:
        return results.read_run_record(path)
    except SchemaError as error:
        raise CompareError(f"{label}: {error}, or delete run.json and pass --allow-different-shards") from None


def _hash_of(path: str, record: dict | None) -> str | None:
    """The checkpoint content hash (16 hex, as the rows' `checkpoint_hash`) of a results directory."""
    content = (record or {}).get("checkpoint", {}).get("content_hash")
    if content:
        return str(content)[:16]
    samples_path = os.path.join(path, results.FILES["samples"])
    try:
        if "checkpoint_hash" not in pl.read_parquet_schema(samples_path):
            return None
        values = pl.scan_parquet(samples_path).select("checkpoint_hash").unique().collect()["checkpoint_hash"]
    except Exception:  # noqa: BLE001 - unreadable here is reported when the file is loaded
        return None
    values = [v for v in values.to_list() if v]
    return str(values[0]) if len(values) == 1 else None


def _shards_of(record: dict | None) -> str | None:
    """run.json's `shards.identity`: the shards a results directory was scored on."""
    identity = (record or {}).get("shards", {}).get("identity")
    return str(identity) if identity else None


def _results_children(path: str) -> list[str]:
    """Subdirectories of path that hold a samples.parquet."""
    try:
        entries = sorted(os.listdir(path))
    except OSError:
        return []
    return [os.path.join(path, e) for e in entries if os.path.isfile(os.path.join(path, e, results.FILES["samples"]))]


def resolve_results_dir(path: str, label: str) -> str:
    """path itself when it holds samples.parquet; else the results directory it holds (one, or
    one of several duplicates of the same checkpoint content and shards, with a warning)."""
    if not os.path.isdir(path):
        raise CompareError(
            f"{label}: {path} is not a directory; pass a results directory written by "
            f"`specreplay score` (one holding samples.parquet and summary.parquet)"
        )
    samples_path = os.path.join(path, results.FILES["samples"])
    if os.path.isfile(samples_path):
        return path
    children = _results_children(path)
    if not children:
        raise CompareError(
            f"{label}: {samples_path} not found; pass a results directory written by `specreplay score` "
            f"(one --out/<parent>_<name> subdirectory)"
        )
    keys = {}
    for child in children:
        record = _read_run(child, label)
        keys[child] = (_hash_of(child, record), _shards_of(record))
    distinct = set(keys.values())
    if len(children) > 1 and (len(distinct) > 1 or None in next(iter(distinct))):
        listed = ", ".join(
            f"{c} (checkpoint_hash {h or 'unknown'}, shards {s or 'unknown'})" for c, (h, s) in keys.items()
        )
        raise CompareError(
            f"{label}: {path} holds several results directories of different checkpoints, pass one of them: {listed}"
        )
    kept = children[0]
    if len(children) == 1:
        note = f"{label}: {path} is not itself a results directory; comparing the one it holds, {kept}"
    else:
        content, shards = keys[kept]
        note = (
            f"{label}: {path} holds {len(children)} results directories of the same checkpoint content "
            f"(checkpoint_hash {content}, shards {shards}): {', '.join(children)}; they are duplicates, "
            f"comparing {kept} only (delete the others to silence this)"
        )
    warnings.warn(note, SameCheckpointWarning, stacklevel=3)
    return kept


def load_results(path: str, label: str) -> tuple[pl.DataFrame, dict | None]:
    """(samples, run record or None) of one results directory; CompareError when it is not one."""
    if not os.path.isdir(path):
        raise CompareError(
            f"{label}: {path} is not a directory; pass a results directory written by "
            f"`specreplay score` (one holding samples.parquet and summary.parquet)"
        )
    samples_path = os.path.join(path, results.FILES["samples"])
    if not os.path.isfile(samples_path):
        raise CompareError(f"{label}: {samples_path} not found; pass a results directory written by `specreplay score`")
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
    return samples, _read_run(path, label)


def checkpoint_name(samples: pl.DataFrame, record: dict | None, path: str) -> str:
    """Display name of the checkpoint behind a results directory."""
    if "checkpoint" in samples.columns and samples.height:
        names = samples["checkpoint"].unique().to_list()
        if len(names) == 1 and names[0]:
            return str(names[0])
    if record and record.get("checkpoint", {}).get("name"):
        return str(record["checkpoint"]["name"])
    return os.path.basename(os.path.normpath(path))


def load_side(given: str, label: str) -> Side:
    """The side `label` of a comparison: `given` resolved to a results directory and loaded."""
    path = resolve_results_dir(given, label)
    samples, record = load_results(path, label)
    return Side(
        label=label,
        given=given,
        path=path,
        samples=samples,
        record=record,
        name=checkpoint_name(samples, record, path),
        content_hash=_hash_of(path, record),
        shards_identity=_shards_of(record),
    )


# --------------------------------------------------------------------------- checks


class ShardsMatch(str, Enum):
    """Whether A and B were scored on the same shards (run.json shards.identity)."""

    SAME = "same"
    DIFFERENT = "different"  # only with --allow-different-shards
    UNKNOWN = "unknown"  # a run.json without shards.identity; likewise


def check_shards(a: Side, b: Side, allow: bool) -> ShardsMatch:
    """SAME, or (allowed, with a warning) DIFFERENT / UNKNOWN; CompareError otherwise."""
    rescore = "score both checkpoints on the same --shards (`specreplay score --ckpt A --ckpt B --shards DIR`)"
    flag = "or pass --allow-different-shards to compare only the samples whose tokens match"
    unknown = [
        os.path.join(s.path, results.FILES["run"]) + (" not found" if s.record is None else " has no shards.identity")
        for s in (a, b)
        if s.shards_identity is None
    ]
    if unknown:
        problem = (
            f"cannot check that A ({a.path}) and B ({b.path}) were scored on the same shards: {'; '.join(unknown)}"
        )
        if not allow:
            raise CompareError(f"{problem}; rescore them with `specreplay score --force`, {flag}")
        warnings.warn(
            f"{problem}; comparing anyway (--allow-different-shards), pairing only samples whose tokens match",
            ShardsDifferWarning,
            stacklevel=3,
        )
        return ShardsMatch.UNKNOWN
    if a.shards_identity == b.shards_identity:
        return ShardsMatch.SAME
    uri_a = (a.record or {}).get("shards", {}).get("uri")
    uri_b = (b.record or {}).get("shards", {}).get("uri")
    run_a, run_b = (os.path.join(s.path, results.FILES["run"]) for s in (a, b))
    problem = (
        f"A ({a.path}) and B ({b.path}) were scored on different shards: shards.identity "
        f"{a.shards_identity} in {run_a} (from {uri_a}), {b.shards_identity} in {run_b} (from {uri_b}); the same "
        f"sample id may hold a different prompt or response"
    )
    if not allow:
        raise CompareError(f"{problem}; {rescore}, {flag}")
    warnings.warn(
        f"{problem}; comparing anyway (--allow-different-shards), pairing only samples whose tokens match",
        ShardsDifferWarning,
        stacklevel=3,
    )
    return ShardsMatch.DIFFERENT


def check_same_checkpoint(a: Side, b: Side) -> bool:
    """Whether A and B hold the same checkpoint content (equal checkpoint_hash), with a warning."""
    if a.content_hash is None or a.content_hash != b.content_hash:
        return False
    where = "the same directory" if os.path.realpath(a.path) == os.path.realpath(b.path) else f"{a.path} and {b.path}"
    warnings.warn(
        f"A ({a.name}) and B ({b.name}) are the same checkpoint content (checkpoint_hash {a.content_hash}, "
        f"{where}): any difference below is expected to be zero; pass the results of two different "
        f"checkpoints",
        SameCheckpointWarning,
        stacklevel=3,
    )
    return True


def select_requested(requested: list[str] | None, available: list[str], what: str, option: str) -> list[str]:
    """The requested names among available, in available's order (all when none is requested);
    CompareError naming `option` for one not available."""
    if not requested:
        return available
    unknown = [r for r in requested if r not in available]
    if unknown:
        raise CompareError(f"{option} {unknown[0]!r}: no such {what} in both runs; choose from {available}")
    return [a for a in available if a in requested]


# --------------------------------------------------------------------------- pairing


@dataclass
class Pairing:
    """The samples of A and B that are compared."""

    methods: list[str]  # in both runs and requested; chain first, then DDTree by budget
    pairs: pl.DataFrame  # (dataset, sample_id) of the samples holding the same tokens in A and B
    joined: pl.DataFrame  # _join's full join of A's and B's taus over `methods`
    differing: int  # samples in both runs whose tokens differ


def pair_samples(a: Side, b: Side, methods: list[str] | None, strict: bool) -> Pairing:
    """Pair A's and B's samples (Pairing in scoring/compare/run.py's docstring); `strict` as in
    match_tokens. CompareError when nothing pairs. Its warnings name the caller of run_comparison
    (stacklevel 4: the warning helper, this, run_comparison)."""
    _check_overlap(a.samples, b.samples, a.path, b.path)
    chosen = _common_methods(a.samples, b.samples, methods)
    match = match_tokens(a.samples, b.samples, strict=strict)
    differing = _warn_differing(match, a, b)
    pairs = match.filter(pl.col("same")).select(KEYS)
    if pairs.height == 0:
        raise CompareError(
            f"no sample of A ({a.path}) holds the same prompt and response as the sample of the same id "
            f"in B ({b.path}); score both checkpoints on the same --shards"
        )
    return Pairing(methods=chosen, pairs=pairs, joined=_join(a.samples, b.samples, chosen, match), differing=differing)


def _check_overlap(samples_a: pl.DataFrame, samples_b: pl.DataFrame, dir_a: str, dir_b: str) -> None:
    """CompareError when no (dataset, sample_id) is in both runs."""
    ids_a, ids_b = samples_a.select(KEYS).unique(), samples_b.select(KEYS).unique()
    if ids_a.join(ids_b, on=KEYS, how="inner").height == 0:
        same_ids = set(ids_a["sample_id"].to_list()) & set(ids_b["sample_id"].to_list())
        hint = f" ({len(same_ids)} sample ids match but under different dataset names)" if same_ids else ""
        raise CompareError(
            f"no sample of A ({dir_a}) matches a sample of B ({dir_b}) by (dataset, sample_id){hint}; "
            f"score both checkpoints on the same --shards"
        )


def _tokens(samples: pl.DataFrame) -> pl.DataFrame:
    """One row per (dataset, sample_id) with TOKEN_COLUMNS (null where the run lacks the column)."""
    present = [c for c in TOKEN_COLUMNS if c in samples.columns]
    frame = samples.select(*KEYS, *present).unique(subset=KEYS, keep="first", maintain_order=True)
    return frame.with_columns(
        *[pl.lit(None, dtype=t).alias(c) for c, t in TOKEN_COLUMNS.items() if c not in present],
        *[pl.col(c).cast(t) for c, t in TOKEN_COLUMNS.items() if c in present],
    )


def match_tokens(samples_a: pl.DataFrame, samples_b: pl.DataFrame, strict: bool) -> pl.DataFrame:
    """(dataset, sample_id, same) for every sample in both runs: same = equal tokens_hash when
    both have one, else equal prompt_len, response_len and prompt_text where both sides have
    them; `strict` (shards not known to be the same) also requires prompt_len and response_len
    on both sides."""
    joined = _tokens(samples_a).join(_tokens(samples_b), on=KEYS, how="inner", suffix="_b")
    hashed = pl.col("tokens_hash").is_not_null() & pl.col("tokens_hash_b").is_not_null()
    fallback = pl.lit(True)
    for column in ("prompt_len", "response_len", "prompt_text"):  # a null on either side is no evidence
        mine, theirs = pl.col(column), pl.col(f"{column}_b")
        fallback = fallback & (mine.is_null() | theirs.is_null() | (mine == theirs))
    if strict:
        for column in ("prompt_len", "response_len"):
            fallback = fallback & pl.col(column).is_not_null() & pl.col(f"{column}_b").is_not_null()
    same = pl.when(hashed).then(pl.col("tokens_hash") == pl.col("tokens_hash_b")).otherwise(fallback)
    return joined.select(*KEYS, same=same)


def _common_methods(samples_a: pl.DataFrame, samples_b: pl.DataFrame, methods: list[str] | None) -> list[str]:
    """The methods in both runs (chain first, then DDTree by budget), narrowed to `methods`."""
    methods_a, methods_b = set(samples_a["method"].to_list()), set(samples_b["method"].to_list())
    common = sorted(methods_a & methods_b, key=method_order)
    if not common:
        raise CompareError(
            f"A and B share no method (A: {sorted(methods_a, key=method_order)}, "
            f"B: {sorted(methods_b, key=method_order)})"
        )
    only = sorted(methods_a ^ methods_b, key=method_order)
    if only and not methods:
        warnings.warn(f"method(s) {only} are in only one run and are not compared", CompareWarning, stacklevel=4)
    return select_requested(methods, common, "method", "--method")


def _join(samples_a: pl.DataFrame, samples_b: pl.DataFrame, methods: list[str], match: pl.DataFrame) -> pl.DataFrame:
    """Full join of A's and B's taus by (dataset, sample_id, method), with in_a / in_b flags and
    `differs` (in both, tokens differ); warns about samples in only one run."""
    a = samples_a.select(*KEYS, "method", tau_a=pl.col("tau").cast(pl.Float64).fill_nan(None), in_a=pl.lit(True))
    b = samples_b.select(*KEYS, "method", tau_b=pl.col("tau").cast(pl.Float64).fill_nan(None), in_b=pl.lit(True))
    joined = (
        a.join(b, on=[*KEYS, "method"], how="full", coalesce=True)
        .filter(pl.col("method").is_in(methods))
        .with_columns(pl.col("in_a", "in_b").fill_null(False))
        .join(match, on=KEYS, how="left")
        .with_columns(differs=pl.col("in_a") & pl.col("in_b") & ~pl.col("same").fill_null(False))
        .drop("same")
    )
    unmatched = joined.filter(~(pl.col("in_a") & pl.col("in_b")))
    if unmatched.height:
        ids = unmatched.select(KEYS).unique().sort(KEYS)
        warnings.warn(
            f"{ids.height} sample(s) are in only one run (e.g. dataset {ids['dataset'][0]!r}, sample "
            f"{ids['sample_id'][0]!r}); they are left out and counted in `unmatched`",
            CompareWarning,
            stacklevel=4,
        )
    return joined


def _warn_differing(match: pl.DataFrame, a: Side, b: Side) -> int:
    """The samples in both runs whose tokens differ (match's `same` false): counted, with a warning."""
    differing = match.filter(~pl.col("same")).sort(KEYS)
    if differing.height:
        example = differing.row(0, named=True)
        hashed = all(
            "tokens_hash" in s.samples.columns and s.samples["tokens_hash"].null_count() < s.samples.height
            for s in (a, b)
        )
        fields = (
            "tokens_hash"
            if hashed
            else "prompt_len, response_len, prompt_text; a run lacks tokens_hash, rescore it for an exact check"
        )
        warnings.warn(
            f"{differing.height} of {match.height} sample(s) in both runs hold a different prompt or "
            f"response in A and B (samples.parquet {fields}; e.g. dataset {example['dataset']!r}, sample "
            f"{example['sample_id']!r}): never paired, left out and counted in `differing`",
            DifferingSamplesWarning,
            stacklevel=4,
        )
    return differing.height
