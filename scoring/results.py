"""What `specreplay score` writes, declared once: files, columns and types, method names.

Per checkpoint, one results directory:
    anchors.parquet  one row per (sample, anchor): all-anchor metrics
    walk.parquet     one row per simulated decoding step (chain, each DDTree budget, each EAGLE tree)
    samples.parquet  one row per (sample, method)
    summary.parquet  one row per (dataset, method), plus dataset ALL_DATASETS
    run.json         checkpoint path/hash/config, shards identity, versions, wall time
Every row carries the checkpoint identity and `dataset`, so the results of many checkpoints
concatenate in one polars scan. `score` writes through these schemas and `compare`, `report`
and the tests read and fake them from here, so a renamed column fails every consumer.
The summary keeps the large_string / large_list types polars gave it when it was first written.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.common.schema import Count, Number, Schema, SchemaError, found, validate
from proposers import baselines
from proposers.registry import family_label, layout_label
from scoring.methods import registry as methods

ALL_DATASETS = "(all)"  # the dataset label of rows pooling every dataset
# A per-position acceptance rate resting on fewer anchors than this is no reading: one or two
# anchors at the far block positions swing between 0 and 100% and would read as a cliff. The
# report greys such points; diagnose's console and the loggers (`log`, `watch`) leave them out.
MIN_ANCHORS = 30

FILES = {
    "anchors": "anchors.parquet",
    "walk": "walk.parquet",
    "samples": "samples.parquet",
    "summary": "summary.parquet",
    "run": "run.json",
    "diagnose": "diagnose.parquet",  # `specreplay diagnose`, in a directory of its own
    "diagnose_run": "diagnose.json",
}


# --------------------------------------------------------------------------- layout


def result_dir_name(path: str) -> str:
    """A checkpoint's results sub-directory under --out: 'run1_step_200' for run1/step_200/
    and for run1/step_200.pt. One per checkpoint whatever their number, so a checkpoint scored
    alone and in a glob lands in the same place. A baseline's name: `ngram_vllm_k=4`."""
    if baselines.is_named(path):
        return baselines.dir_name(path)
    path = os.path.normpath(os.path.abspath(path))
    parent, base = os.path.split(path)
    stem = os.path.splitext(base)[0] if os.path.isfile(path) else base
    return f"{os.path.basename(parent)}_{stem}"


STAGING = ".partial-"  # score writes `.<name>.partial-<pid>/` beside the results, then renames it


def staging_dir(out_dir: str, pid: int | str) -> str:
    """The hidden directory process `pid` writes out_dir's files into before renaming it into place."""
    parent, name = os.path.split(os.path.normpath(out_dir))
    return os.path.join(parent, f".{name}{STAGING}{pid}")


def staging_dirs(out_dir: str) -> list[tuple[str, str]]:
    """(path, pid text) of every staging directory of out_dir, whichever process made it."""
    import glob

    pattern = staging_dir(glob.escape(os.path.normpath(out_dir)), "*")
    return [(path, path.rsplit(STAGING, 1)[1]) for path in sorted(glob.glob(pattern))]


def results_dirs_below(path: str, need: tuple[str, ...] = ("summary",)) -> list[str]:
    """Every directory at or below `path` holding the FILES kinds in `need`, sorted. Hidden
    directories (staging, not complete yet) are never entered."""
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if all(FILES[kind] in files for kind in need):
            found.append(os.path.abspath(root))
    return sorted(found)


# --------------------------------------------------------------------------- run.json


class RunCheckpoint(Schema):
    content_hash: str | None = None
    family: str | None = None
    layout: str | None = None
    path: str | None = None
    name: str | None = None
    step: Count | None = None
    config: dict[str, Any] | None = None


class RunSampling(Schema):
    temperature: Number = 0.0
    top_p: Number = 1.0
    top_k: Count = 0


