"""The steps of scoring one checkpoint: load it (compatibility checked before any weight is
read; skipped when its results directory already holds these settings) and replay a group of
samples (scoring/replay/anchors.py) into its collector (scoring/score/collect.py). The run.json
is scoring/score/record.py's, the files scoring/score/outputs.py's; scoring/score/passes.py strings
the steps together, several checkpoints per pass over the shards."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from pipeline.common import timing
from pipeline.common.distributed import Dist, resolve_device
from pipeline.common.dtypes import resolve_dtype
from pipeline.common.errors import UserError
from pipeline.common.sampling import sampling_of
from pipeline.common.sizes import format_size
from pipeline.shards import ShardSet
from proposers.checkpoints.compatibility import check_compatibility, target_layers
from proposers.checkpoints.load import CheckpointInfo, load_proposer, read_drafter_config
from proposers.interface import Proposer, drafts_trees, is_stateful, serves_requests
from proposers.layouts import Override
from proposers.registry import family, family_label
from scoring.config import DEFAULT_EAGLE_TREES, ScoreConfig
from scoring.methods.ddtree import DDTREE
from scoring.methods.eagle_tree import EAGLE_TREES, parse_eagle_trees
from scoring.replay.anchors import replay_sample, replay_walks
from scoring.replay.packing import ReplayOptions, select_feature_columns
from scoring.replay.walk import stop_mask
from scoring.replay.walk_rules import DEFAULT_RULE, walk_rule
from scoring.score.collect import Collector
from scoring.score.outputs import check_previous
from scoring.score.record import planned_record
from scoring.score.selection import Selection, sample_index, select_samples, selection_record

SAMPLE_TENSORS = ["features", "topk_ids", "topk_logprobs", "argmax_mismatch", "sample_logprob"]


def sample_tensors(proposers) -> list[str]:
    """What the replay reads of each sample for `proposers`: the features only when one reads feature
    layers (shards extracted with --layer-ids none hold none, and serve proposers that read tokens)."""
    features = any(p.needs.feature_layers for p in proposers)
    return [name for name in SAMPLE_TENSORS if features or name != "features"]


def resolve_device_dtype(device: str, dtype: str, dist: Dist | None = None) -> tuple[str, torch.dtype]:
    """GPU if present, else CPU; dtype "auto" = fp32 on CPU and bf16 on GPU."""
    device = resolve_device(None if device == "auto" else device, dist or Dist())
    return device, resolve_dtype(dtype, device)


@dataclass
class Job:
    """One checkpoint's replay, everything resolved from the run's ScoreConfig (prepare_job): what to
    replay, with what, on which samples, and what to write. Past prepare_job nothing reads the config."""

    proposer: Proposer
    info: CheckpointInfo
    options: ReplayOptions  # its `methods`: the plan of tree methods (scoring/methods/registry.py)
    mine: list[int]  # sample indices this rank replays
    total: int  # samples scored over all ranks
    max_new_tokens: int
    stored_layer_ids: list[int]
    planned: dict  # run.json's settings (scoring/score/record.py planned_record)
    anchor_set: str = "all"  # --anchors: every anchor, or only those the walks visit
    anchor_drafts: bool = False  # anchors.parquet keeps every anchor's draft block
    group_tokens: int = 8192  # walk mode: samples packed per group (tokens)

    def collector(self, stop_token_ids: list[int]) -> Collector:
        """Where this checkpoint's results gather, sample by sample."""
        options = self.options
        return Collector(
            options.methods,
            stop_token_ids,
            self.proposer.max_drafts,
            self.anchor_drafts,
            options.sampling,
            walk_rule(options.walk_rule),
        )


def choose_samples(shardset: ShardSet, config: ScoreConfig) -> tuple[list[int], dict]:
    """The sample indices to replay and run.json's `selection` record."""
    selection = Selection(config.limit, config.sample, config.seed, tuple(config.datasets or ()) or None)
    index = sample_index(shardset)
    chosen = select_samples(index, selection)
    if config.sample is not None and config.sample > len(chosen):
        where = f"--datasets {','.join(config.datasets)} of the shards" if config.datasets else "the shards"
        warnings.warn(
            f"--sample {config.sample}: {where} hold {len(chosen)} samples; scoring all {len(chosen)}", stacklevel=2
        )
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


