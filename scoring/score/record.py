"""run.json: what a score run scored, on what, how, and how long it took.

Built here, read back here: `planned_record` is the part known before any replay (what makes
two runs the same work), `run_record` completes it after the replay, `settings_of` reads
back what `differences` compares when a results directory is scored again.
"""

from __future__ import annotations

import copy
import hashlib
import json
import platform
import sys

import torch

from pipeline.common.distributed import Dist
from pipeline.common.dtypes import dtype_name
from pipeline.common.settings import settings_diff
from pipeline.common.versions import specreplay_version
from pipeline.shards import ShardSet
from proposers.checkpoints.load import CheckpointInfo
from proposers.registry import family
from scoring import results
from scoring.config import ScoreConfig
from scoring.methods.eagle_tree import EAGLE_TREES


def shards_identity(manifest: dict) -> str:
    """Content identity of an extract: its settings and every shard's checksum."""
    blob = json.dumps(
        {"settings": manifest["settings"], "shards": sorted((s["file"], s["crc32"]) for s in manifest["shards"])},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def planned_record(
    info: CheckpointInfo,
    shardset: ShardSet,
    config: ScoreConfig,
    dtype,
    selection: dict,
    trees: bool = True,
    plan: dict | None = None,
) -> dict:
    """The settings part of run.json, known before any replay: what `differences` compares.
    `trees`: whether the DDTree budgets are replayed (not for a proposer DDTree does not apply to);
    `plan`: the tree methods' settings (scoring/methods/registry.py), its EAGLE trees recorded."""
    eagle_trees = (plan or {}).get(EAGLE_TREES.kind, ())
    return {
        "checkpoint": {"content_hash": info.content_hash},
        "shards": {"identity": shards_identity(shardset.manifest), "samples": selection["samples"]},
        "ddtree_budgets": list(config.tree_nodes) if trees else [],
        "eagle_trees": [tree.name for tree in eagle_trees],
        # an autoregressive chain's drafts per anchor (--steps or the checkpoint's); None: a block family's
        "chain_steps": info.config.block_size if family(info.config.family).chain_steps else None,
        # --steps on a block family (an engine's shorter block); None: its trained block
        "block_steps": None if family(info.config.family).chain_steps else config.steps,
        "walk_rule": config.walk_rule,
        "confidence_threshold": config.confidence_threshold,  # --confidence-threshold; None: the checkpoint's
        "anchor_set": config.anchors,
        "anchor_drafts": config.anchor_drafts,
        "dtype": dtype_name(dtype),
        "selection": selection,
    }


def run_record(planned: dict, ckpt: str, info: CheckpointInfo, shardset: ShardSet, sampling, facts: dict) -> dict:
    """run.json: the planned settings completed with the checkpoint's and the shards' identity,
    the `sampling` the replay used, and `facts` (device, attention, world_size, anchors, nonfinite_drafter, wall_time_s): the
    samples left out of every number are `nonfinite_drafter` (NaN/Inf drafter logits, with
    their anchors) and shards.excluded_samples (NaN/Inf target values the extract never stored)."""
    manifest = shardset.manifest
    record = copy.deepcopy(planned)  # the planned record stays as planned
    record["checkpoint"].update(
        path=info.path,  # absolute, or a baseline's name as given
        name=info.name,
        step=info.step,
        family=info.config.family,
        layout=info.config.layout,
        config=info.config_raw,
    )
    record["shards"].update(
        uri=shardset.uri,
        sampling=sampling.as_dict(),
        target=manifest.get("target", {}).get("name"),
        # the target's sizes (settings.target): what a speed profile is checked against (scoring/speed/)
        target_facts={k: v for k, v in manifest["settings"]["target"].items() if k in results.TARGET_FACTS},
        feature_dtype=manifest.get("tensors", {}).get("features"),
        excluded_samples=int(manifest.get("totals", {}).get("excluded_samples", 0)),
        responses=manifest.get("settings", {}).get("responses"),
        mismatched_samples={
            sample_id: n
            for entry in manifest.get("shards", [])
            for sample_id, n in entry.get("mismatched_samples", {}).items()
        },
    )
    record.update(facts)
    record["versions"] = {
        "specreplay": specreplay_version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    record["command"] = sys.argv
    return record


def run_facts(device: str, attention: str, dist: Dist, anchors: int, nonfinite: list | None, wall: float) -> dict:
    """The parts of run.json only the replay knows."""
    return {
        "device": device,
        "attention": attention,
        "world_size": dist.world,
        "anchors": anchors,
        "nonfinite_drafter": list(nonfinite or []),
        "wall_time_s": round(wall, 3),
    }


def read_record(out_dir: str) -> dict | None:
    """The run.json of a finished results directory (checked, results.RunRecord), None when there is none."""
    return results.read_run_record(out_dir)


def settings_of(record: dict) -> dict:
    """What makes two score runs the same work (and so their results interchangeable)."""
    selection = record.get("selection") or {}
    return {
        "checkpoint content hash": record.get("checkpoint", {}).get("content_hash"),
        "shards identity": record.get("shards", {}).get("identity"),
        "ddtree budgets": record.get("ddtree_budgets"),
        "eagle trees": record.get("eagle_trees") or [],
        "chain steps": record.get("chain_steps"),
        "block steps": record.get("block_steps"),
        "walk rule": record.get("walk_rule", "dflash"),
        "confidence threshold": record.get("confidence_threshold"),
        "anchor set": record.get("anchor_set", "all"),
        "anchor drafts": record.get("anchor_drafts", False),
        "requests": record.get("requests"),  # a proposer with state across requests: their order
        "dtype": record.get("dtype"),
        "samples": record.get("shards", {}).get("samples"),
        "sample ids": selection.get("ids_hash"),
    }


def differences(previous: dict, planned: dict) -> list[str]:
    """'name: before -> now' for every setting that differs (ids only when both recorded them)."""
    before, now = settings_of(previous), settings_of(planned)
    if before["sample ids"] is None or now["sample ids"] is None:
        before.pop("sample ids"), now.pop("sample ids")
    return settings_diff(before, now)
