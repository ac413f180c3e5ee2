"""Where checkpoints are scored: several checkpoints per pass over the shards.

Scoring K checkpoints one after the other would decode every shard K times. A pass instead
loads the next checkpoints whose drafters' weights fit --memory-budget together (at least one;
more checkpoints: more passes), decodes each sample once and replays it through every drafter
of the pass, each into its own Collector, so every checkpoint's tables and run.json are those
it gets when scored alone (byte for byte, run.json's timing apart: tested).

Everything per checkpoint still holds per checkpoint (scoring/score/steps.py has the steps): its
results directory locked on rank 0 while it is scored, a killed run's staging removed, skipped
when already scored with these settings, a checkpoint that cannot be scored a 'failed' outcome
while the others go on, outcomes in checkpoint order. Under torchrun every rank opens the same
checkpoints and takes part in the same collectives in the same order: per checkpoint two
small all-gathers (its weight size, so that pass boundaries agree; what each rank found, so
that it stays live only where every rank loaded it), per checkpoint replayed a gather to rank
0, and a barrier after each checkpoint.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

import torch

from pipeline.common import timing
from pipeline.common.distributed import Dist, barrier
from pipeline.common.errors import UserError
from pipeline.shards import ShardSet
from proposers.checkpoints.load import read_drafter_config
from proposers.detect import build_drafter
from proposers.interface import TargetHead
from proposers.registry import family
from scoring.config import ScoreConfig
from scoring.score.collect import Collector
from scoring.score.outcome import Outcome, Status
from scoring.score.outputs import NonFiniteLogitsError, remove_dead_staging, results_lock, skipped, write_results
from scoring.score.record import run_facts, run_record
from scoring.score.steps import (
    Job,
    family_override,
    identity_of,
    prepare_job,
    replay_group,
    resolve_device_dtype,
    sample_groups,
    sample_tensors,
)

# A checkpoint's own problem (truncated, incompatible, locked, results of other settings in the
# way, NaN logits everywhere): it fails, the others go on. Anything else ends the run.
FAILURES = (UserError, FileNotFoundError, NotADirectoryError, PermissionError)


class LaneState(str, Enum):
    """Where a checkpoint is in a pass."""

    OPENING = "opening"
    LIVE = "live"  # loaded, to replay
    SKIPPED = "skipped"
    FAILED = "failed"
    SCORED = "scored"


@dataclass
class Lane:
    """One checkpoint on its way through a pass: opened (results directory locked on rank 0,
    drafter loaded), replayed beside the others, then written (or skipped, or failed) and let go."""

    ckpt: str
    out_dir: str
    started: float  # run.json's wall_time_s counts from here
    state: LaneState = LaneState.OPENING
    job: Job | None = None
    collector: Collector | None = None
    anchors: int = 0  # anchors this rank scored
    in_pass: bool = False  # replayed in a pass: takes part in that checkpoint's gather on every rank
    outcome: Outcome | None = None  # rank 0's; None on the other ranks
    error: BaseException | None = None  # why it failed (score_checkpoint raises it)
    locks: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # rank 0: its results directory's


def all_ranks(value, dist: Dist) -> list:
    """`value` of every rank, in rank order (a collective under torchrun)."""
    if dist.world == 1:
        return [value]
    values = [None] * dist.world
    torch.distributed.all_gather_object(values, value)
    return values


def weight_bytes(ckpt: str, dtype: torch.dtype, override=None) -> int:
    """The drafter's weights at the compute dtype, from its config alone (nothing loaded yet): what
    a pass holds for it. 0 when the config cannot be read (opening the checkpoint says why)."""
    try:
        config = read_drafter_config(ckpt, override=override)
        with torch.device("meta"):  # shapes without memory
            model = build_drafter(config)
        counted = family(config.family).parameters  # a family loading weights of its own (a draft model)
        params = sum(p.numel() for p in model.parameters()) if model is not None else counted(config) if counted else 0
    except FAILURES:
        return 0
    return params * torch.empty((), dtype=dtype).element_size()


def release(lane: Lane) -> None:
    """Let go of the checkpoint's drafter and results (its lock goes with its pass: close_locks)."""
    lane.job = lane.collector = None


def close_locks(lanes: list[Lane]) -> None:
    """The pass's results-directory locks, last taken first: the first may have created --out,
    and removes it when nothing was written only if it is the last one there."""
    for lane in reversed(lanes):
        lane.locks.close()


