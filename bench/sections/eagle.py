"""Section `eagle`: what EAGLE-3 costs to score offline, and what its aux layers cost to store.

1. Scoring cost per anchor (issue 25 item 7). Synthetic shards at SmolLM2 shapes (bench/standins.py,
   as the families section: the cost of a random drafter depends on the shapes) holding the 5 DFlash
   feature layers and EAGLE-3's 3 aux layers. Two drafters with the same one-layer decoder (SmolLM2's
   attention and MLP shapes), random weights, each built and saved by its reference's own classes:
   z-lab's DFlashDraftModel (block 16: 15 drafts) and speculators' Eagle3DraftModel (K_STEPS drafts,
   the whole vocabulary). Timed, alternated over `--reps` rounds, min per side:
   * `run_score` of each, all anchors, chain only (ratio EAGLE-3 / DFlash v1 per anchor), and of
     speculators' PEagleDraftModel (P-EAGLE: the same decoder, K_STEPS drafts from one pass online,
     its mask slots replayed as the step chain's steps; issue 36 item 5), the EAGLE repository's
     Model (EAGLE-1/2: the same decoder shapes over the target's last layer, K_STEPS steps) and the
     MTP heads of four targets at SmolLM2's widths (bench/mtp_heads.py: Qwen3.5 dense and MoE,
     GLM-4.5's and DeepSeek-V3's NextN heads; K_STEPS steps over the last layer's output and the
     target's final norm, which the shards then hold);
   * `run_score` of the EAGLE-3 drafter with each of TREES (the chain plus sglang's dynamic tree,
     `--eagle-trees`; its cost also as the product's "eagle tree" stage): every branch is its own
     drafter step and lm_head row, 1 + (depth - 1) x topk of them per anchor;
   * the online EAGLE loop of tests/helpers/eagle3_online.py (speculators' own modules on a growing
     transformers cache, one anchor at a time as vLLM's proposer runs it) proposing at every anchor of
     the same shards: per anchor, the slot the target verified before it written, then K_STEPS draft
     steps, the cache cut back. That is the online work behind the same all-anchor numbers; the ratio
     offline / online is printed beside the ratio of their FLOPs (torch's FlopCounterMode over one
     sample on each side), so batching's gain is told apart from arithmetic either side skips.
2. Storage (issue 25 item 1): SmolLM2-135M `extract` (bf16, --limit 4) with a z-lab DFlash config,
   then with that config and an EAGLE-3 config (speculators' default aux layers [2, L // 2, L - 3]):
   the stored bytes per token of each, the extra for the aux layers DFlash does not already store.
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
from pathlib import Path

import torch

from bench.common import Phase, Rows, log
from bench.mtp_heads import KINDS as MTP_KINDS, write_head
from bench.sections.families import DECODER, INIT_STD, score_once, zlab
from bench.sections.length import PROMPT_TOKENS, SMOLLM2

K_STEPS = 5  # chain drafts per anchor: sglang's default --speculative-num-steps
TREES = ("4x5-8", "8x5-32")  # --eagle-trees: sglang's default (topk 4, 5 steps, 8 draft tokens), a wider one
STORE_PROMPTS = 4
# the MTP heads' rows (issue 36 item 5): a target's own head, K_STEPS steps (`score --steps`)
MTP_LABELS = (
    ("qwen3_5", "Qwen3.5 MTP head (dense)"),
    ("qwen3_5_moe", "Qwen3.5-MoE MTP head (32 experts, top 4)"),
    ("glm4_moe", "GLM-4.5 NextN head (32 experts, top 4)"),
    ("deepseek_v3", "DeepSeek-V3 NextN head (MLA, 32 experts, top 4)"),
    ("mimo_v2_flash", "MiMo-V2-Flash MTP heads (vLLM's rule: head 0 each step)"),
)


# speculators' EAGLE-3 config without aux ids: its default layers (extract --draft-config reads them)
EAGLE_CONFIG = {
    "speculators_model_type": "eagle3",
    "transformer_layer_config": {
        "hidden_size": SMOLLM2["hidden_size"],
        "num_hidden_layers": 1,
        "vocab_size": SMOLLM2["vocab_size"],
    },
}


def eagle_aux_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers in the project's numbering, as extract reads them from EAGLE_CONFIG."""
    from proposers.layouts import feature_layers_of

    return feature_layers_of(EAGLE_CONFIG, "bench EAGLE-3 config", num_layers)


