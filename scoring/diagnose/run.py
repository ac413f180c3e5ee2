"""`specreplay diagnose`: replay one checkpoint under its configuration and under each variant
(scoring/diagnose/variants.py: one convention changed at a time) on the same samples, and say which, if
any, the checkpoint was trained with.

Here: choosing the samples, loading the checkpoint once, replaying every sample under each
variant (every anchor, chain only; Conventions switches in scoring/replay/anchors.py), and writing
diagnose.parquet / diagnose.json. The numbers and the verdict: scoring/diagnose/stats.py; how
they read: scoring/diagnose/view.py. Nothing here changes what `score` computes.
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.common.errors import UserError
from pipeline.common.sampling import Sampling, sampling_of
from pipeline.shards import ShardSet
from proposers.checkpoints.compatibility import check_compatibility, extract_words, target_layers
from proposers.checkpoints.load import is_config_only, load_drafter, read_drafter_config
from proposers.interface import TargetHead
from proposers.toolkit.neural import neural_proposer
from scoring import results
from scoring.config import DEFAULT_DIAGNOSE_SAMPLES, DiagnoseConfig
from scoring.diagnose.stats import Comparison, Drawn, SampleStats, by_position, compare_all, sample_stats, verdict
from scoring.diagnose.variants import (
    CONFIGURED,
    VARIANTS,
    Variant,
    for_checkpoint,
    missing_layers,
    not_applicable,
    parse_variants,
    rope_base,
    same_replay,
    with_rope_base,
)
from scoring.replay.anchors import replay_sample
from scoring.replay.packing import ReplayOptions, prepare_target_head, select_feature_columns
from scoring.score.outputs import results_lock
from scoring.score.record import shards_identity
from scoring.score.selection import Selection, sample_index, select_samples
from scoring.score.steps import SAMPLE_TENSORS, family_override, resolve_device_dtype


@dataclass
class Measured:
    """A variant's per-sample stats, or why it was not measured."""

    variant: Variant
    stats: list[SampleStats] | None = None
    note: str | None = None
    seconds: float = 0.0  # replay wall time


@dataclass
class Diagnosis:
    checkpoint: dict  # identity columns
    comparisons: list[Comparison]
    by_position: list[float]  # as-configured acceptance by block position (NaN: never reached)
    anchors_by_position: list[float]  # the anchors that reached each (expected counts at T > 0)
    verdict: list[str]  # lines, the actionable one first
    samples: int
    sampling: Sampling
    out_dir: str = ""
    notes: list[str] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)  # variant -> replay wall time


# --------------------------------------------------------------------------- replay


@dataclass
class Setup:
    """What every variant's replay shares."""

    drafter: torch.nn.Module  # the variants replay the drafter's network under other conventions
    info: object  # CheckpointInfo
    head: TargetHead  # the target head in the run's dtype
    samples: list  # pipeline.shards.Sample, in memory
    stored_layer_ids: list[int]
    max_new_tokens: int
    stop_ids: list[int]
    options: ReplayOptions


def replay_variant(setup: Setup, variant: Variant, progress=None) -> list[SampleStats]:
    """Every chosen sample replayed under `variant` (all anchors, chain only)."""
    drafter, head, options = setup.drafter, setup.head, setup.options
    if variant.rope_base is not None:
        drafter = with_rope_base(drafter, variant.rope_base)
    if variant.dtype is not None and variant.dtype != options.dtype:
        drafter = copy.deepcopy(drafter).to(variant.dtype)
        norm = None if head.final_norm is None else head.final_norm.to(variant.dtype)
        head = TargetHead(head.embed.to(variant.dtype), head.lm_head.to(variant.dtype), norm)
    proposer = neural_proposer(drafter)
    options = ReplayOptions(
        methods={},
        memory_bytes=options.memory_bytes,
        dtype=variant.dtype or options.dtype,
        device=options.device,
        attention=options.attention,
        sampling=options.sampling,
        conventions=variant.conventions,
        distribution_metrics=False,
    )
    columns = feature_selector(
        setup.stored_layer_ids, setup.info.config.target_layer_ids, variant.conventions.layer_offset
    )
    stats = []
    for sample in setup.samples:
        max_new = setup.max_new_tokens if sample.greedy else max(setup.max_new_tokens, sample.response_len)
        result = replay_sample(proposer, head, sample, columns, max_new, options)
        stats.append(sample_stats(sample, result, setup.stop_ids, options.sampling))
        if progress is not None:
            progress.update(1)
    return stats