def fail(lane: Lane, error: BaseException, dist: Dist) -> None:
    """The checkpoint cannot be scored: a 'failed' outcome (rank 0), and it is let go."""
    lane.state, lane.error = LaneState.FAILED, error
    lane.outcome = (
        Outcome(lane.ckpt, lane.out_dir, Status.FAILED, error=str(error), name=lane.ckpt) if dist.main else None
    )
    release(lane)


def load(lane: Lane, shardset: ShardSet, config: ScoreConfig, dist: Dist) -> None:
    """Lock its results directory (rank 0), clear a killed run's staging, then load the drafter
    unless the directory already holds these results."""
    if dist.main:
        lane.locks.enter_context(results_lock(lane.out_dir))  # one writer per results directory
        remove_dead_staging(lane.out_dir)  # a killed run's half-written copy, whether or not we redo it
    lane.job = prepare_job(lane.ckpt, shardset, lane.out_dir, config, dist)
    lane.state = LaneState.LIVE if lane.job is not None else LaneState.SKIPPED
    if lane.job is None and dist.main:
        lane.outcome = skipped(lane.ckpt, lane.out_dir)  # read under the lock


def agree(lane: Lane, dist: Dist) -> None:
    """A checkpoint stays live only where every rank loaded it, so that all ranks run the same
    collectives for it; one rank's failure fails it everywhere (rank 0 says whose)."""
    states = all_ranks((lane.state, "" if lane.error is None else str(lane.error)), dist)  # every rank sends
    if lane.state == LaneState.FAILED:
        return
    failed = [(rank, message) for rank, (state, message) in enumerate(states) if state == LaneState.FAILED]
    if failed:
        fail(lane, UserError(f"rank {failed[0][0]}: {failed[0][1]}"), dist)
    elif len({state for state, _ in states}) > 1:
        fail(lane, UserError(f"the ranks disagree on whether {lane.out_dir} already holds these results"), dist)


def open_lane(ckpt: str, out_dir: str, shardset: ShardSet, config: ScoreConfig, dist: Dist, opened) -> Lane:
    """The checkpoint opened on every rank (live, skipped or failed); `opened` (an ExitStack)
    releases its lock whatever ends the run."""
    lane = Lane(ckpt, out_dir, time.time())
    opened.enter_context(lane.locks)
    try:
        load(lane, shardset, config, dist)
    except FAILURES as error:
        fail(lane, error, dist)
    agree(lane, dist)
    return lane


def passes(paths: list[str], dirs: dict, shardset: ShardSet, config: ScoreConfig, dist: Dist, opened):
    """The checkpoints opened a pass at a time, in order: a pass takes the next ones while their
    drafters' weights fit config.memory_bytes together (at least one). A checkpoint skipped or
    failed before any is loaded is handed on at once, so it is reported without waiting."""
    dtype = resolve_device_dtype(config.device, config.dtype, dist)[1]
    override = family_override(config.family)
    lanes, held = [], 0
    for path in paths:
        size = max(all_ranks(weight_bytes(path, dtype, override), dist))  # the same pass boundaries on every rank
        if held and held + size > config.memory_bytes:
            yield lanes
            lanes, held = [], 0
        lanes.append(open_lane(path, dirs[path], shardset, config, dist, opened))
        if lanes[-1].state == LaneState.LIVE:
            held += max(size, 1)
        elif not held:
            yield lanes
            lanes = []
    if lanes:
        yield lanes


def pass_bar(live: list[Lane], progress, dist: Dist):
    """The pass's progress bar (rank 0): `score <name>`, or the first name and how many more."""
    if progress is None or not dist.main:
        return None
    names = [lane.job.info.name for lane in live]
    label = names[0] if len(names) == 1 else f"{names[0]} + {len(names) - 1} more"
    return progress(len(live[0].job.mine), f"score {label}")


def replay_lane(lane: Lane, head: TargetHead, group: list, dist: Dist) -> None:
    """One drafter over one decoded group, into its own collector; a drafter that fails here
    leaves the others going."""
    try:
        for (index, sample), result in zip(group, replay_group(lane.job, head, group, lane.collector)):
            lane.collector.add(index, sample, result)
            lane.anchors += int(result.computed.sum())
    except FAILURES as error:
        fail(lane, error, dist)


def replay_groups(live: list[Lane], shardset: ShardSet, head: TargetHead, dist: Dist, bar) -> None:
    """Decode this rank's samples once (in the background) and replay each group through every
    drafter still live. The selection is every checkpoint's: it depends on the shards and the
    config only."""
    mine, device = live[0].job.mine, live[0].job.options.device
    tensors = sample_tensors([lane.job.proposer for lane in live])
    samples = shardset.samples(tensors=tensors, keep=set(mine).__contains__, pin_memory=device.startswith("cuda"))
    started = time.time()
    # the loop variable is rebound before the next group's replay: this group's tensors die first
    job = live[0].job  # every job of a run has its anchor set and grouping
    for group in sample_groups(zip(mine, samples), job.anchor_set, job.group_tokens):
        for lane in live:
            if lane.state == LaneState.LIVE:
                replay_lane(lane, head, group, dist)
        if bar is not None:
            anchors = sum(lane.anchors for lane in live)
            bar.update(len(group), anchors_per_s=f"{anchors / max(time.time() - started, 1e-9):.0f}")