def decoder_shapes() -> dict:
    """The one-layer decoder's shapes as the tests' reference builders take them."""
    shapes = dict(heads=DECODER["num_attention_heads"], kv_heads=DECODER["num_key_value_heads"])
    return shapes | dict(head_dim=DECODER["head_dim"], mlp=DECODER["intermediate_size"])


def eagle3_drafter(out: Path, aux_ids: list[int], seed: int):
    """speculators' Eagle3DraftModel at SmolLM2 shapes, saved by its save_pretrained; returned for the online loop."""
    from tests.helpers.eagle3_reference import save, speculators_eagle3

    shapes = decoder_shapes()
    model = speculators_eagle3(
        vocab=SMOLLM2["vocab_size"],
        hidden=SMOLLM2["hidden_size"],
        aux_ids=tuple(i + 1 for i in aux_ids),
        steps=K_STEPS,
        std=INIT_STD,
        seed=seed,
        shapes=shapes,
    )
    save(model, out)
    return model


def eagle1_drafter(out: Path, seed: int) -> str:
    """The EAGLE repository's Model (eagle-llm) at SmolLM2 shapes (K_STEPS drafts), saved as it saves it."""
    from tests.helpers.eagle1_online import random_eagle1

    shapes = decoder_shapes()
    return random_eagle1(
        out,
        vocab=SMOLLM2["vocab_size"],
        hidden=SMOLLM2["hidden_size"],
        std=INIT_STD,
        seed=seed,
        shapes=shapes,
        steps=K_STEPS,
    )


def peagle_drafter(out: Path, aux_ids: list[int], seed: int) -> str:
    """speculators' PEagleDraftModel at SmolLM2 shapes (K_STEPS drafts), saved by its save_pretrained."""
    from tests.helpers.peagle_online import random_peagle

    vocab, hidden, before = SMOLLM2["vocab_size"], SMOLLM2["hidden_size"], tuple(i + 1 for i in aux_ids)
    return random_peagle(
        out, vocab=vocab, hidden=hidden, aux_ids=before, steps=K_STEPS, seed=seed, std=INIT_STD, shapes=decoder_shapes()
    )


# ---------------------------------------------------------------------------------------------
# the online loop at every anchor


def drafts_at(anchor: int, prompt_len: int, max_new: int) -> int:
    """Drafts at `anchor`: K_STEPS, fewer where the budget ends (as the replay's block_len)."""
    return max(0, min(K_STEPS, prompt_len + max_new - anchor - 1))


@torch.inference_mode()
def online_sample(model, sample, columns, max_new: int) -> int:
    """Propose at every anchor of one sample on a growing cache; returns the anchors."""
    from tests.helpers.eagle3_online import DraftCache, propose

    seq, features = sample.input_ids, columns(sample.tensors["features"]).float()
    cache, anchors = DraftCache(model), 0
    for anchor in range(sample.prompt_len, seq.numel() - 1):
        propose(cache, features, seq, anchor, drafts_at(anchor, sample.prompt_len, max_new), 0.0)
        cache.crop(anchor)  # the draft slots go; the target-written ones stay, as after verification
        anchors += 1
    return anchors


def feature_columns(stored: list[int], aux_ids: list[int]):
    """features [T, n*H] of the `stored` layers -> the aux layers' [T, 3*H] in their order (the replay's own selection)."""
    from scoring.replay.packing import select_feature_columns

    return lambda features: select_feature_columns(features, stored, aux_ids)


def online_all_anchors(model, shard_dir: str, aux_ids: list[int], limit: int | None = None) -> dict:
    from pipeline.shards import ShardSet

    shards = ShardSet(shard_dir)
    settings = shards.manifest["settings"]
    columns, max_new = feature_columns(settings["layer_ids"], aux_ids), settings["max_new_tokens"]
    with Phase() as phase:
        anchors = sum(online_sample(model, s, columns, max_new) for s in itertools.islice(shards.samples(), limit))
    return {"wall_s": phase.seconds, "others_cpu": phase.others_cpu, "anchors": anchors}