def check_fit(drafter_config, shardset: ShardSet, ckpt: str, dtype: torch.dtype, memory_bytes: int) -> None:
    """Whether the checkpoint can draft for the shards' target, before any weight is read: a trained
    drafter's widths and layers (compatibility.py), a family's own check (a draft model's vocabulary,
    XPress's greedy-only rule), and a draft model's size against --memory-budget."""
    record = family(drafter_config.family)
    if record.model is not None:
        check_compatibility(drafter_config, shardset.manifest, ckpt, shardset.uri)
    if record.check_shards is not None:
        record.check_shards(drafter_config, shardset.manifest, shardset.uri, ckpt)
    if record.parameters is not None:
        size = record.parameters(drafter_config) * torch.empty((), dtype=dtype).element_size()
        if size > memory_bytes:
            raise UserError(
                f"the {record.label} takes {format_size(size)} at {str(dtype).removeprefix('torch.')}, more "
                f"than --memory-budget {format_size(memory_bytes)}; raise --memory-budget if the machine holds it, "
                "score in bf16 (--dtype bf16), or choose a smaller model"
            )


def prepare_job(ckpt: str, shardset: ShardSet, out_dir: str, config: ScoreConfig, dist: Dist) -> Job | None:
    """Load the checkpoint for replay; None when out_dir already holds its results."""
    device, dtype = resolve_device_dtype(config.device, config.dtype, dist)
    manifest = shardset.manifest
    layers = target_layers(manifest)
    override = family_override(config.family)
    drafter_config = read_drafter_config(ckpt, target_layers=layers, override=override)
    check_fit(drafter_config, shardset, ckpt, dtype, config.memory_bytes)
    with timing.stage("load drafter"):
        proposer, info = load_proposer(ckpt, dtype, device, target_layers=layers, override=override)
    set_chain_steps(config.steps, info.config, ckpt, config.walk_rule)
    warn_unmatched_rule(info.config, ckpt, config.walk_rule)
    set_confidence_threshold(config.confidence_threshold, info.config, ckpt)
    chosen, selection = choose_samples(shardset, config)
    sampling = sampling_of(manifest["settings"])
    if is_stateful(proposer):
        config = stateful_config(config, info, sampling, dist, proposer)
    plan = method_plan(config, proposer, sampling, ckpt)
    planned = planned_record(info, shardset, config, dtype, selection, proposer.independent_drafts, plan)
    if is_stateful(proposer):
        planned["requests"] = REQUEST_ORDER
    if serves_requests(proposer):
        planned["requests"] = served_order(proposer, info, dist)
    if check_previous(out_dir, planned, config.force):
        return None
    options = ReplayOptions(
        memory_bytes=config.memory_bytes,
        dtype=dtype,
        device=device,
        attention=config.attention,
        sampling=sampling,
        methods=plan,
        walk_rule=config.walk_rule,
        conventions=walk_rule(config.walk_rule).conventions(info.config.family),
    )
    settings = manifest["settings"]
    mine = chosen[dist.rank :: dist.world]
    run = dict(anchor_set=config.anchors, anchor_drafts=config.anchor_drafts, group_tokens=config.walk_group_tokens)
    return Job(
        proposer,
        info,
        options,
        mine,
        len(chosen),
        int(settings["max_new_tokens"]),
        settings["layer_ids"],
        planned,
        **run,
    )


# How a proposer with state along the online loop is replayed (run.json `requests`)
REQUEST_ORDER = "one at a time on one server slot, in the shards' sample order (selection.samples)"


