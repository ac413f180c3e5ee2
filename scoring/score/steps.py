"""`specreplay score`: replay shards through drafter checkpoints and write the results.

The steps of one checkpoint live here: load it (compatibility checked before any weight is
read; skipped when its results directory already holds these settings), replay a group of
samples (scoring/replay/anchors.py), collect (scoring/score/collect.py), record and write the files
scoring/results.py declares. scoring/score/passes.py strings them together: several checkpoints
per pass over the shards, each sample decoded once for all of them (under torchrun rank 0
gathers every rank's results).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
import shutil
import sys
from dataclasses import dataclass, field

import torch

from pipeline.common import timing
from pipeline.common.distributed import Dist, dist_from_env, init_dist, resolve_device
from pipeline.common.dtypes import resolve_dtype
from pipeline.common.errors import UserError
from pipeline.common.lock import OutputLock, pid_exists
from pipeline.common.sampling import sampling_of
from pipeline.common.versions import specreplay_version
from pipeline.shards import ShardSet
from scoring import results
from scoring.config import ScoreConfig
from scoring.drafters.checkpoint import CheckpointInfo, check_compatibility, load_drafter, read_drafter_config
from scoring.replay.anchors import (
    ReplayOptions,
    prepare_target_head,
    replay_sample,
    replay_walks,
    select_feature_columns,
)
from scoring.replay.walk import stop_mask
from scoring.score.collect import Collector
from scoring.score.selection import Selection, sample_index, select_samples, selection_record

SAMPLE_TENSORS = ["features", "topk_ids", "topk_logprobs", "argmax_mismatch", "sample_logprob"]


def resolve_device_dtype(device: str, dtype: str, dist: Dist | None = None) -> tuple[str, torch.dtype]:
    """GPU if present, else CPU; dtype "auto" = fp32 on CPU and bf16 on GPU."""
    device = resolve_device(None if device == "auto" else device, dist or Dist())
    return device, resolve_dtype(dtype, device)


def expand_checkpoints(patterns: list[str]) -> list[str]:
    """Paths as given, globs expanded (sorted), duplicates dropped; missing paths are an error."""
    paths: list[str] = []
    for pattern in patterns:
        literal = os.path.exists(pattern) or not any(c in pattern for c in "*?[")
        matches = [pattern] if literal else sorted(glob.glob(pattern))
        if not matches:
            raise FileNotFoundError(f"--ckpt {pattern!r} matches nothing")
        for path in matches:
            if not os.path.exists(path):
                raise FileNotFoundError(f"--ckpt {path}: no such file or directory")
            if path not in paths:
                paths.append(path)
    return paths


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


def shards_identity(manifest: dict) -> str:
    """Content identity of an extract: its settings and every shard's checksum."""
    blob = json.dumps(
        {"settings": manifest["settings"], "shards": sorted((s["file"], s["crc32"]) for s in manifest["shards"])},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class Job:
    """One checkpoint's replay, everything resolved: what to replay, with what, on which samples."""

    drafter: torch.nn.Module
    info: CheckpointInfo
    options: ReplayOptions
    tree_nodes: list[int]  # sorted, unique
    mine: list[int]  # sample indices this rank replays
    total: int  # samples scored over all ranks
    max_new_tokens: int
    stored_layer_ids: list[int]
    selection: dict  # run.json's `selection`


@dataclass
class Outcome:
    """What happened to one checkpoint: 'scored', 'skipped' (already scored with the same
    settings) or 'failed' (`error` says why, in one line)."""

    ckpt: str
    out_dir: str
    status: str
    record: dict | None = None
    summary: object = None  # pyarrow Table of summary.parquet (scored or skipped)
    error: str | None = None
    name: str = field(default="")


def read_record(out_dir: str) -> dict | None:
    """The run.json of a finished results directory, None when there is none."""
    run_path = os.path.join(out_dir, results.FILES["run"])
    if not os.path.exists(run_path):
        return None
    with open(run_path) as f:
        return json.load(f)


def settings_of(record: dict) -> dict:
    """What makes two score runs the same work (and so their results interchangeable)."""
    selection = record.get("selection") or {}
    return {
        "checkpoint content hash": record.get("checkpoint", {}).get("content_hash"),
        "shards identity": record.get("shards", {}).get("identity"),
        "ddtree budgets": record.get("ddtree_budgets"),
        "anchor set": record.get("anchor_set", "all"),
        "anchor drafts": record.get("anchor_drafts", False),
        "dtype": record.get("dtype"),
        "samples": record.get("shards", {}).get("samples"),
        "sample ids": selection.get("ids_hash"),
    }


def differences(previous: dict, planned: dict) -> list[str]:
    """'name: before -> now' for every setting that differs (ids only when both recorded them)."""
    before, now = settings_of(previous), settings_of(planned)
    if before["sample ids"] is None or now["sample ids"] is None:
        before.pop("sample ids"), now.pop("sample ids")
    return [f"{key}: {before[key]} -> {now[key]}" for key in now if before[key] != now[key]]


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


def planned_record(info: CheckpointInfo, shardset: ShardSet, config: ScoreConfig, dtype, selection: dict) -> dict:
    """The settings part of run.json, known before any replay: what check_previous compares."""
    return {
        "checkpoint": {"content_hash": info.content_hash},
        "shards": {"identity": shards_identity(shardset.manifest), "samples": selection["samples"]},
        "ddtree_budgets": list(config.tree_nodes),
        "anchor_set": config.anchors,
        "anchor_drafts": config.anchor_drafts,
        "dtype": str(dtype).replace("torch.", ""),
        "selection": selection,
    }


def choose_samples(shardset: ShardSet, config: ScoreConfig) -> tuple[list[int], dict]:
    """The sample indices to replay and run.json's `selection` record."""
    selection = Selection(config.limit, config.sample, config.seed, tuple(config.datasets or ()) or None)
    index = sample_index(shardset)
    chosen = select_samples(index, selection)
    return chosen, selection_record(selection, index, chosen)


def check_anchor_set(shardset: ShardSet, config: ScoreConfig) -> None:
    """Walk-only replay follows one deterministic walk; on sampled shards the chain's expected
    tau weighs every anchor a walk could visit, so they need every anchor."""
    sampling = sampling_of(shardset.settings)
    if config.anchors == "walk" and not sampling.greedy:
        raise UserError(
            f"--anchors walk: {shardset.uri} holds responses sampled at {sampling.describe()}; their expected "
            "tau needs every anchor (the default --anchors all)"
        )


def prepare_job(ckpt: str, shardset: ShardSet, out_dir: str, config: ScoreConfig, dist: Dist) -> Job | None:
    """Load the checkpoint for replay; None when out_dir already holds its results."""
    device, dtype = resolve_device_dtype(config.device, config.dtype, dist)
    manifest = shardset.manifest
    check_compatibility(read_drafter_config(ckpt), manifest, ckpt)  # before reading gigabytes of weights
    with timing.stage("load drafter"):
        drafter, info = load_drafter(ckpt, dtype=dtype, device=device)
    chosen, selection = choose_samples(shardset, config)
    if check_previous(out_dir, planned_record(info, shardset, config, dtype, selection), config.force):
        return None
    tree_nodes = sorted(set(config.tree_nodes))
    options = ReplayOptions(
        max_tree_nodes=max(tree_nodes) if tree_nodes else 0,
        memory_bytes=config.memory_bytes,
        dtype=dtype,
        device=device,
        attention=config.attention,
        sampling=sampling_of(manifest["settings"]),
    )
    settings = manifest["settings"]
    return Job(
        drafter,
        info,
        options,
        tree_nodes,
        chosen[dist.rank :: dist.world],
        len(chosen),
        int(settings["max_new_tokens"]),
        settings["layer_ids"],
        selection,
    )


def sample_groups(indexed_samples, anchors_mode: str, group_tokens: int):
    """All-anchor mode replays one sample at a time; walk mode packs samples up to
    `group_tokens` tokens so each round batches the current anchor of many samples."""
    group, tokens = [], 0
    for index, sample in indexed_samples:
        n = sample.input_ids.numel()
        if group and (anchors_mode == "all" or tokens + n > group_tokens):
            yield group
            group, tokens = [], 0
        group.append((index, sample))
        tokens += n
    if group:
        yield group


def replay_group(job: Job, head: dict, group: list, config: ScoreConfig, collector: Collector) -> list:
    """AnchorTensors of each sample of a group, all anchors or only those the walks visit."""
    columns = lambda f: select_feature_columns(f, job.stored_layer_ids, job.info.config.target_layer_ids)  # noqa: E731
    samples = [s for _, s in group]
    # Given (teacher-forced) responses may be longer than the extract's max_new_tokens.
    max_new = [job.max_new_tokens if s.greedy else max(job.max_new_tokens, s.response_len) for s in samples]
    embed, lm_head = head["embed_tokens"], head["lm_head"]
    if config.anchors == "all":
        return [
            replay_sample(job.drafter, embed, lm_head, s, columns, m, job.options) for s, m in zip(samples, max_new)
        ]
    is_stop = [stop_mask(s.input_ids, collector.stop_token_ids) for s in samples]
    tree_nodes = [results.tree_nodes_of(m) for m in collector.methods]
    return replay_walks(job.drafter, embed, lm_head, samples, columns, max_new, tree_nodes, is_stop, job.options)


def run_record(
    ckpt: str,
    job: Job,
    shardset: ShardSet,
    config: ScoreConfig,
    dist: Dist,
    anchors_done: int,
    wall: float,
    nonfinite: list[dict] | None = None,
) -> dict:
    """run.json: what was scored, on what, how, and how long it took; the samples left out of
    every number (`nonfinite_drafter`: NaN/Inf drafter logits, with their anchors; and
    shards.excluded_samples: NaN/Inf target values the extract never stored)."""
    manifest = shardset.manifest
    return {
        "checkpoint": {
            "path": os.path.abspath(ckpt),
            "name": job.info.name,
            "content_hash": job.info.content_hash,
            "step": job.info.step,
            "config": job.info.config_raw,
        },
        "shards": {
            "uri": shardset.uri,
            "identity": shards_identity(manifest),
            "target": manifest.get("target", {}).get("name"),
            "samples": job.total,
            "feature_dtype": manifest.get("tensors", {}).get("features"),
            "sampling": job.options.sampling.as_dict(),
            "excluded_samples": int(manifest.get("totals", {}).get("excluded_samples", 0)),
        },
        "ddtree_budgets": list(config.tree_nodes),
        "anchor_set": config.anchors,
        "anchor_drafts": config.anchor_drafts,
        "selection": job.selection,
        "device": job.options.device,
        "dtype": str(job.options.dtype).replace("torch.", ""),
        "attention": job.options.attention_backend,
        "world_size": dist.world,
        "anchors": anchors_done,
        "nonfinite_drafter": list(nonfinite or []),
        "wall_time_s": round(wall, 3),
        "versions": {
            "specreplay": specreplay_version(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "command": sys.argv,
    }


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
    from pipeline.common.space import writing

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


def identity_of(info: CheckpointInfo) -> dict:
    """The identity columns every results row carries."""
    return {"checkpoint": info.name, "checkpoint_hash": info.content_hash[:16], "checkpoint_step": info.step}


def score_checkpoint(
    ckpt: str,
    shardset: ShardSet,
    head: dict,
    out_dir: str,
    config: ScoreConfig,
    dist: Dist | None = None,
    progress=None,
) -> Outcome | None:
    """Score one checkpoint into out_dir (None on ranks other than 0): a pass of one
    (scoring/score/passes.py). What made it fail is raised. `progress(total, desc)` makes a
    progress bar (the CLI's)."""
    from scoring.score.passes import scored_lanes  # it builds on this module: imported on use

    [lane] = scored_lanes([ckpt], {ckpt: out_dir}, shardset, head, config, dist or Dist(), progress)
    if lane.error is not None:
        raise lane.error
    return lane.outcome


def results_lock(out_dir: str):
    """The lock file beside a results directory (`.<name>.lock`), held while it is scored."""
    parent, name = os.path.split(os.path.normpath(out_dir))
    return OutputLock(os.path.join(parent, f".{name}.lock"), f"results directory {out_dir}")


class NonFiniteLogitsError(UserError):
    """The drafter produced NaN/Inf logits on every sample scored: there is nothing to average."""

    def __init__(self, records: list[dict]):
        from scoring.score.console import describe_nonfinite

        super().__init__(
            f"no sample left to score: {describe_nonfinite(records)}; the checkpoint is damaged or "
            f"overflows (fp16 overflow in training?): score another checkpoint, or try --dtype fp32"
        )


def skipped(ckpt: str, out_dir: str) -> Outcome:
    """The outcome of a checkpoint already scored with the same settings, from its files."""
    import pyarrow.parquet as pq

    record = read_record(out_dir)
    summary = pq.read_table(os.path.join(out_dir, results.FILES["summary"]))
    return Outcome(ckpt, out_dir, "skipped", record, summary, name=record["checkpoint"]["name"])


def run_score(config: ScoreConfig, progress=None, on_outcome=None) -> list[Outcome]:
    """Score every checkpoint, each into --out/<parent>_<name>/ (result_dir_name), several per
    pass over the shards (scoring/score/passes.py). A checkpoint that cannot be scored (truncated,
    incompatible, results of other settings in the way) is a 'failed' outcome and the others go
    on. `on_outcome(outcome)` is called as each finishes (rank 0 only); returns the outcomes in
    checkpoint order."""
    from scoring.score.passes import scored_lanes  # it builds on this module: imported on use

    paths = expand_checkpoints(config.ckpts)
    dirs = output_dirs(paths, config.out)
    shardset = ShardSet(config.shards)
    check_anchor_set(shardset, config)
    dist = dist_from_env()
    device, dtype = resolve_device_dtype(config.device, config.dtype, dist)
    with timing.stage("prepare target head"):
        head = prepare_target_head(shardset.target_head(), device, dtype)  # the stored-dtype copy is dropped here
    init_dist(dist)
    outcomes = []
    for lane in scored_lanes(paths, dirs, shardset, head, config, dist, progress):
        if lane.outcome is not None:  # rank 0
            outcomes.append(lane.outcome)
            if on_outcome is not None:
                on_outcome(lane.outcome)
    return outcomes