class RunShards(Schema):
    identity: str | None = None
    samples: Count | None = None
    uri: str | None = None
    sampling: RunSampling | None = None
    target: str | None = None
    target_facts: dict[str, Count] | None = None  # the target's sizes, TARGET_FACTS (older results: absent)
    feature_dtype: str | None = None
    excluded_samples: Count = 0
    responses: dict | None = None  # extract --responses-from: {engine, model, sampling_rule}; None: the target's
    mismatched_samples: dict[str, Count] = {}  # greedy samples of the shards with argmax mismatches: positions


class RunRecord(Schema):
    """run.json as scoring/score/record.py writes it; every part optional, so results written by
    an older specreplay still read, but a part that is there holds what readers take from it."""

    checkpoint: RunCheckpoint = RunCheckpoint()
    shards: RunShards = RunShards()
    ddtree_budgets: list[Count] | None = None
    eagle_trees: list[str] | None = None  # EAGLE-3 dynamic trees scored, as `score --eagle-trees` spells them
    chain_steps: Count | None = None  # drafts per anchor of an EAGLE-3 or MTP chain (`score --steps`)
    anchor_set: Literal["all", "walk"] = "all"
    anchor_drafts: bool = False
    dtype: str | None = None
    selection: dict[str, Any] | None = None
    device: str | None = None
    attention: str | None = None
    world_size: Count | None = None
    anchors: Count | None = None
    nonfinite_drafter: list[Any] = []
    wall_time_s: Number | None = None
    versions: dict[str, Any] | None = None
    command: list[str] | None = None


TARGET_FACTS = ("num_layers", "hidden_size", "vocab_size")  # run.json shards.target_facts

RUN_FIX = "rescore that checkpoint with `specreplay score --force` (or restore run.json from a copy)"


def read_run_record(directory: str) -> dict | None:
    """The run.json of a results directory, checked against `RunRecord`; None when absent.
    A run.json that cannot be trusted is a SchemaError naming it and the field, not a crash
    later in whichever command read it."""
    path = os.path.join(directory, FILES["run"])
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise SchemaError(f"{path}: not readable as JSON ({error}); {RUN_FIX}") from None
    if not isinstance(record, dict):
        raise SchemaError(f"{path}: the file holds {found(record)}; expected a JSON object; {RUN_FIX}")
    validate(RunRecord, record, path, RUN_FIX)
    return record


def drafter_label(family: str | None, layout: str | None) -> str:
    """'DSpark, speculators layout' ('' for results older than the family columns)."""
    if not family:
        return ""
    return f"{family_label(family)}, {layout_label(layout)} layout"


# --------------------------------------------------------------------------- method names
# Each verification method declares its own names and columns (scoring/methods/registry.py).


def sampling_of_row(row: dict):
    """The pipeline.common.sampling.Sampling a summary row was scored at (its temperature/top_p/top_k
    columns); None for greedy shards and for results older than those columns."""
    if not row.get("temperature"):
        return None
    from pipeline.common.sampling import Sampling  # imports torch: only for sampled results

    return Sampling(row["temperature"], row["top_p"], row["top_k"])


def is_sampled(record: dict | None) -> bool:
    """Whether run.json says the shards' responses were sampled (temperature > 0)."""
    return bool(((record or {}).get("shards", {}).get("sampling") or {}).get("temperature"))


# --------------------------------------------------------------------------- schemas

