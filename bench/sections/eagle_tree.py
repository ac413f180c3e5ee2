"""Section `eagle_tree`: the scoring cost per anchor of EAGLE-3's dynamic tree (sglang's default
setting 4x5-8, and 8x5-32) against its chain, on the same shards and drafter (issue 25 item 7).

The shards and decoder are section `families`' (synthetic, SmolLM2 shapes: the cost of a random
drafter depends on the shapes, not the values); the drafter is speculators' `Eagle3DraftModel`
with that decoder and random weights, saved by its own save_pretrained, 3 chain steps. Timed:
`run_score`, all anchors, without DDTree, once with `--eagle-trees ''` (the chain alone) and once
per tree setting (the chain plus that tree), alternating in rounds; per run the round with the
least wall time counts. The tree's cost is the difference, also shown by the product's own
"eagle tree" stage. Each anchor's tree runs 1 + (depth - 1) x topk drafter steps and as many
lm_head rows; the chain 3.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from bench.common import Phase, Rows, StageClock, log
from bench.sections.families import decoder_config, randomize
from bench.sections.length import PROMPT_TOKENS, SMOLLM2
from bench.standins import write_synthetic_shards

STEPS = 3  # the chain: speculators' default ttt_steps
SETTINGS = {"chain": "", "4x5-8": "4x5-8", "8x5-32": "8x5-32"}  # label -> --eagle-trees


def build_eagle3(out: Path, layer_ids: list[int], seed: int = 11) -> str:
    """speculators' Eagle3DraftModel at SmolLM2 shapes (before-layer aux ids), saved by it."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    hidden, vocab = SMOLLM2["hidden_size"], SMOLLM2["vocab_size"]
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=decoder_config(hidden, vocab),
        draft_vocab_size=vocab,
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in layer_ids],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )
    torch.manual_seed(seed)
    randomize(Eagle3DraftModel(config), seed).save_pretrained(str(out))
    return str(out)


def score_once(ckpt: str, shard_dir: str, out: Path, trees: str) -> dict:
    """One `run_score` (all anchors, no DDTree, `trees` as --eagle-trees): wall, anchors, stages."""
    from pipeline.common import timing
    from scoring.config import ScoreConfig
    from scoring.score.run import run_score

    clock = StageClock()
    config = ScoreConfig(
        ckpts=[ckpt], shards=shard_dir, out=str(out), tree_nodes=[], eagle_trees=[trees] if trees else [], force=True
    )
    with Phase() as phase, timing.recording(clock):
        [outcome] = run_score(config)
    assert outcome.status == "scored", outcome.error
    return {
        "wall_s": phase.seconds,
        "others_cpu": phase.others_cpu,
        "anchors": outcome.record["anchors"],
        "tree_s": clock.get("eagle tree"),
        "taus": {row["method"]: row["tau"] for row in outcome.summary.to_pylist() if row["dataset"] == "(all)"},
    }


def run(ctx) -> tuple[dict, Rows]:
    from pipeline.common.layer_ids import build_target_layer_ids

    args = ctx.args
    work = Path(ctx.work) / "eagle_tree"
    work.mkdir(parents=True, exist_ok=True)
    lengths = [48] if args.quick else [64, 96, 112, 128]
    try:
        layer_ids = build_target_layer_ids(SMOLLM2["num_layers"], 3)
        shard_dir = str(work / "shards")
        write_synthetic_shards(
            Path(shard_dir), lengths, SMOLLM2["hidden_size"], SMOLLM2["vocab_size"], SMOLLM2["num_layers"], layer_ids,
            PROMPT_TOKENS,
        )  # fmt: skip
        ckpt = build_eagle3(work / "eagle3", layer_ids)
        runs = {label: [] for label in SETTINGS}
        for rep in range(args.reps):
            order = list(SETTINGS) if rep % 2 == 0 else list(reversed(SETTINGS))
            log(f"eagle_tree: round {rep + 1}/{args.reps} ...")
            for label in order:
                runs[label].append(score_once(ckpt, shard_dir, work / "results" / label, SETTINGS[label]))
        best = {label: min(r, key=lambda x: x["wall_s"]) for label, r in runs.items()}
        result = {"lengths": lengths, "steps": STEPS, "reps": args.reps, "best": best, "runs": runs}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result, rows(result)


def rows(r: dict) -> Rows:
    out, best = Rows(), r["best"]
    chain = best["chain"]
    anchors = chain["anchors"]
    out.add(
        f"eagle_tree: EAGLE-3 scoring cost per anchor, chain ({r['steps']} steps) vs + sglang's dynamic tree: "
        f"{anchors} anchors at SmolLM2 shapes (synthetic), 1-layer random speculators drafter; min of {r['reps']} rounds"
    )
    for label, b in best.items():
        ms = 1e3 * b["wall_s"] / b["anchors"]
        tree = "" if b["tree_s"] is None else f", of it the tree {1e3 * b['tree_s'] / b['anchors']:.1f} ms"
        what = "chain alone" if label == "chain" else f"chain + eagle-tree-{label}"
        out.add(f"  {what}", f"{ms:.1f} ms{tree}, {b['wall_s'] / chain['wall_s']:.2f}x the chain")
    return out
