"""Section `checkpoints`: scoring four checkpoints with one `run_score` call (one pass over the
shards, every sample decoded once for the four drafters: scoring/score/passes.py) against four
separate calls, side by side on the same samples.

Synthetic shards at SmolLM2 shapes (hidden 576, vocab 49152, 5 feature layers; bench/standins.py)
and four random one-layer drafters, block 16, all-anchor chain replay at score's defaults (fp32
on CPU, --memory-budget 2 GiB: the four drafters' weights fit one pass). After a warm-up (a decode
of every sample alone, which also fills the page cache, and a one-sample score), the separate
calls run first, then the single call. Per side: wall time, the replay (stage "replay anchors",
the same work on both sides: a difference there is noise), the shard passes the product marks
(stage "shard pass"), and the target head's read and cast, which every call pays once. The
decode alone (best of 3, in this process, no prefetch) against one separate call's wall time
says how much of the work decoding is; what one call saves by design is the head's read and cast
and the decoding not repeated. Whether the two sides' results are identical (parquet bytes, and
run.json but its timings) is compared file by file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from bench.common import Phase, Rows, StageClock, best_of, log
from bench.sections.length import PROMPT_TOKENS, SMOLLM2
from bench.standins import write_synthetic_shards

CHECKPOINTS = 4
BLOCK_SIZE = 16
HEAD_STAGES = ("read target head", "prepare target head")


def write_inputs(work: Path, lengths: list[int]) -> tuple[str, list[str], list[int]]:
    """Synthetic shards (one sample per response length) and CHECKPOINTS random drafters."""
    from pipeline.common.layer_ids import build_target_layer_ids
    from proposers.detect import parse_drafter_config
    from proposers.dflash.model import DFlashDrafter
    from scoring.fit import new_drafter_config, save_drafter

    hidden, vocab, num_layers = SMOLLM2["hidden_size"], SMOLLM2["vocab_size"], SMOLLM2["num_layers"]
    layer_ids = build_target_layer_ids(num_layers, 5)
    shard_dir = work / "shards"
    write_synthetic_shards(shard_dir, lengths, hidden, vocab, num_layers, layer_ids, PROMPT_TOKENS)
    target = {"hidden_size": hidden, "num_layers": num_layers, "vocab_size": vocab}
    raw = new_drafter_config(target, num_layers=1, block_size=BLOCK_SIZE, layer_ids=layer_ids)
    ckpts = []
    for seed in range(CHECKPOINTS):
        torch.manual_seed(seed)
        drafter = DFlashDrafter(parse_drafter_config(raw, "bench drafter"))
        ckpts.append(save_drafter(drafter, str(work / "runs" / f"step_{seed + 1}")))
    return str(shard_dir), ckpts, layer_ids


def decode_seconds(shard_dir: str) -> float:
    """Every sample decoded as score decodes them (its tensors), nothing replayed: best of 3."""
    from pipeline.shards import ShardSet
    from scoring.score.steps import SAMPLE_TENSORS

    shardset = ShardSet(shard_dir)
    return best_of(lambda: sum(1 for _ in shardset.samples(tensors=SAMPLE_TENSORS, prefetch=0)), 3)


def score_side(shard_dir: str, calls: list[list[str]], out: Path) -> dict:
    """run_score once per list of checkpoints in `calls`, timed together, with the product's stages."""
    from pipeline.common import timing
    from scoring.config import ScoreConfig
    from scoring.score.run import run_score

    clock, outcomes = StageClock(), []
    with Phase() as phase, timing.recording(clock):
        for ckpts in calls:
            outcomes += run_score(ScoreConfig(ckpts=ckpts, shards=shard_dir, out=str(out), tree_nodes=[], force=True))
    assert all(o.status == "scored" for o in outcomes), [o.error for o in outcomes]
    return {
        **phase.figures(),
        "calls": len(calls),
        "shard_passes": clock.calls.get("shard pass", 0),
        "head_s": sum(clock.get(name) or 0.0 for name in HEAD_STAGES),
        "replay_s": clock.get("replay anchors") or 0.0,
        "anchors": sum(o.record["anchors"] for o in outcomes),
        "stages": clock.figures(),
        "dirs": [o.out_dir for o in outcomes],
    }