def stateful_config(
    config: ScoreConfig, info: CheckpointInfo, sampling, dist: Dist, proposer: Proposer | None = None
) -> ScoreConfig:
    """A proposer with state along the online loop (proposers.interface.ServerStateful) replayed as its
    server runs it: greedy, under its server's loop (the proposer's `walk_rule`: llama-server's unless
    it says, SGLang's NGRAM says `sglang`), in one process, walk-only (its drafts exist only along its
    own path), one request at a time (groups of one sample)."""
    rule = getattr(proposer, "walk_rule", "llama.cpp")
    server = getattr(proposer, "server", None) or f"llama-server's {info.config_raw.get('spec-type')}"
    name = f"{info.name}: {server}"
    if config.walk_rule != rule:
        raise UserError(f"{name} keeps state along the server's loop; replay it under that loop: --walk-rule {rule}")
    if not sampling.greedy:
        raise UserError(
            f"{name} keeps state along the server's loop, which sampled responses do not fix: greedy shards only"
        )
    if dist.world > 1:
        raise UserError(f"{name} replays its requests one after another; score it in one process, not under torchrun")
    return dataclasses.replace(config, anchors="walk", walk_group_tokens=0)


def served_order(proposer, info: CheckpointInfo, dist: Dist) -> str:
    """run.json's `requests` for a proposer with state across requests alone (RequestStateful: its
    drafts at every anchor, given the samples served before): their order. One process only: a rank
    would keep its own state over every world-th sample."""
    if dist.world > 1:
        raise UserError(f"{info.name}: {proposer.requests}; score it in one process, not under torchrun")
    return f"one at a time, each to its end, in the shards' sample order (selection.samples): {proposer.requests}"


def family_override(text: str | None) -> Override | None:
    """--family NAME[:LAYOUT], parsed (a UserError naming the families and layouts when it is none)."""
    return None if text is None else Override.parse(text)


def method_plan(config: ScoreConfig, proposer: Proposer, sampling, ckpt: str) -> dict:
    """The tree methods' settings for this proposer: the DDTree budgets where its drafts are
    independent given the block (else the chain alone), its own trees where it drafts some."""
    budgets = tuple(sorted(set(config.tree_nodes))) if proposer.independent_drafts else ()
    return {DDTREE.kind: budgets, EAGLE_TREES.kind: eagle_trees_of(config, proposer, sampling, ckpt)}


def set_chain_steps(steps: int | None, drafter_config, ckpt: str, rule: str = DEFAULT_RULE) -> None:
    """--steps: the drafts per step instead of the checkpoint's. A chain family's (EAGLE-3, MTP:
    vLLM's num_speculative_tokens) under any rule; a block family's under an engine's rule, which
    runs a block of that many drafts (llama.cpp's --spec-draft-n-max, vLLM's num_speculative_tokens),
    at most its trained block's. dflash_generate always drafts the trained block: refused by name."""
    if steps is None:
        return
    fixed = getattr(drafter_config, "fixed_steps", None)  # a proposer whose engine has no such flag
    if fixed:
        raise UserError(f"--steps: {fixed}")
    if family(drafter_config.family).chain_steps:
        _check_chained_heads(steps, drafter_config, rule)
        drafter_config.block_size = steps
        return
    if rule == DEFAULT_RULE:
        raise UserError(
            f"--steps: {ckpt} is a {family_label(drafter_config.family)} drafter, which dflash_generate runs on its "
            f"trained block of {drafter_config.max_drafts} drafts; an engine's shorter block needs its walk rule "
            "(--walk-rule llama.cpp|vllm|sglang), or drop --steps"
        )
    if steps > drafter_config.max_drafts:
        raise UserError(
            f"--steps {steps}: {ckpt} drafts at most {drafter_config.max_drafts} tokens (its trained block); "
            f"use --steps {drafter_config.max_drafts} or fewer"
        )
    drafter_config.block_size = steps + drafter_config.first_draft_slot


def warn_unmatched_rule(drafter_config, ckpt: str, rule: str) -> None:
    """A layout whose engine's counts under `rule` are not matched yet says so (family_options'
    `unmatched_rules`: rule -> why), rather than its figures passing for the engine's."""
    why = (getattr(drafter_config, "family_options", None) or {}).get("unmatched_rules", {}).get(rule)
    if why:
        warnings.warn(
            f"{ckpt}: --walk-rule {rule} is not matched to the engine for this layout yet: {why}", stacklevel=2
        )