def flops_per_anchor(run) -> float:
    """Matmul and attention FLOPs per anchor of `run()` (which returns its anchors), as torch counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        anchors = run()
    return counter.get_total_flops() / anchors


# ---------------------------------------------------------------------------------------------
# storage: the aux layers' bytes


def extract_bytes_per_token(ctx, out: Path, configs: list[Path]) -> float:
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.run import run_extract

    args = ctx.args
    config = ExtractConfig(
        prompts=args.prompt_set,
        limit=STORE_PROMPTS,
        out=str(out),
        max_new_tokens=args.max_new_tokens,
        dtype="bfloat16",
        draft_config=[str(c) for c in configs],
        overwrite=True,
        quiet=True,
    )
    totals = run_extract(config)["totals"]
    return totals["bytes"] / totals["tokens"]


def aux_layer_bytes(ctx, work: Path, dflash_ids: list[int], aux_ids: list[int]) -> dict:
    num_layers = SMOLLM2["num_layers"]
    dflash = work / "dflash.json"
    dflash.write_text(json.dumps({"num_hidden_layers": 1, "dflash_config": {"target_layer_ids": dflash_ids}}))
    eagle = work / "eagle3.json"
    eagle.write_text(json.dumps(EAGLE_CONFIG))
    alone = extract_bytes_per_token(ctx, work / "store-dflash", [dflash])
    both = extract_bytes_per_token(ctx, work / "store-both", [dflash, eagle])
    added = sorted(set(aux_ids) - set(dflash_ids))
    return {
        "num_layers": num_layers,
        "dflash_ids": dflash_ids,
        "aux_ids": aux_ids,
        "added_layers": added,
        "bytes_per_token_dflash": alone,
        "bytes_per_token_both": both,
        "extra_bytes_per_token": both - alone,
        "raw_bf16_per_layer": 2 * SMOLLM2["hidden_size"],
    }


# ---------------------------------------------------------------------------------------------


def one_round(ckpts: dict, model, shard_dir: str, aux_ids: list[int], work: Path) -> dict:
    """Every side once: DFlash v1 and the EAGLE-3 chain offline, the chain plus each tree, online."""
    sides = {
        "dflash": lambda: score_once(ckpts["dflash"], shard_dir, work / "results-dflash"),
        "eagle3": lambda: score_once(ckpts["eagle3"], shard_dir, work / "results-eagle3", eagle_trees=[]),
        "peagle": lambda: score_once(ckpts["peagle"], shard_dir, work / "results-peagle"),
        "eagle1": lambda: score_once(ckpts["eagle1"], shard_dir, work / "results-eagle1", eagle_trees=[]),
        **{k: (lambda k=k: score_once(ckpts[k], shard_dir, work / f"results-{k}", steps=K_STEPS)) for k in MTP_KINDS},
        **{
            t: (lambda t=t: score_once(ckpts["eagle3"], shard_dir, work / f"results-{t}", eagle_trees=[t]))
            for t in TREES
        },
        "online": lambda: online_all_anchors(model, shard_dir, aux_ids),
    }
    return {side: measure() for side, measure in sides.items()}


def rounds(ckpts: dict, model, shard_dir: str, aux_ids: list[int], work: Path, reps: int) -> dict:
    """`reps` rounds of every side; per side the fastest."""
    runs = []
    for rep in range(reps):
        log(f"eagle: round {rep + 1}/{reps} ...")
        runs.append(one_round(ckpts, model, shard_dir, aux_ids, work))
    best = {side: min((r[side] for r in runs), key=lambda x: x["wall_s"]) for side in runs[0]}
    return best | {"runs": runs}


def measure_flops(ckpt: str, model, shard_dir: str, aux_ids: list[int], work: Path) -> dict:
    offline = flops_per_anchor(lambda: score_once(ckpt, shard_dir, work / "flops", limit=1, eagle_trees=[])["anchors"])
    online = flops_per_anchor(lambda: online_all_anchors(model, shard_dir, aux_ids, limit=1)["anchors"])
    return {"offline_per_anchor": offline, "online_per_anchor": online, "ratio": offline / online}


def run(ctx) -> tuple[dict, Rows]:
    from bench.standins import write_synthetic_shards
    from pipeline.common.layer_ids import build_target_layer_ids

    args, work = ctx.args, Path(ctx.work) / "eagle"
    work.mkdir(parents=True, exist_ok=True)
    lengths = [48] if args.quick else [64, 96, 112, 128]
    num_layers = SMOLLM2["num_layers"]
    dflash_ids, aux_ids = build_target_layer_ids(num_layers, 5), eagle_aux_ids(num_layers)
    try:
        log(f"eagle: synthetic shards ({lengths} tokens), z-lab DFlash v1 and speculators EAGLE-3 (k={K_STEPS}) ...")
        shard_dir = str(work / "shards")
        # EAGLE-1/2 reads L - 1; the MTP heads read L (the last layer's output before the final norm) and the norm
        stored = list(dict.fromkeys(dflash_ids + aux_ids + [num_layers - 1, num_layers]))
        shapes = SMOLLM2["hidden_size"], SMOLLM2["vocab_size"], num_layers, stored, PROMPT_TOKENS
        write_synthetic_shards(Path(shard_dir), lengths, *shapes, final_norm=True)
        zlab(work / "dflash", "dflash", dflash_ids, seed=1)
        model = eagle3_drafter(work / "eagle3", aux_ids, seed=2).float()
        ckpts = {"dflash": str(work / "dflash"), "eagle3": str(work / "eagle3")}
        ckpts["peagle"] = peagle_drafter(work / "peagle", aux_ids, seed=3)
        ckpts["eagle1"] = eagle1_drafter(work / "eagle1", seed=4)
        ckpts |= {kind: write_head(work / kind, kind, seed=5 + i) for i, kind in enumerate(MTP_KINDS)}
        score_once(ckpts["eagle3"], shard_dir, work / "warm-up", limit=1, eagle_trees=[])
        figures = rounds(ckpts, model, shard_dir, aux_ids, work, args.reps)
        log("eagle: FLOPs per anchor, one sample each side ...")
        figures["flops"] = measure_flops(ckpts["eagle3"], model, shard_dir, aux_ids, work)
        log(f"eagle: SmolLM2 extract with and without EAGLE-3's aux layers ({STORE_PROMPTS} prompts) ...")
        start = time.perf_counter()
        figures["storage"] = aux_layer_bytes(ctx, work, dflash_ids, aux_ids)
        figures["storage"]["seconds"] = time.perf_counter() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures.update(k_steps=K_STEPS, trees=TREES, block_size=16, lengths=lengths, threads=torch.get_num_threads())
    return figures, rows_of(figures)


def ms_per_anchor(side: dict) -> float:
    return 1e3 * side["wall_s"] / side["anchors"]


def rows_of(f: dict) -> Rows:
    rows, dflash, eagle, online = Rows(), f["dflash"], f["eagle3"], f["online"]
    rows.add(
        f"eagle: scoring cost per anchor, {eagle['anchors']} anchors at SmolLM2 shapes (synthetic), 1-layer random "
        f"drafters, all anchors; min of {len(f['runs'])} rounds"
    )
    rows.add("  z-lab DFlash v1 (15 drafts)", f"{ms_per_anchor(dflash):.1f} ms", others=dflash["others_cpu"])
    rows.add(
        f"  speculators EAGLE-3 chain ({f['k_steps']} drafts), offline",
        f"{ms_per_anchor(eagle):.1f} ms, {ms_per_anchor(eagle) / ms_per_anchor(dflash):.2f}x DFlash v1",
        others=eagle["others_cpu"],
    )
    for key, label in (("peagle", "speculators P-EAGLE"), ("eagle1", "the EAGLE repository's EAGLE-1/2"), *MTP_LABELS):
        side = f[key]
        rows.add(
            f"  {label} chain ({f['k_steps']} drafts), offline",
            f"{ms_per_anchor(side):.1f} ms, {ms_per_anchor(side) / ms_per_anchor(dflash):.2f}x DFlash v1, "
            f"{ms_per_anchor(side) / ms_per_anchor(eagle):.2f}x EAGLE-3",
            others=side["others_cpu"],
        )
    rows.add(
        "  the same anchors online (speculators' modules, growing cache)",
        f"{ms_per_anchor(online):.1f} ms; offline / online {ms_per_anchor(eagle) / ms_per_anchor(online):.2f}x time, "
        f"{f['flops']['ratio']:.2f}x FLOPs",
        others=online["others_cpu"],
    )
    for tree in f["trees"]:
        side = f[tree]
        rows.add(
            f"  EAGLE-3 chain + eagle-tree-{tree}",
            f"{ms_per_anchor(side):.1f} ms (the tree {1e3 * side['stages']['seconds']['eagle tree'] / side['anchors']:.1f} ms), "
            f"{ms_per_anchor(side) / ms_per_anchor(eagle):.2f}x the chain alone",
            others=side["others_cpu"],
        )
    s = f["storage"]
    rows.add(
        f"  extract (SmolLM2 bf16): EAGLE-3 aux layers {s['aux_ids']} beside DFlash's {s['dflash_ids']}",
        f"+{s['extra_bytes_per_token']:.0f} B/token ({s['bytes_per_token_dflash']:.0f} -> "
        f"{s['bytes_per_token_both']:.0f}; {len(s['added_layers'])} layers added, raw bf16 "
        f"{s['raw_bf16_per_layer']} B each)",
    )
    return rows