def feature_selector(stored: list[int], drafter_ids: list[int], layer_offset: int):
    """features [N, stored * H] -> the drafter's layers, each id shifted by `layer_offset`."""
    ids = [i + layer_offset for i in drafter_ids]
    return lambda features: select_feature_columns(features, stored, ids)


def skip_reason(variant: Variant, setup: Setup, shardset: ShardSet, program: str) -> str | None:
    """Why a variant is not measured: it changes nothing here, or its layers are not stored."""
    reason = not_applicable(variant, setup.info.config)
    if reason is None and variant.rope_base is not None:
        base = rope_base(setup.drafter)
        if base is None or base == variant.rope_base:
            reason = "no rotary embedding of its own" if base is None else f"its RoPE base is already {base:g}"
    if reason is not None:
        return reason
    missing = missing_layers(variant, setup.info.config, setup.stored_layer_ids)
    if not missing:
        return None
    if any(i < 0 for i in missing):
        return "layer id -1 (the embedding output) is not a decoder layer's output; specreplay does not store it"
    return f"layers {missing} not in the shards; {neighbour_hint(shardset, program)}"


def neighbour_hint(shardset: ShardSet, program: str) -> str:
    """The extract command that stores the neighbouring layers, with the shards' own settings;
    `program` is how the user runs specreplay (the CLI's specreplay.hints.program())."""
    from pipeline.common.layer_ids import requested_layer_ids

    words = extract_words(
        shardset.manifest, requested_layer_ids(shardset.settings), f"{shardset.uri.rstrip('/')}-neighbours"
    )
    return f"store them with `{program} extract --neighbour-layers {words}`"


# --------------------------------------------------------------------------- the run


def choose(shardset: ShardSet, config: DiagnoseConfig) -> list[int]:
    """A deterministic subset: --limit (default DEFAULT_DIAGNOSE_SAMPLES) samples drawn with
    --seed, stratified by dataset (scoring/score/selection.py), so it looks like the whole set."""
    index = sample_index(shardset)
    return select_samples(index, Selection(sample=config.limit or DEFAULT_DIAGNOSE_SAMPLES, seed=config.seed))


def prepare(config: DiagnoseConfig, shardset: ShardSet, progress=None) -> Setup:
    """Load the checkpoint (compatibility checked first), the target head and the samples."""
    device, dtype = resolve_device_dtype(config.device, config.dtype)
    manifest, settings = shardset.manifest, shardset.settings
    layers = target_layers(manifest)
    override = family_override(config.family)
    drafter_config = read_drafter_config(config.ckpt, target_layers=layers, override=override)
    check_compatibility(drafter_config, manifest, config.ckpt, shardset.uri)
    drafter, info = load_drafter(config.ckpt, dtype=dtype, device=device, target_layers=layers, override=override)
    chosen = set(choose(shardset, config))
    samples = list(shardset.samples(tensors=SAMPLE_TENSORS, keep=chosen.__contains__))  # as score reads them
    options = ReplayOptions(
        methods={},
        memory_bytes=config.memory_bytes,
        dtype=dtype,
        device=device,
        attention=config.attention,
        sampling=sampling_of(settings),
    )
    head = prepare_target_head(shardset.target_head(), device, dtype)
    return Setup(
        drafter,
        info,
        head,
        samples,
        [int(i) for i in settings["layer_ids"]],
        int(settings["max_new_tokens"]),
        list(settings["target"]["stop_token_ids"]),
        options,
    )


def plan_variants(config: DiagnoseConfig, setup: Setup, shardset: ShardSet, program: str) -> list[Measured]:
    """The variants to replay, each with its reason when it cannot be. A variant named in
    --variants that cannot be measured is an error (saying what to do), not a silent skip."""
    names = parse_variants(",".join(config.variants) if config.variants else None)
    planned = []
    for name in names:
        variant = for_checkpoint(VARIANTS[name], setup.info.config)
        reason = skip_reason(variant, setup, shardset, program)
        asked = bool(config.variants) and name in config.variants
        if reason is not None and asked:
            raise UserError(f"--variants {name}: cannot be measured on {config.shards}: {reason}")
        if reason is None and not asked and variant.dtype is not None and setup.options.device == "cpu":
            reason = (
                f"not run by default on CPU, where {name} is several times slower than fp32; --variants {name} runs it"
            )
        planned.append(Measured(variant, note=reason))
    return _without_repeats(planned, config.variants)