def contents(directory: str) -> dict[str, str]:
    """Per results file its digest; run.json's without its timing."""
    found = {}
    for name in sorted(os.listdir(directory)):
        data = Path(directory, name).read_bytes()
        if name == "run.json":
            record = json.loads(data)
            record.pop("wall_time_s")
            data = json.dumps(record, sort_keys=True).encode()
        found[name] = hashlib.sha256(data).hexdigest()
    return found


def identical(separate: dict, one: dict) -> dict:
    """Whether every checkpoint's results files are the same on both sides, and how many were compared."""
    pairs = list(zip(separate["dirs"], one["dirs"]))
    same = all(contents(a) == contents(b) for a, b in pairs)
    return {"identical": same, "files": sum(len(contents(a)) for a, _ in pairs)}


def run(ctx) -> tuple[dict, Rows]:
    from scoring.config import ScoreConfig
    from scoring.score.passes import weight_bytes
    from scoring.score.run import run_score

    work = Path(ctx.work) / "checkpoints"
    work.mkdir(parents=True, exist_ok=True)
    lengths = [48, 64] if ctx.args.quick else [64, 96, 112, 128]
    try:
        log(f"checkpoints: synthetic shards at SmolLM2 shapes ({lengths} tokens) and {CHECKPOINTS} drafters ...")
        shard_dir, ckpts, layer_ids = write_inputs(work, lengths)
        decode_s = decode_seconds(shard_dir)
        run_score(ScoreConfig(ckpts=ckpts[:1], shards=shard_dir, out=str(work / "warm-up"), tree_nodes=[], limit=1))
        log(f"checkpoints: {CHECKPOINTS} separate run_score calls ...")
        separate = score_side(shard_dir, [[c] for c in ckpts], work / "separate")
        log(f"checkpoints: one run_score call with the {CHECKPOINTS} checkpoints ...")
        one = score_side(shard_dir, [ckpts], work / "one")
        result = {
            "lengths": lengths,
            "prompt_tokens": PROMPT_TOKENS,
            "layer_ids": layer_ids,
            "block_size": BLOCK_SIZE,
            "drafter_weight_bytes": weight_bytes(ckpts[0], torch.float32),
            "decode_s": decode_s,
            "separate": separate,
            "one": one,
            **identical(separate, one),
        }
        log(f"checkpoints: {separate['wall_s']:.1f} s separately, {one['wall_s']:.1f} s in one call")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result, rows(result)


def side_text(side: dict) -> str:
    passes = side["shard_passes"]
    return (
        f"replay {side['replay_s']:.1f} s, target head read + cast {side['head_s']:.1f} s, "
        f"shards decoded {passes} time{'s' if passes != 1 else ''}"
    )


def rows(r: dict) -> Rows:
    out, sep, one = Rows(), r["separate"], r["one"]
    per_call = sep["wall_s"] / sep["calls"]
    # what one call saves by design: the head read and cast, and the decoding, not repeated
    saved = sep["head_s"] - one["head_s"] + r["decode_s"] * (sep["shard_passes"] - one["shard_passes"])
    out.add(
        f"{CHECKPOINTS} checkpoints, SmolLM2 shapes, 1-layer drafters, block {r['block_size']}, chain: "
        f"{len(r['lengths'])} samples, {one['anchors'] // CHECKPOINTS} anchors each"
    )
    out.add(
        f"  {sep['calls']} separate run_score calls",
        f"{sep['wall_s']:.1f} s: {side_text(sep)}",
        others=sep["others_cpu"],
    )
    out.add(
        f"  one run_score call, {CHECKPOINTS} checkpoints",
        f"{one['wall_s']:.1f} s ({sep['wall_s'] / one['wall_s']:.2f}x): {side_text(one)}",
        others=one["others_cpu"],
    )
    out.add(
        "  decoding every sample alone (share of one checkpoint's call)",
        f"{r['decode_s'] * 1000:.0f} ms ({100 * r['decode_s'] / per_call:.2f}%)",
    )
    out.add(
        "  saved by design (head read + cast and decoding not repeated)",
        f"{saved:.1f} s; wall times differ by {sep['wall_s'] - one['wall_s']:+.1f} s, the rest of that in "
        f"replay, the same work on both sides",
    )
    out.add(
        "  results identical (parquet bytes, run.json but timings)",
        f"{'yes' if r['identical'] else 'NO'} ({r['files']} files)",
        "identical",
        met=r["identical"],
    )
    return out
