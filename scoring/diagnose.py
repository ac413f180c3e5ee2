"""`specreplay diagnose`: replay one checkpoint under its configuration and under each variant
(scoring/variants.py: one convention changed at a time) on the same samples, and say which, if
any, the checkpoint was trained with.

Per variant and sample (every anchor replayed, chain only): the chain walk's tau (expected tau
on sampled shards), the accepted lengths summed over anchors (the all-anchor streak's
numerator) and the acceptance at block position 1. Each variant is compared with
"as-configured" by a paired bootstrap over samples (scoring/bootstrap.py); the verdict names a
variant only when its tau interval lies above zero. Nothing here changes what `score` computes.
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.errors import UserError
from pipeline.sampling import Sampling, sampling_of
from pipeline.shards import ShardSet
from scoring import metrics, results
from scoring.bootstrap import FEW_SAMPLES, paired_bootstrap, paired_ratio_bootstrap
from scoring.checkpoint import check_compatibility, load_drafter, read_drafter_config
from scoring.collect import sampled_chain
from scoring.config import DEFAULT_DIAGNOSE_SAMPLES, DiagnoseConfig
from scoring.diagnose_view import format_positions
from scoring.replay import ReplayOptions, prepare_target_head, replay_sample, select_feature_columns
from scoring.selection import Selection, sample_index, select_samples
from scoring.variants import CONFIGURED, VARIANTS, Variant, missing_layers, not_applicable, parse_variants
from scoring.walk import next_stop_positions, stop_mask, walk

METRICS = ("tau", "streak", "accept_pos1")
SAMPLE_TENSORS = ["features", "topk_ids", "topk_logprobs", "sample_logprob"]


@dataclass
class SampleStats:
    """One sample replayed under one variant (chain, every anchor)."""

    tau: float | None  # the walk's tau (expected tau on sampled shards); None: no step
    accepted: float  # accepted length summed over anchors, bonus-exclusive (expected at T > 0)
    anchors: int
    pos1: float  # acceptance at block position 1 summed over anchors whose target there is known
    pos1_known: int
    reached: np.ndarray  # [L] per block position: anchors that verified it (expected at T > 0)
    accepted_at: np.ndarray  # [L] ... and accepted it


@dataclass
class Measured:
    """A variant's per-sample stats, or why it was not measured."""

    variant: Variant
    stats: list[SampleStats] | None = None
    note: str | None = None
    seconds: float = 0.0  # replay wall time


@dataclass
class Comparison:
    """One metric of one variant against as-configured, over the samples both measured."""

    variant: str
    metric: str
    value: float
    delta: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    samples: int = 0
    note: str | None = None


@dataclass
class Diagnosis:
    checkpoint: dict  # identity columns
    comparisons: list[Comparison]
    by_position: list[float]  # as-configured acceptance by block position (NaN: never reached)
    verdict: list[str]  # lines, the actionable one first
    samples: int
    sampling: Sampling
    out_dir: str = ""
    notes: list[str] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)  # variant -> replay wall time


# --------------------------------------------------------------------------- per-sample stats


def sample_stats(sample, result, stop_ids: list[int], sampling: Sampling) -> SampleStats:
    """SampleStats of one sample's all-anchor replay (chain only)."""
    is_stop = stop_mask(sample.input_ids, stop_ids)
    next_stop = next_stop_positions(is_stop)
    match, known = metrics.position_match(result.draft_tokens, result.target_tokens)
    if sampling.greedy:
        accepted = metrics.leading_matches(result.draft_tokens, result.target_tokens)
        produced = metrics.produced_tokens(
            accepted, result.anchors, sample.input_ids.numel(), next_stop[result.anchors]
        )
        tau = metrics.sample_tau([n for _, n in walk(produced, sample.prompt_len, is_stop)])
        counts = metrics.position_counts(accepted, match, known)
        accepted, first = accepted.double(), match[:, 0].double()
    else:  # rejection sampling: expectations (collect.sampled_chain)
        chain = sampled_chain(sample, result, is_stop, next_stop[result.anchors])
        tau, accepted, first = chain.expected_tau, chain.expected_accepted, chain.accept_probs[:, 0]
        counts = metrics.expected_position_counts(chain.accept_probs, known)
    return SampleStats(
        tau=tau,
        accepted=float(accepted.sum()),
        anchors=int(result.anchors.numel()),
        pos1=float((first * known[:, 0]).sum()),
        pos1_known=int(known[:, 0].sum()),
        reached=counts["reached"].double().numpy(),
        accepted_at=counts["accepted"].double().numpy(),
    )


# --------------------------------------------------------------------------- replay


