"""`specreplay score`: replay shards through drafter checkpoints and write the results.

Per checkpoint: load it (compatibility checked before any weight is read), replay every
sample (scoring/replay.py), gather the per-sample results (scoring/collect.py; under torchrun
rank 0 gathers every rank's), write the files scoring/results.py declares, then print.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch

from pipeline import timing
from pipeline.distributed import Dist, barrier, dist_from_env, init_dist, resolve_device
from pipeline.dtypes import resolve_dtype
from pipeline.shards import ShardSet
from pipeline.versions import specreplay_version
from scoring import results
from scoring.checkpoint import CheckpointInfo, check_compatibility, load_drafter, read_drafter_config
from scoring.collect import Collector
from scoring.config import ScoreConfig
from scoring.console import print_summary
from scoring.replay import ReplayOptions, prepare_target_head, replay_sample, replay_walks, select_feature_columns
from scoring.walk import stop_mask

SAMPLE_TENSORS = ["features", "topk_ids", "topk_logprobs", "argmax_mismatch"]


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


def result_dir_name(path: str) -> str:
    """Results sub-directory for one of several checkpoints: 'run1_step_200' for
    run1/step_200/ and 'run1_step_200' for run1/step_200.pt."""
    path = os.path.normpath(os.path.abspath(path))
    parent, base = os.path.split(path)
    stem = os.path.splitext(base)[0] if os.path.isfile(path) else base
    return f"{os.path.basename(parent)}_{stem}"


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


def already_scored(
    out_dir: str, content_hash: str, shards_id: str, tree_nodes: list[int], samples: int, anchor_set: str
) -> bool:
    """True when out_dir holds results of this checkpoint content on the same shards, budgets,
    number of samples and anchor set."""
    run_path = os.path.join(out_dir, results.FILES["run"])
    if not os.path.exists(run_path):
        return False
    with open(run_path) as f:
        previous = json.load(f)
    return (
        previous.get("checkpoint", {}).get("content_hash") == content_hash
        and previous.get("shards", {}).get("identity") == shards_id
        and previous.get("ddtree_budgets") == list(tree_nodes)
        and previous.get("shards", {}).get("samples") == samples
        and previous.get("anchor_set", "all") == anchor_set
    )


def prepare_job(ckpt: str, shardset: ShardSet, out_dir: str, config: ScoreConfig, dist: Dist) -> Job | None:
    """Load the checkpoint for replay; None when out_dir already holds its results."""
    device, dtype = resolve_device_dtype(config.device, config.dtype, dist)
    manifest = shardset.manifest
    check_compatibility(read_drafter_config(ckpt), manifest, ckpt)  # before reading gigabytes of weights
    with timing.stage("load drafter"):
        drafter, info = load_drafter(ckpt, dtype=dtype, device=device)
    total = shardset.num_samples if config.limit is None else min(config.limit, shardset.num_samples)
    if not config.force and already_scored(
        out_dir, info.content_hash, shards_identity(manifest), config.tree_nodes, total, config.anchors
    ):
        if dist.main and not config.quiet:
            print(f"{info.name}: already scored on these shards in {out_dir} (use --force to redo)")
        return None
    tree_nodes = sorted(set(config.tree_nodes))
    options = ReplayOptions(
        max_tree_nodes=max(tree_nodes) if tree_nodes else 0,
        memory_bytes=config.memory_bytes,
        dtype=dtype,
        device=device,
        attention=config.attention,
    )
    settings = manifest["settings"]
    return Job(
        drafter,
        info,
        options,
        tree_nodes,
        [i for i in range(total) if i % dist.world == dist.rank],
        total,
        int(settings["max_new_tokens"]),
        settings["layer_ids"],
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


def replay_all(job: Job, shardset: ShardSet, head: dict, config: ScoreConfig, progress=None) -> tuple[Collector, int]:
    """Replay this rank's samples; returns the collected results and the anchors scored."""
    stop_ids = list(shardset.settings["target"]["stop_token_ids"])
    collector = Collector(job.tree_nodes, stop_ids, job.info.config.block_size)
    samples = shardset.samples(
        tensors=SAMPLE_TENSORS, keep=set(job.mine).__contains__, pin_memory=job.options.device.startswith("cuda")
    )
    anchors_done, started = 0, time.time()
    for group in sample_groups(zip(job.mine, samples), config.anchors, config.walk_group_tokens):
        for (index, sample), result in zip(group, replay_group(job, head, group, config, collector)):
            collector.add(index, sample, result)
            anchors_done += int(result.computed.sum())
        if progress is not None:
            progress.update(len(group), anchors_per_s=f"{anchors_done / max(time.time() - started, 1e-9):.0f}")
        del group, sample, result  # the next sample's replay must not keep this one's tensors alive
    return collector, anchors_done