def replay_pass(lanes: list[Lane], shardset: ShardSet, head: TargetHead, dist: Dist, progress) -> None:
    """Replay the pass's live checkpoints over one decoding of the shards (stage "shard pass")."""
    live = [lane for lane in lanes if lane.state == LaneState.LIVE]
    if not live:
        return
    stop_ids = list(shardset.settings["target"]["stop_token_ids"])
    for lane in live:
        lane.in_pass = True
        lane.collector = lane.job.collector(stop_ids)
    bar = pass_bar(live, progress, dist)
    try:
        with timing.stage("shard pass", samples=len(live[0].job.mine), checkpoints=len(live)):
            replay_groups(live, shardset, head, dist, bar)
    except FAILURES as error:  # the shards themselves (a damaged chunk): every checkpoint of the pass
        for lane in live:
            if lane.state == LaneState.LIVE:
                fail(lane, error, dist)
    finally:
        if bar is not None:
            bar.close()


def gather_lane(lane: Lane, dist: Dist) -> tuple[Collector, int] | None:
    """Rank 0: the checkpoint's results merged over every rank (a UserError when another rank
    failed it mid-pass); other ranks, or rank 0 when it failed it: None. Every rank sends, a
    failed one too, so that all run the same collectives."""
    part = (lane.collector, lane.anchors, "" if lane.error is None else str(lane.error))
    parts = [part] if dist.world == 1 else [None] * dist.world if dist.main else None
    if dist.world > 1:
        torch.distributed.gather_object(part, parts, dst=0)
    if not dist.main or lane.state != LaneState.LIVE:  # rank 0's own failure is its outcome already
        return None
    failed = [(rank, message) for rank, (_, _, message) in enumerate(parts) if message]
    if failed:
        raise UserError(f"rank {failed[0][0]}: {failed[0][1]}")
    collector, anchors = parts[0][0], parts[0][1]
    for other, count, _ in parts[1:]:
        collector.merge(other)
        anchors += count
    return collector, anchors


def write_lane(lane: Lane, collector: Collector, anchors: int, shardset: ShardSet, dist: Dist):
    """Rank 0: the checkpoint's tables and run.json written into place; its 'scored' outcome."""
    nonfinite = collector.nonfinite_samples()
    if nonfinite and not collector.parts:
        raise NonFiniteLogitsError(nonfinite)
    job = lane.job
    tables = collector.tables(identity_of(job.info), job.anchor_set)
    options, wall = job.options, time.time() - lane.started
    facts = run_facts(options.device, options.attention_backend, dist, anchors, nonfinite, wall)
    record = run_record(job.planned, lane.ckpt, job.info, shardset, options.sampling, facts)
    write_results(lane.out_dir, tables, record)
    lane.state = LaneState.SCORED
    summary = tables["summary"]
    return Outcome(
        lane.ckpt, lane.out_dir, Status.SCORED, record, summary, name=job.info.name, assumed=job.info.assumed
    )


def finish_lane(lane: Lane, shardset: ShardSet, dist: Dist) -> None:
    """Gather, write and let go of a checkpoint replayed in the pass (the others are settled)."""
    try:
        if lane.in_pass:
            merged = gather_lane(lane, dist)
            if merged is not None:
                lane.outcome = write_lane(lane, *merged, shardset, dist)
    except FAILURES as error:
        fail(lane, error, dist)
    finally:
        release(lane)


def scored_lanes(
    paths: list[str], dirs: dict, shardset: ShardSet, head: TargetHead, config: ScoreConfig, dist: Dist, progress=None
) -> Iterator[Lane]:
    """Every checkpoint scored, skipped or failed, handed on in checkpoint order a pass at a time."""
    with contextlib.ExitStack() as opened:  # every lock let go (last taken first), whatever ends the run
        for lanes in passes(paths, dirs, shardset, config, dist, opened):
            replay_pass(lanes, shardset, head, dist, progress)
            for lane in lanes:
                finish_lane(lane, shardset, dist)
                barrier(dist)  # every rank sees its run.json before a later checkpoint's skip check
            close_locks(lanes)
            yield from lanes