@dataclass
class Setup:
    """What every variant's replay shares."""

    drafter: torch.nn.Module
    info: object  # CheckpointInfo
    head: dict  # the target head in the run's dtype
    samples: list  # pipeline.shards.Sample, in memory
    stored_layer_ids: list[int]
    max_new_tokens: int
    stop_ids: list[int]
    options: ReplayOptions


def replay_variant(setup: Setup, variant: Variant, progress=None) -> list[SampleStats]:
    """Every chosen sample replayed under `variant` (all anchors, chain only)."""
    drafter, head, options = setup.drafter, setup.head, setup.options
    if variant.dtype is not None and variant.dtype != options.dtype:
        drafter = copy.deepcopy(drafter).to(variant.dtype)
        head = {name: tensor.to(variant.dtype) for name, tensor in head.items()}
    options = ReplayOptions(
        max_tree_nodes=0,
        memory_bytes=options.memory_bytes,
        dtype=variant.dtype or options.dtype,
        device=options.device,
        attention=options.attention,
        sampling=options.sampling,
        conventions=variant.conventions,
    )
    columns = feature_selector(
        setup.stored_layer_ids, setup.info.config.target_layer_ids, variant.conventions.layer_offset
    )
    stats = []
    for sample in setup.samples:
        max_new = setup.max_new_tokens if sample.greedy else max(setup.max_new_tokens, sample.response_len)
        result = replay_sample(drafter, head["embed_tokens"], head["lm_head"], sample, columns, max_new, options)
        stats.append(sample_stats(sample, result, setup.stop_ids, options.sampling))
        if progress is not None:
            progress.update(1)
    return stats


def feature_selector(stored: list[int], drafter_ids: list[int], layer_offset: int):
    """features [N, stored * H] -> the drafter's layers, each id shifted by `layer_offset`."""
    ids = [i + layer_offset for i in drafter_ids]
    return lambda features: select_feature_columns(features, stored, ids)


def skip_reason(variant: Variant, setup: Setup, shards: str) -> str | None:
    """Why a variant is not measured: it changes nothing here, or its layers are not stored."""
    reason = not_applicable(variant, setup.info.config)
    if reason is not None:
        return reason
    missing = missing_layers(variant, setup.info.config, setup.stored_layer_ids)
    if not missing:
        return None
    if any(i < 0 for i in missing):
        return "layer id -1 (the embedding output) is not a decoder layer's output; specreplay does not store it"
    return f"layers {missing} not in the shards; {neighbour_hint(shards)}"


def neighbour_hint(shards: str) -> str:
    """The extract command that stores the neighbouring layers (re-run with the same settings)."""
    from specreplay.hints import program

    return (
        f"re-extract with `{program()} extract --neighbour-layers --out {shards}-neighbours` and the "
        f"same --model/--prompts/--layer-ids as {shards}"
    )


# --------------------------------------------------------------------------- statistics