IDENTITY = [
    pa.field("checkpoint", pa.string()),
    pa.field("checkpoint_hash", pa.string()),
    pa.field("checkpoint_step", pa.int64()),
    pa.field(
        "drafter_family", pa.string()
    ),  # proposers/registry.py FAMILY_NAMES: dflash, dflash2, xpress, dspark, eagle3, peagle, eagle, mtp, ngram, draft, suffix
    pa.field("drafter_layout", pa.string()),  # whose config.json layout: z-lab, speculators, specforge, deepspec
]
WALK = [
    pa.field("dataset", pa.string()),
    pa.field("sample_id", pa.string()),
    pa.field("method", pa.string()),
    pa.field("step", pa.int64()),
    pa.field("anchor", pa.int64()),
    pa.field("produced", pa.int64()),
    pa.field("accepted_len", pa.int64()),
    # what the walk rule's loop (run.json walk_rule; docs/walk-rules.md) reports for this step:
    # drafts verified (0: a plain decode), accepted drafts as it counts them, and whether that
    # count is exact (False: drafts past the stored response were counted too, a lower bound)
    pa.field("drafted", pa.int64()),
    pa.field("counted_accepted", pa.int64()),
    pa.field("counted_exact", pa.bool_()),
    # chain rows: the drafter's block at this step (block positions 1..block_len-1); its first
    # `accepted_len` entries were accepted, the next one is the guess the target rejected.
    # Null on DDTree and EAGLE tree rows (a tree has no single draft).
    pa.field("draft_tokens", pa.list_(pa.int32())),
]
ANCHORS = [
    pa.field("dataset", pa.string()),
    pa.field("sample_id", pa.string()),
    pa.field("anchor", pa.int32()),
    pa.field("anchor_offset", pa.int32()),
    pa.field("block_len", pa.int32()),
    pa.field("accepted_len", pa.int32()),
    pa.field("produced_chain", pa.int32()),
    pa.field("expected_accepted_len", pa.float32()),
    pa.field("draft_match", pa.list_(pa.bool_())),
    pa.field("target_prob", pa.list_(pa.float32())),
    pa.field("kl_topk", pa.list_(pa.float32())),
]
SAMPLES = [
    pa.field("dataset", pa.string()),
    pa.field("sample_id", pa.string()),
    pa.field("method", pa.string()),
    pa.field("prompt_len", pa.int64()),
    pa.field("response_len", pa.int64()),
    pa.field("finish_reason", pa.string()),
    pa.field("greedy", pa.bool_()),
    pa.field("argmax_mismatches", pa.int64()),
    pa.field("exact", pa.bool_()),
    pa.field("steps", pa.int64()),
    pa.field("tokens_produced", pa.int64()),
    pa.field("tau", pa.float64()),
    pa.field("prompt_text", pa.string()),
    pa.field("prompt_message", pa.string()),  # the user's own words in prompt_text (scoring/prompts.py)
    # sha256 of the sample's token ids (prompt + response, int64 little-endian), 16 hex: two
    # results are about the same sample only when this matches (compare pairs on it)
    pa.field("tokens_hash", pa.string()),
]
_LARGE = {pa.string(): pa.large_string()}
SUMMARY = [pa.field(f.name, _LARGE.get(f.type, f.type)) for f in IDENTITY] + [
    pa.field("dataset", pa.large_string()),
    pa.field("method", pa.large_string()),
    pa.field("tau", pa.float64()),
    pa.field("samples", pa.int64()),
    pa.field("samples_without_steps", pa.int64()),
    pa.field("steps", pa.int64()),
    pa.field("tokens_produced", pa.int64()),
    pa.field("inexact_samples", pa.int64()),
    pa.field("argmax_mismatches", pa.int64()),
    pa.field("exact", pa.bool_()),
    pa.field("anchors", pa.int64()),
    pa.field("anchor_accepted_len_mean", pa.float64()),
    pa.field("anchor_produced_mean", pa.float64()),
    pa.field("anchor_expected_accepted_len_mean", pa.float64()),
    pa.field("target_prob_mean", pa.float64()),
    pa.field("kl_topk_mean", pa.float64()),
    pa.field("accept_rate_by_position", pa.large_list(pa.float64())),
    pa.field("match_rate_by_position", pa.large_list(pa.float64())),
    pa.field("anchor_set", pa.string()),
    # the anchors behind each accept_rate_by_position entry (expected counts on sampled shards):
    # a rate resting on fewer than MIN_ANCHORS is left out by the console and the loggers
    pa.field("reached_by_position", pa.large_list(pa.float64())),
    # the 95% Wilson interval of each accept_rate_by_position entry on those anchor counts
    # (metrics.wilson_interval: anchors of one response are not independent, so a lower bound on
    # the spread over prompts)
    pa.field("accept_rate_low_by_position", pa.large_list(pa.float64())),
    pa.field("accept_rate_high_by_position", pa.large_list(pa.float64())),
    # the shards' decoding: temperature 0 is greedy; at T > 0 `tau` is the expected value (exact in
    # distribution) and tau_se its sampling error over responses (null for greedy)
    pa.field("temperature", pa.float64()),
    pa.field("top_p", pa.float64()),
    pa.field("top_k", pa.int64()),
    pa.field("tau_se", pa.float64()),
]

