"""The entry points of `specreplay score`: every checkpoint a pattern names, each into its own
results directory, several per pass over the shards (scoring/score/passes.py)."""

from __future__ import annotations

from pipeline.common import timing
from pipeline.common.distributed import Dist, dist_from_env, init_dist, leave_dist
from pipeline.shards import ShardSet
from proposers.interface import TargetHead
from scoring.config import ScoreConfig
from scoring.replay.packing import prepare_target_head
from scoring.score.checkpoints import expand_checkpoints
from scoring.score.outcome import Outcome
from scoring.score.outputs import output_dirs
from scoring.score.passes import scored_lanes
from scoring.score.steps import check_anchor_set, resolve_device_dtype


def score_checkpoint(
    ckpt: str,
    shardset: ShardSet,
    head: TargetHead,
    out_dir: str,
    config: ScoreConfig,
    dist: Dist | None = None,
    progress=None,
) -> Outcome | None:
    """Score one checkpoint into out_dir (None on ranks other than 0): a pass of one
    (scoring/score/passes.py). What made it fail is raised. `progress(total, desc)` makes a
    progress bar (the CLI's)."""
    [lane] = scored_lanes([ckpt], {ckpt: out_dir}, shardset, head, config, dist or Dist(), progress)
    if lane.error is not None:
        raise lane.error
    return lane.outcome


def run_score(config: ScoreConfig, progress=None, on_outcome=None) -> list[Outcome]:
    """Score every checkpoint, each into --out/<parent>_<name>/ (result_dir_name), several per
    pass over the shards (scoring/score/passes.py). A checkpoint that cannot be scored (truncated,
    incompatible, results of other settings in the way) is a 'failed' outcome and the others go
    on. `on_outcome(outcome)` is called as each finishes (rank 0 only); returns the outcomes in
    checkpoint order."""
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
    try:
        for lane in scored_lanes(paths, dirs, shardset, head, config, dist, progress):
            if lane.outcome is not None:  # rank 0
                outcomes.append(lane.outcome)
                if on_outcome is not None:
                    on_outcome(lane.outcome)
    finally:
        leave_dist(dist)
    return outcomes