def _metric_arrays(stats: list[SampleStats], metric: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(per-sample numerators, per-sample counts or None for a plain mean) of one metric."""
    if metric == "tau":
        return np.array([np.nan if s.tau is None else s.tau for s in stats]), None
    if metric == "streak":
        return np.array([s.accepted for s in stats]), np.array([s.anchors for s in stats], dtype=np.float64)
    return np.array([s.pos1 for s in stats]), np.array([s.pos1_known for s in stats], dtype=np.float64)


def pooled(stats: list[SampleStats], metric: str) -> tuple[float, int]:
    """(the metric over all samples, samples counted): mean tau over samples with a step;
    streak and position-1 acceptance anchor-weighted (sum over sum)."""
    values, counts = _metric_arrays(stats, metric)
    if counts is None:
        keep = ~np.isnan(values)
        return (float(values[keep].mean()) if keep.any() else float("nan")), int(keep.sum())
    keep = counts > 0
    return (float(values.sum() / counts.sum()) if keep.any() else float("nan")), int(keep.sum())


def compare_metric(base: list[SampleStats], other: list[SampleStats], metric: str, name: str, **boot) -> Comparison:
    """`other` against `base` on one metric, paired over samples (bootstrap interval)."""
    a, counts = _metric_arrays(base, metric)
    b, _ = _metric_arrays(other, metric)
    value, _ = pooled(other, metric)
    keep = ~(np.isnan(a) | np.isnan(b)) if counts is None else counts > 0
    n = int(keep.sum())
    if n < 2:
        return Comparison(name, metric, value, samples=n, note="fewer than 2 samples to compare")
    if counts is None:
        delta, low, high = paired_bootstrap(a[keep], b[keep], **boot)
    else:
        delta, low, high = paired_ratio_bootstrap(a[keep], b[keep], counts[keep], **boot)
    return Comparison(name, metric, value, delta, low, high, n)


def compare_all(measured: list[Measured], resamples: int, seed: int) -> list[Comparison]:
    """Every metric of every variant, as-configured first (no delta)."""
    base = measured[0].stats
    rows = []
    for m in measured:
        for metric in METRICS:
            if m.stats is None:
                rows.append(Comparison(m.variant.name, metric, float("nan"), note=m.note))
            elif m.variant.name == CONFIGURED:
                value, n = pooled(base, metric)
                rows.append(Comparison(CONFIGURED, metric, value, samples=n))
            else:
                rows.append(compare_metric(base, m.stats, metric, m.variant.name, resamples=resamples, seed=seed))
    return rows


def by_position(stats: list[SampleStats]) -> list[float]:
    """Acceptance by block position, conditioned on reaching it, pooled over samples."""
    reached = sum(s.reached for s in stats)
    accepted = sum(s.accepted_at for s in stats)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (accepted / reached).tolist()


# --------------------------------------------------------------------------- verdict


def _ci(c: Comparison) -> str:
    return f"{c.delta:+.2f}, 95% CI {c.ci_low:.2f} to {c.ci_high:.2f}"


def _significant(c: Comparison) -> bool:
    return c.delta is not None and c.ci_low is not None and (c.ci_low > 0 or c.ci_high < 0)


def verdict(comparisons: list[Comparison], positions: list[float], samples: int, sampling: Sampling) -> list[str]:
    """The verdict lines, from what was measured only: a convention variant whose tau interval
    lies above zero is named first (the largest gain); otherwise the configuration is called
    consistent and acceptance by block position shows where it dies."""
    unit = "tau" if sampling.greedy else "expected tau"
    tau = {c.variant: c for c in comparisons if c.metric == "tau"}
    base = tau[CONFIGURED]
    better = [c for c in tau.values() if VARIANTS[c.variant].convention and _significant(c) and c.ci_low > 0]
    better.sort(key=lambda c: -c.delta)
    lines = []
    if better:
        best = better[0]
        variant = VARIANTS[best.variant]
        lines.append(
            f"{unit} {base.value:.2f} as configured, {best.value:.2f} with {variant.change} ({_ci(best)}): "
            f"{variant.finding}"
        )
        lines += [f"also better: {c.variant} ({unit} {c.value:.2f}, {_ci(c)})" for c in better[1:]]
    else:
        lines.append(
            f"the configuration is consistent: no variant beats as-configured ({unit} {base.value:.2f}); "
            f"acceptance by block position: {format_positions(positions)}"
        )
    bf16 = tau.get("bf16")
    if bf16 is not None and _significant(bf16):
        lines.append(f"numerics: bf16 changes {unit} by {_ci(bf16)}; {VARIANTS['bf16'].finding}")
    if samples < FEW_SAMPLES:
        lines.append(
            f"{samples} samples: intervals from fewer than {FEW_SAMPLES} are rough; pass --limit {FEW_SAMPLES * 2} "
            "or more for a firmer answer"
        )
    return lines


# --------------------------------------------------------------------------- the run


def choose(shardset: ShardSet, config: DiagnoseConfig) -> list[int]:
    """A deterministic subset: --limit (default DEFAULT_DIAGNOSE_SAMPLES) samples drawn with
    --seed, stratified by dataset (scoring/selection.py), so it looks like the whole set."""
    index = sample_index(shardset)
    return select_samples(index, Selection(sample=config.limit or DEFAULT_DIAGNOSE_SAMPLES, seed=config.seed))


def prepare(config: DiagnoseConfig, shardset: ShardSet, progress=None) -> Setup:
    """Load the checkpoint (compatibility checked first), the target head and the samples."""
    from scoring.score import resolve_device_dtype

    device, dtype = resolve_device_dtype(config.device, config.dtype)
    manifest, settings = shardset.manifest, shardset.settings
    check_compatibility(read_drafter_config(config.ckpt), manifest, config.ckpt)
    drafter, info = load_drafter(config.ckpt, dtype=dtype, device=device)
    chosen = set(choose(shardset, config))
    tensors = [t for t in SAMPLE_TENSORS if t != "sample_logprob" or not sampling_of(settings).greedy]
    samples = list(shardset.samples(tensors=tensors, keep=chosen.__contains__))
    options = ReplayOptions(
        max_tree_nodes=0,
        memory_bytes=config.memory_bytes,
        dtype=dtype,
        device=device,
        attention=config.attention,
        sampling=sampling_of(settings),
    )
    return Setup(
        drafter,
        info,
        prepare_target_head(shardset.target_head(), device, dtype),
        samples,
        [int(i) for i in settings["layer_ids"]],
        int(settings["max_new_tokens"]),
        list(settings["target"]["stop_token_ids"]),
        options,
    )


def plan_variants(config: DiagnoseConfig, setup: Setup) -> list[Measured]:
    """The variants to replay, each with its reason when it cannot be. A variant named in
    --variants that cannot be measured is an error (saying what to do), not a silent skip."""
    names = parse_variants(",".join(config.variants) if config.variants else None)
    planned = []
    for name in names:
        variant = VARIANTS[name]
        reason = skip_reason(variant, setup, config.shards)
        asked = bool(config.variants) and name in config.variants
        if reason is not None and asked:
            raise UserError(f"--variants {name}: cannot be measured on {config.shards}: {reason}")
        if reason is None and not asked and variant.dtype is not None and setup.options.device == "cpu":
            reason = (
                f"not run by default on CPU, where {name} is several times slower than fp32; --variants {name} runs it"
            )
        planned.append(Measured(variant, note=reason))
    return planned


def run_diagnose(config: DiagnoseConfig, progress=None) -> Diagnosis:
    """Replay every planned variant on the same samples, compare, decide, write
    --out/<parent>_<name>/diagnose.parquet and diagnose.json. `progress(total, desc)` makes a bar."""
    shardset = ShardSet(config.shards)
    out_dir = os.path.join(config.out, results.result_dir_name(config.ckpt))
    check_out_dir(out_dir, config.force)  # before a minute of replay, not after
    setup = prepare(config, shardset)
    if not setup.samples:
        raise UserError(f"{config.shards}: no samples to replay")
    planned = plan_variants(config, setup)
    todo = [m for m in planned if m.note is None]
    bar = progress(len(todo) * len(setup.samples), f"diagnose {setup.info.name}") if progress else None
    for m in todo:
        if bar is not None:
            bar.update(0, variant=m.variant.name)
        started = time.perf_counter()
        m.stats = replay_variant(setup, m.variant, bar)
        m.seconds = time.perf_counter() - started
    if bar is not None:
        bar.close()
    comparisons = compare_all(planned, config.resamples, config.seed)
    positions = by_position(planned[0].stats)
    sampling = setup.options.sampling
    diagnosis = Diagnosis(
        checkpoint=identity(setup.info),
        comparisons=comparisons,
        by_position=positions,
        verdict=verdict(comparisons, positions, len(setup.samples), sampling),
        samples=len(setup.samples),
        sampling=sampling,
        out_dir=out_dir,
        notes=[f"{m.variant.name}: {m.note}" for m in planned if m.note],
        seconds={m.variant.name: round(m.seconds, 2) for m in todo},
    )
    write_diagnosis(diagnosis, config, shardset)
    return diagnosis


def check_out_dir(out_dir: str, force: bool) -> None:
    """An earlier diagnosis is never replaced silently."""
    existing = os.path.join(out_dir, results.FILES["diagnose_run"])
    if os.path.exists(existing) and not force:
        raise UserError(f"{existing} exists (an earlier diagnose); pass --force to replace it, or choose another --out")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out: {out_dir} is a file; give a directory")


def identity(info) -> dict:
    return {"checkpoint": info.name, "checkpoint_hash": info.content_hash[:16], "checkpoint_step": info.step}


def diagnosis_table(diagnosis: Diagnosis):
    """diagnose.parquet's rows (results.DIAGNOSE)."""
    rows = [{**diagnosis.checkpoint, **c.__dict__, "position": None} for c in diagnosis.comparisons]
    rows += [
        {**diagnosis.checkpoint, "variant": CONFIGURED, "metric": "accept_by_position", "position": k, "value": p}
        for k, p in enumerate(diagnosis.by_position, start=1)
    ]
    for row in rows:  # NaN (not measured / never reached) is stored as null
        row["value"] = None if row["value"] is None or np.isnan(row["value"]) else row["value"]
    return results.rows_table(rows, results.diagnose_schema())


def write_diagnosis(diagnosis: Diagnosis, config: DiagnoseConfig, shardset: ShardSet) -> None:
    """diagnose.parquet, then diagnose.json (each written to a temporary name and renamed)."""
    from scoring.score import shards_identity

    existing = os.path.join(diagnosis.out_dir, results.FILES["diagnose_run"])
    os.makedirs(diagnosis.out_dir, exist_ok=True)
    results.write_table(diagnosis_table(diagnosis), diagnosis.out_dir, "diagnose")
    record = {
        "checkpoint": {**diagnosis.checkpoint, "path": os.path.abspath(config.ckpt)},
        "shards": {"uri": shardset.uri, "identity": shards_identity(shardset.manifest)},
        "samples": diagnosis.samples,
        "sampling": diagnosis.sampling.as_dict(),
        "verdict": diagnosis.verdict,
        "notes": diagnosis.notes,
        "seconds": diagnosis.seconds,
        "selection": {"limit": config.limit or DEFAULT_DIAGNOSE_SAMPLES, "seed": config.seed},
    }
    path = existing + ".tmp"
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path, existing)