def _without_repeats(planned: list[Measured], asked: list[str] | None) -> list[Measured]:
    """A variant not asked for by name that replays exactly as an earlier one is noted as such,
    not replayed or explained twice (layers-1 or layers+1 is layers-convention for a layout)."""
    for i, later in enumerate(planned):
        if asked and later.variant.name in asked:
            continue
        twin = next((m for m in planned[:i] if same_replay(m.variant, later.variant)), None)
        if twin is not None:
            later.note = f"the same replay as {twin.variant.name}"
    return planned


def run_diagnose(config: DiagnoseConfig, progress=None, program: str = "specreplay") -> Diagnosis:
    """Replay every planned variant on the same samples, compare, decide, write
    --out/<parent>_<name>/diagnose.parquet and diagnose.json. `progress(total, desc)` makes a bar;
    `program` is how hints name the console script."""
    if is_config_only(config.ckpt):  # before the shards are opened: nothing here can diagnose it
        raise UserError(
            f"{config.ckpt}: a proposer given by its config alone has no weights, so no training "
            f"convention to diagnose (diagnose replays a trained drafter under each convention); "
            f"score it with `{program} score --ckpt {config.ckpt} --shards ...`"
        )
    out_dir = os.path.join(config.out, results.result_dir_name(config.ckpt))
    with results_lock(out_dir):
        return _run_diagnose(config, out_dir, progress, program)


def _run_diagnose(config: DiagnoseConfig, out_dir: str, progress, program: str) -> Diagnosis:
    shardset = ShardSet(config.shards)
    check_out_dir(out_dir, config.force)  # before a minute of replay, not after
    setup = prepare(config, shardset)
    if not setup.samples:
        raise UserError(f"{config.shards}: no samples to replay")
    planned = plan_variants(config, setup, shardset, program)
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
    comparisons = compare_all([(m.variant.name, m.stats, m.note) for m in planned], config.resamples, config.seed)
    positions = by_position(planned[0].stats)
    sampling = setup.options.sampling
    diagnosis = Diagnosis(
        checkpoint=identity(setup.info),
        comparisons=comparisons,
        by_position=positions[0],
        anchors_by_position=positions[1],
        verdict=verdict(comparisons, positions, drawn(config, shardset, len(setup.samples)), sampling),
        samples=len(setup.samples),
        sampling=sampling,
        out_dir=out_dir,
        notes=[f"{m.variant.name}: {m.note}" for m in planned if m.note] + nonfinite_notes(todo),
        seconds={m.variant.name: round(m.seconds, 2) for m in todo},
    )
    write_diagnosis(diagnosis, config, shardset)
    return diagnosis


def drawn(config: DiagnoseConfig, shardset: ShardSet, samples: int) -> Drawn:
    """What the few-samples advice needs: the samples replayed out of those the shards hold."""
    prompts = (shardset.manifest.get("prompts") or {}).get("name")
    return Drawn(samples, len(sample_index(shardset)), config.limit, prompts)


def nonfinite_notes(measured: list[Measured]) -> list[str]:
    """'<variant>: 2 samples left out: the drafter produced NaN/Inf logits' per variant with any."""
    notes = []
    for m in measured:
        bad = sum(s.nonfinite for s in m.stats or [])
        if bad:
            notes.append(f"{m.variant.name}: {bad} samples left out: the drafter produced NaN/Inf logits on them")
    return notes


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
        {
            **diagnosis.checkpoint,
            "variant": CONFIGURED,
            "metric": "accept_by_position",
            "position": k,
            "value": p,
            "anchors": n,
        }
        for k, (p, n) in enumerate(zip(diagnosis.by_position, diagnosis.anchors_by_position), start=1)
    ]
    for row in rows:  # NaN (not measured / never reached) is stored as null
        row["value"] = None if row["value"] is None or np.isnan(row["value"]) else row["value"]
    return results.rows_table(rows, results.diagnose_schema())


def write_diagnosis(diagnosis: Diagnosis, config: DiagnoseConfig, shardset: ShardSet) -> None:
    """diagnose.parquet, then diagnose.json (each written to a temporary name and renamed)."""
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