# `specreplay diagnose`: one row per (variant, metric), plus the configured run's acceptance by
# block position (metric "accept_by_position", `position` 1..L, no delta). delta / ci_* are the
# variant minus "as-configured", paired over the same samples (bootstrap 95% CI); null on
# "as-configured" itself and on variants not measured (`note` says why).
CONFIGURED_VARIANT = "as-configured"  # the diagnose row every variant is compared with
DIAGNOSE = IDENTITY + [
    pa.field("variant", pa.string()),
    pa.field("metric", pa.string()),  # tau | streak | accept_pos1 | accept_by_position
    pa.field("position", pa.int64()),  # block position of accept_by_position rows, else null
    pa.field("value", pa.float64()),
    pa.field("delta", pa.float64()),
    pa.field("ci_low", pa.float64()),
    pa.field("ci_high", pa.float64()),
    pa.field("samples", pa.int64()),
    pa.field("note", pa.string()),
    # accept_by_position rows: the anchors that reached `position` (expected count at T > 0), so
    # a rate resting on fewer than MIN_ANCHORS is not read as one; null on the other rows
    pa.field("anchors", pa.float64()),
]


def diagnose_schema() -> pa.Schema:
    return pa.schema(DIAGNOSE)


def walk_schema() -> pa.Schema:
    return pa.schema(IDENTITY + WALK)


# `score --anchor-drafts`: every anchor's draft block (block positions 1..block_len-1), which
# costs block_size - 1 ints per response token; walk.parquet keeps the walk's blocks regardless
ANCHOR_DRAFTS = pa.field("draft_tokens", pa.list_(pa.int32()))


def anchors_schema(plan: dict, drafts: bool = False) -> pa.Schema:
    """anchors.parquet's schema for the tree methods `plan` runs (their settings by kind)."""
    return pa.schema(IDENTITY + ANCHORS + methods.anchor_fields(plan) + ([ANCHOR_DRAFTS] if drafts else []))


def samples_schema() -> pa.Schema:
    return pa.schema(IDENTITY + SAMPLES)


def summary_schema() -> pa.Schema:
    return pa.schema(SUMMARY)


def columns(fields: list[pa.Field]) -> list[str]:
    return [f.name for f in fields]


# --------------------------------------------------------------------------- tables and files


def with_identity(columns_by_name: dict, identity: dict, rows: int) -> dict:
    """The identity columns first, each repeated for every row, then the given columns."""
    return {**{key: [identity[key]] * rows for key in columns(IDENTITY)}, **columns_by_name}


def table(columns_by_name: dict, schema: pa.Schema) -> pa.Table:
    """A table in exactly `schema`'s columns and types (KeyError names a missing column)."""
    return pa.table({name: columns_by_name[name] for name in schema.names}, schema=schema)


def rows_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    """A table from row dicts; a key the schema lacks is an error, a missing key is null."""
    extra = {key for row in rows for key in row} - set(schema.names)
    if extra:
        raise KeyError(f"columns {sorted(extra)} are not in the results schema")
    return pa.Table.from_pylist(rows, schema=schema)


def write_table(data: pa.Table, directory: str, kind: str) -> str:
    """Write one results file atomically (temporary name, then rename); returns its path."""
    from pipeline.common.space import writing

    path = os.path.join(directory, FILES[kind])
    with writing(path, data.nbytes, resume="results are kept only once whole, so it redoes them"):
        pq.write_table(data, path + ".tmp", compression="zstd")
    os.replace(path + ".tmp", path)
    return path


def chain_drafts(row: dict) -> int:
    """A chain summary row's drafts per step, K: the length of its per-position rates."""
    return len(row.get("accept_rate_by_position") or [])