def _check_chained_heads(steps: int, drafter_config, rule: str) -> None:
    """llama.cpp runs MiMo's MTP heads one a step, so it drafts at most as many steps as heads (it
    caps its n_max there, common/speculative.cpp:1423-1425): more is refused, not capped unseen.
    vLLM's multi-module speculator runs a stack of NextN heads one a step; past the last it reuses
    head j % N, whose one KV cache its earlier step wrote over the draft window
    (v1/worker/gpu/spec_decode/multi_module_mtp/speculator.py:426-437): what that step attends to then
    depends on the walk's history, which no replay reproduces: refused too."""
    heads = (getattr(drafter_config, "family_options", None) or {}).get("heads")  # a weightless proposer has none
    if not heads or steps <= heads:
        return
    conventions = walk_rule(rule).conventions(drafter_config.family)
    if conventions.chain_heads and drafter_config.layout == "mimo":
        raise UserError(
            f"--steps {steps}: the checkpoint holds {heads} MTP heads, which --walk-rule {rule} chains one a step "
            f"(llama-server caps --spec-draft-n-max at {heads}); use --steps {heads} or fewer"
        )
    if heads > 1 and drafter_config.layout == "nextn" and not conventions.lead_slot:
        raise UserError(
            f"--steps {steps}: the checkpoint holds {heads} NextN heads, which vLLM runs one a step; past them it "
            f"reuses head j % {heads} over a KV cache its earlier step wrote (multi_module_mtp/speculator.py:"
            f"426-437), which depends on the walk's history; use --steps {heads} or fewer"
        )


def set_confidence_threshold(threshold: float | None, drafter_config, ckpt: str) -> None:
    """--confidence-threshold: a confidence cut instead of the checkpoint's, for a family whose
    drafter has one (its record's `set_confidence_threshold`); refused by name for the others."""
    if threshold is None:
        return
    setter = family(drafter_config.family).set_confidence_threshold
    if setter is None:
        raise UserError(
            f"--confidence-threshold: {ckpt} is a {family_label(drafter_config.family)} drafter; only a DSpark "
            "drafter's confidence head cuts its proposals"
        )
    setter(drafter_config, threshold, ckpt)


def eagle_trees_of(config: ScoreConfig, proposer: Proposer, sampling, ckpt: str) -> tuple:
    """The EagleTree settings to replay: --eagle-trees, else sglang's default, for a proposer that
    drafts its own trees (EAGLE-3); none on sampled shards, where sglang verifies a tree by tree
    speculative sampling, whose outcome the stored response does not decide (docs/eagle-tree.md)."""
    if not drafts_trees(proposer):
        if config.eagle_trees:
            raise UserError(
                f"--eagle-trees: {ckpt} is a {family_label(proposer.family)} drafter, and EAGLE trees are drafted by "
                "EAGLE-3 drafters only (DDTree: --ddtree-budgets); drop --eagle-trees for it"
            )
        return ()
    given = DEFAULT_EAGLE_TREES if config.eagle_trees is None else config.eagle_trees
    return tuple(parse_eagle_trees(",".join(given))) if sampling.greedy else ()


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


def replay_group(job: Job, head, group: list, collector: Collector) -> list:
    """AnchorTensors of each sample of a group, all anchors or only those the walks visit."""
    layer_ids = list(job.proposer.needs.feature_layers)
    columns = lambda f: select_feature_columns(f, job.stored_layer_ids, layer_ids)  # noqa: E731
    samples = [s for _, s in group]
    # Given (teacher-forced) responses may be longer than the extract's max_new_tokens.
    max_new = [job.max_new_tokens if s.greedy else max(job.max_new_tokens, s.response_len) for s in samples]
    if job.anchor_set == "all":
        return [replay_sample(job.proposer, head, s, columns, m, job.options) for s, m in zip(samples, max_new)]
    is_stop = [stop_mask(s.input_ids, collector.stop_token_ids) for s in samples]
    return replay_walks(job.proposer, head, samples, columns, max_new, collector.methods, is_stop, job.options)


def identity_of(info: CheckpointInfo) -> dict:
    """The identity columns every results row carries."""
    return {
        "checkpoint": info.name,
        "checkpoint_hash": info.content_hash[:16],
        "checkpoint_step": info.step,
        "drafter_family": info.config.family,
        "drafter_layout": info.config.layout,
    }