def gather(collector: Collector, anchors_done: int, dist: Dist) -> tuple[Collector, int] | None:
    """Rank 0 merges every rank's results; other ranks get None."""
    if dist.world == 1:
        return collector, anchors_done
    gathered = [None] * dist.world if dist.main else None
    torch.distributed.gather_object((collector, anchors_done), gathered, dst=0)
    if not dist.main:
        return None
    for other, count in gathered[1:]:
        collector.merge(other)
        anchors_done += count
    return collector, anchors_done


def run_record(
    ckpt: str, job: Job, shardset: ShardSet, config: ScoreConfig, dist: Dist, anchors_done: int, wall: float
) -> dict:
    """run.json: what was scored, on what, how, and how long it took."""
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
        },
        "ddtree_budgets": list(config.tree_nodes),
        "anchor_set": config.anchors,
        "device": job.options.device,
        "dtype": str(job.options.dtype).replace("torch.", ""),
        "attention": job.options.attention_backend,
        "world_size": dist.world,
        "anchors": anchors_done,
        "wall_time_s": round(wall, 3),
        "versions": {
            "specreplay": specreplay_version(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "command": sys.argv,
    }


def write_results(out_dir: str, tables: dict, record: dict) -> None:
    """The parquet files, then run.json last: a directory with run.json is complete."""
    os.makedirs(out_dir, exist_ok=True)
    for kind in ("anchors", "walk", "samples", "summary"):
        if tables[kind] is not None:
            results.write_table(tables[kind], out_dir, kind)
    run_path = os.path.join(out_dir, results.FILES["run"])
    with open(run_path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(run_path + ".tmp", run_path)


def score_checkpoint(
    ckpt: str,
    shardset: ShardSet,
    head: dict,
    out_dir: str,
    config: ScoreConfig,
    dist: Dist | None = None,
    progress=None,
) -> dict | None:
    """Score one checkpoint; returns its run record (None when skipped as already scored, and
    on ranks other than 0). `progress(total, desc)` makes a progress bar (the CLI's)."""
    dist = dist or Dist()
    started = time.time()
    job = prepare_job(ckpt, shardset, out_dir, config, dist)
    if job is None:
        return None
    bar = progress(len(job.mine), f"score {job.info.name}") if progress is not None and dist.main else None
    collector, anchors_done = replay_all(job, shardset, head, config, bar)
    if bar is not None:
        bar.close()
    merged = gather(collector, anchors_done, dist)
    if merged is None:
        return None
    collector, anchors_done = merged
    identity = {
        "checkpoint": job.info.name,
        "checkpoint_hash": job.info.content_hash[:16],
        "checkpoint_step": job.info.step,
    }
    tables = collector.tables(identity, config.anchors)
    record = run_record(ckpt, job, shardset, config, dist, anchors_done, time.time() - started)
    write_results(out_dir, tables, record)
    if not config.quiet:
        print_summary(tables["summary"], job.info.name, out_dir, record)
    return record


def run_score(config: ScoreConfig, progress=None) -> list[dict]:
    """Score every checkpoint; each gets its own results directory (the --out itself for one
    checkpoint, --out/<name> for several)."""
    paths = expand_checkpoints(config.ckpts)
    shardset = ShardSet(config.shards)
    dist = dist_from_env()
    device, dtype = resolve_device_dtype(config.device, config.dtype, dist)
    with timing.stage("prepare target head"):
        head = prepare_target_head(shardset.target_head(), device, dtype)  # the stored-dtype copy is dropped here
    init_dist(dist)
    records = []
    for path in paths:
        out_dir = config.out if len(paths) == 1 else os.path.join(config.out, result_dir_name(path))
        record = score_checkpoint(path, shardset, head, out_dir, config, dist, progress)
        barrier(dist)  # every rank sees run.json before the next checkpoint's skip check
        if record is not None:
            records.append(record)
    return records
