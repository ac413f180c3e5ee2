"""Stage 2's settings: what `score` and `fit` take, with the defaults the CLI shows.

Torch-free on purpose: `specreplay score --help` reads these defaults without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.common.sizes import DEFAULT_MEMORY_BYTES

DEFAULT_TREE_NODES = (4, 8, 16, 32, 64, 128, 256)  # DDTree budgets: nodes per tree, root not counted
# EAGLE-3 dynamic trees, topk x depth - draft tokens: sglang's own default (server_args.py
# auto_choose_speculative_params: 5 steps, topk 4, 8 draft tokens)
DEFAULT_EAGLE_TREES = ("4x5-8",)
# --walk-rule: whose online loop the walk follows (scoring/replay/walk_rules.py registers each by
# this name; docs/walk-rules.md); the first is the default, the reference dflash_generate
WALK_RULES = ("dflash", "llama.cpp", "vllm", "sglang")


@dataclass
class ScoreConfig:
    ckpts: list[str]
    shards: str
    out: str
    tree_nodes: list[int] = field(default_factory=lambda: list(DEFAULT_TREE_NODES))  # --ddtree-budgets
    # --eagle-trees as given ('4x5-8'); None: DEFAULT_EAGLE_TREES for EAGLE-3 drafters, none for the others
    eagle_trees: list[str] | None = None
    # --steps: drafts per anchor of an autoregressive chain (EAGLE-3, MTP); None: the checkpoint's
    steps: int | None = None
    # --confidence-threshold: a DSpark drafter's confidence cut (llama-server's --spec-draft-p-min); None: the checkpoint's
    confidence_threshold: float | None = None
    # --family NAME[:LAYOUT]: read every checkpoint as this family's (and layout's); None: detected
    family: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    memory_bytes: int = DEFAULT_MEMORY_BYTES  # working memory for one anchor chunk
    attention: str = "auto"
    anchors: str = "all"  # "all": every response position; "walk": only the anchors the walks visit
    walk_rule: str = WALK_RULES[0]  # --walk-rule: whose online loop the walk follows (scoring/replay/walk_rules.py)
    walk_group_tokens: int = 8192  # walk mode: samples packed per group (tokens)
    limit: int | None = None  # the first N samples (after `datasets`)
    sample: int | None = None  # N samples drawn with `seed`, stratified by dataset
    seed: int = 0
    datasets: list[str] | None = None  # only these datasets
    anchor_drafts: bool = False  # anchors.parquet keeps every anchor's draft block (walk.parquet always has the walk's)
    force: bool = False  # re-score (and replace) results that exist, whatever their settings


@dataclass
class FitOptions:
    steps: int = 300
    lr: float = 3e-3
    anchors_per_step: int = 8  # the lm_head over the full vocabulary dominates the cost
    seed: int = 0
    save_every: int = 0  # 0: only the final checkpoint
    init_std: float = 0.02
    layers: int = 1  # drafter decoder layers
    block_size: int = 8


@dataclass
class DiagnoseConfig:
    ckpt: str
    shards: str
    out: str = "data/diagnose"  # writes --out/<parent>_<name>/diagnose.parquet
    limit: int | None = None  # samples; None = DEFAULT_DIAGNOSE_SAMPLES drawn with `seed`
    variants: list[str] | None = None  # None = every variant that applies
    seed: int = 0
    device: str = "auto"
    dtype: str = "fp32"  # the as-configured run; the bf16 variant is the precision probe
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    attention: str = "auto"
    family: str | None = None  # --family NAME[:LAYOUT], as score's
    resamples: int = 2000  # paired bootstrap resamples per interval
    force: bool = False  # replace a diagnose.parquet already there


# `diagnose` default: samples (stratified by dataset, seeded) that take about a minute for every
# variant at SmolLM2-135M shapes and 128-token responses on two CPU cores (README, My tau is low).
DEFAULT_DIAGNOSE_SAMPLES = 8
