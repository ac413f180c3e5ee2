"""`specreplay score`: replay shards through drafter checkpoints and write parquet results.

Per checkpoint, under its output directory:
    anchors.parquet  one row per (sample, anchor): all-anchor metrics
    walk.parquet     one row per simulated decoding step (chain and each DDTree budget)
    samples.parquet  one row per (sample, method)
    summary.parquet  one row per (dataset, method), plus dataset "(all)"
    run.json         checkpoint path/hash/config, shards identity, versions, wall time
Every row carries `checkpoint` and `dataset`, so results of many checkpoints concatenate in
one polars scan: pl.scan_parquet("results/*/summary.parquet").
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from pipeline.distributed import Dist, barrier, dist_from_env, init_dist, resolve_device
from pipeline.shards import ShardSet
from scoring import metrics
from scoring.config import ScoreConfig
from scoring.checkpoint import check_compatibility, load_drafter, read_drafter_config
from scoring.replay import AnchorTensors, ReplayOptions, replay_sample, replay_walks, select_feature_columns
from scoring.walk import next_stop_positions, stop_mask, walk

WALK_COLUMNS = ("dataset", "sample_id", "method", "step", "anchor", "produced", "accepted_len")
ALL_DATASETS = "(all)"


def resolve_device_dtype(device: str, dtype: str, dist: Dist | None = None) -> tuple[str, torch.dtype]:
    """GPU if present, else CPU; fp32 on CPU and bf16 on GPU unless told otherwise."""
    device = resolve_device(None if device == "auto" else device, dist or Dist())
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if dtype == "auto":
        return device, torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in names:
        raise ValueError(f"--dtype {dtype!r}: use one of auto, {', '.join(names)}")
    return device, names[dtype]


def expand_checkpoints(patterns: list[str]) -> list[str]:
    """Paths as given, globs expanded (sorted), duplicates dropped; missing paths are an error."""
    paths: list[str] = []
    for pattern in patterns:
        literal = os.path.exists(pattern) or not any(c in pattern for c in "*?[")
        matches = [pattern] if literal else sorted(glob.glob(pattern))
        if not matches:
            raise FileNotFoundError(f"--ckpt {pattern!r} matches nothing")
        for path in matches:
            if not os.path.exists(path):
                raise FileNotFoundError(f"--ckpt {path}: no such file or directory")
            if path not in paths:
                paths.append(path)
    return paths


def result_dir_name(path: str) -> str:
    """Results sub-directory for one of several checkpoints: 'run1_step_200' for
    run1/step_200/ and 'run1_step_200' for run1/step_200.pt."""
    path = os.path.normpath(os.path.abspath(path))
    parent, base = os.path.split(path)
    stem = os.path.splitext(base)[0] if os.path.isfile(path) else base
    return f"{os.path.basename(parent)}_{stem}"


def shards_identity(manifest: dict) -> str:
    """Content identity of an extract: its settings and every shard's checksum."""
    blob = json.dumps({"settings": manifest["settings"],
                       "shards": sorted((s["file"], s["crc32"]) for s in manifest["shards"])}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def method_names(budgets: list[int]) -> list[str]:
    return ["chain"] + [f"ddtree-{n}" for n in budgets]


def _list_column(values: np.ndarray, lengths: np.ndarray, value_type) -> pa.Array:
    """A list<...> Arrow column from a flat array and per-row lengths, without Python loops."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


class SampleScorer:
    """Turns one sample's AnchorTensors into anchor, walk and sample rows."""

    def __init__(self, budgets: list[int], stop_token_ids: list[int], block_size: int):
        self.budgets = budgets
        self.methods = method_names(budgets)
        self.stop_token_ids = stop_token_ids
        self.block_size = block_size
        # per sample index: (anchor table or None, walk rows, sample rows); merged in index
        # order, so results do not depend on how samples were split over torchrun ranks
        self.parts: dict[int, tuple] = {}
        # all-anchor aggregates per dataset: integer sums, combinable in any order
        self.position_stats: dict[str, dict[str, np.ndarray]] = {}

    def merge(self, other: "SampleScorer") -> None:
        self.parts.update(other.parts)
        for dataset, stats in other.position_stats.items():
            mine = self.position_stats.setdefault(dataset, _empty_position_stats(self.block_size - 1))
            for key in mine:
                mine[key] += stats[key]

    def tables(self) -> tuple[pa.Table | None, pa.Table, list[dict]]:
        """(anchors, walk, sample rows) over all samples in index order."""
        ordered = [self.parts[i] for i in sorted(self.parts)]
        anchor_tables = [p[0] for p in ordered if p[0] is not None]
        walk_rows = {k: [v for p in ordered for v in p[1][k]] for k in WALK_COLUMNS}
        sample_rows = [row for p in ordered for row in p[2]]
        anchors = pa.concat_tables(anchor_tables) if anchor_tables else None
        return anchors, pa.table(walk_rows), sample_rows

    def add(self, index: int, sample, result: AnchorTensors) -> None:
        ids = sample.input_ids
        seq_len, prompt_len = ids.numel(), sample.prompt_len
        is_stop = stop_mask(ids, self.stop_token_ids)
        next_stop = next_stop_positions(is_stop)
        accepted_by_method = {name: method_accepted(result, name) for name in self.methods}
        produced = {name: metrics.produced_tokens(accepted, result.anchors, seq_len, next_stop[result.anchors])
                    for name, accepted in accepted_by_method.items()}
        accepted = accepted_by_method["chain"]

        mismatches = int(sample.argmax_mismatch.sum()) if "argmax_mismatch" in sample.tensors else 0
        exact = bool(sample.greedy and mismatches == 0)
        walk_rows = {k: [] for k in WALK_COLUMNS}
        sample_rows = []
        for name, steps_produced in produced.items():
            steps = walk(steps_produced, prompt_len, is_stop)
            accepted_here = accepted_by_method[name].tolist()
            for step, (anchor, count) in enumerate(steps):
                walk_rows["dataset"].append(sample.dataset)
                walk_rows["sample_id"].append(sample.sample_id)
                walk_rows["method"].append(name)
                walk_rows["step"].append(step)
                walk_rows["anchor"].append(anchor)
                walk_rows["produced"].append(count)
                walk_rows["accepted_len"].append(accepted_here[anchor - prompt_len])
            counts = [c for _, c in steps]
            sample_rows.append({
                "dataset": sample.dataset, "sample_id": sample.sample_id, "method": name,
                "prompt_len": prompt_len, "response_len": seq_len - prompt_len,
                "finish_reason": sample.finish_reason, "greedy": sample.greedy,
                "argmax_mismatches": mismatches, "exact": exact, "steps": len(steps),
                "tokens_produced": sum(counts),
                "tau": (sum(counts) / len(counts)) if counts else None,
                "prompt_text": sample.prompt_text,
            })
        anchor_table = self._anchor_table(sample, result, accepted, produced, accepted_by_method)
        self.parts[index] = (anchor_table, walk_rows, sample_rows)

    def _anchor_table(self, sample, result, accepted, produced, accepted_by_method) -> pa.Table | None:
        if not bool(result.computed.any()):
            return None
        # walk mode scores only the anchors the walks visit: keep those rows
        keep = result.computed
        result = AnchorTensors(**{name: getattr(result, name)[keep] for name in AnchorTensors.__dataclass_fields__})
        accepted = accepted[keep]
        produced = {name: value[keep] for name, value in produced.items()}
        accepted_by_method = {name: value[keep] for name, value in accepted_by_method.items()}
        A = result.anchors.numel()
        match, known = metrics.position_match(result.draft_tokens, result.target_tokens)
        lengths = known.sum(dim=1).numpy()
        flat_known = known.numpy()
        columns = {
            "dataset": pa.array([sample.dataset] * A),
            "sample_id": pa.array([sample.sample_id] * A),
            "anchor": pa.array(result.anchors.numpy().astype(np.int32)),
            "anchor_offset": pa.array((result.anchors - sample.prompt_len).numpy().astype(np.int32)),
            "block_len": pa.array(result.block_len.numpy().astype(np.int32)),
            "accepted_len": pa.array(accepted.numpy().astype(np.int32)),
            "produced_chain": pa.array(produced["chain"].numpy().astype(np.int32)),
            "expected_accepted_len": pa.array(metrics.expected_accepted(result.target_logprob).numpy()),
            "draft_match": _list_column(match.numpy()[flat_known], lengths, pa.bool_()),
            "target_prob": _list_column(result.target_logprob.exp().numpy()[flat_known], lengths, pa.float32()),
            "kl_topk": _list_column(result.kl_topk.numpy()[flat_known], lengths, pa.float32()),
        }
        for budget in self.budgets:
            columns[f"ddtree_{budget}_accepted_len"] = pa.array(accepted_by_method[f"ddtree-{budget}"].numpy().astype(np.int32))
        stats = self.position_stats.setdefault(sample.dataset, _empty_position_stats(self.block_size - 1))
        reached, accepted_here = metrics.reached_accept(accepted, self.block_size - 1)
        # positions beyond a (truncated) block or the known response cannot be reached
        reachable = known
        stats["reached"] += (reached & reachable).sum(0).numpy()
        stats["accepted"] += (accepted_here & reachable).sum(0).numpy()
        stats["match"] += match.sum(0).numpy()
        stats["known"] += known.sum(0).numpy()
        return pa.table(columns)


def method_accepted(result: AnchorTensors, method: str, rows=slice(None)) -> torch.Tensor:
    """Accepted draft tokens per anchor (bonus-exclusive) for "chain" or "ddtree-N"."""
    if method == "chain":
        return metrics.leading_matches(result.draft_tokens[rows], result.target_tokens[rows])
    return metrics.tree_accepted(result.tree_pop_index[rows], int(method.split("-", 1)[1]))


def _empty_position_stats(L: int) -> dict[str, np.ndarray]:
    return {k: np.zeros(L, dtype=np.int64) for k in ("reached", "accepted", "match", "known")}


def summarize(scorer: SampleScorer, anchors: pa.Table | None, sample_rows: list[dict], methods: list[str],
              identity: dict) -> pa.Table:
    """One row per (dataset, method), plus dataset '(all)'."""
    import polars as pl

    samples = pl.DataFrame(sample_rows)
    anchor_df = pl.from_arrow(anchors) if anchors is not None and anchors.num_rows else None
    rows = []
    datasets = sorted(samples["dataset"].unique().to_list()) + [ALL_DATASETS]
    for dataset in datasets:
        subset = samples if dataset == ALL_DATASETS else samples.filter(pl.col("dataset") == dataset)
        a_sub = None
        if anchor_df is not None:
            a_sub = anchor_df if dataset == ALL_DATASETS else anchor_df.filter(pl.col("dataset") == dataset)
        stats = _empty_position_stats(scorer.block_size - 1)
        for name, s in scorer.position_stats.items():
            if dataset in (ALL_DATASETS, name):
                for key in stats:
                    stats[key] += s[key]
        for method in methods:
            m = subset.filter(pl.col("method") == method)
            scored = m.filter(pl.col("steps") > 0)
            per_sample = [t for t in scored["tau"].to_list()]
            row = {
                **identity, "dataset": dataset, "method": method,
                "tau": metrics.tau([[v] for v in per_sample]),
                "samples": m.height, "samples_without_steps": m.height - scored.height,
                "steps": int(m["steps"].sum()), "tokens_produced": int(m["tokens_produced"].sum()),
                "inexact_samples": int((~m["exact"]).sum()),
                "argmax_mismatches": int(m["argmax_mismatches"].sum()),
                "exact": bool(m["exact"].all()),
            }
            if a_sub is not None and a_sub.height:
                col = "accepted_len" if method == "chain" else f"ddtree_{method.split('-')[1]}_accepted_len"
                row["anchors"] = a_sub.height
                row["anchor_accepted_len_mean"] = float(a_sub[col].mean())  # bonus-exclusive
            if method == "chain" and a_sub is not None and a_sub.height:
                row["anchor_produced_mean"] = float(a_sub["produced_chain"].mean())  # bonus-inclusive
                row["anchor_expected_accepted_len_mean"] = float(a_sub["expected_accepted_len"].mean())
                row["target_prob_mean"] = float(a_sub["target_prob"].explode().mean())
                row["kl_topk_mean"] = float(a_sub["kl_topk"].explode().mean())
                with np.errstate(invalid="ignore", divide="ignore"):
                    row["accept_rate_by_position"] = (stats["accepted"] / stats["reached"]).tolist()
                    row["match_rate_by_position"] = (stats["match"] / stats["known"]).tolist()
            rows.append(row)
    return pl.DataFrame(rows, infer_schema_length=None).to_arrow()


def _write_table(table: pa.Table, path: str) -> None:
    tmp = path + ".tmp"
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


def _with_identity(table: pa.Table, identity: dict) -> pa.Table:
    for index, (key, value) in enumerate(identity.items()):
        table = table.add_column(index, key, pa.array([value] * table.num_rows))
    return table


def score_checkpoint(ckpt: str, shardset: ShardSet, head: dict, out_dir: str, config: ScoreConfig,
                     dist: Dist | None = None) -> dict | None:
    """Score one checkpoint; returns its run record (None when skipped as already scored).
    Under torchrun each rank replays every world-th sample and rank 0 writes the results."""
    dist = dist or Dist()
    device, dtype = resolve_device_dtype(config.device, config.dtype, dist)
    started = time.time()
    manifest = shardset.manifest
    # Fail on an incompatible checkpoint before reading gigabytes of weights.
    check_compatibility(read_drafter_config(ckpt), manifest, ckpt)
    drafter, info = load_drafter(ckpt, dtype=dtype, device=device)
    shards_id = shards_identity(manifest)
    quiet = config.quiet or not dist.main
    total = shardset.num_samples if config.limit is None else min(config.limit, shardset.num_samples)
    if not config.force and already_scored(out_dir, info.content_hash, shards_id, config.tree_nodes, total,
                                           config.anchors):
        if not quiet:
            print(f"{info.name}: already scored on these shards in {out_dir} (use --force to redo)")
        return None

    settings = manifest["settings"]
    stored_layer_ids = settings["layer_ids"]
    drafter_layer_ids = info.config.target_layer_ids
    embed, lm_head = head["embed_tokens"], head["lm_head"]  # prepared once by run_score (prepare_target_head)
    budgets = sorted(set(config.tree_nodes))
    options = ReplayOptions(max_budget=max(budgets) if budgets else 0, memory_bytes=config.memory_bytes,
                            dtype=dtype, device=device, attention=config.attention)
    stop_ids = list(settings["target"]["stop_token_ids"])
    max_new_tokens = int(settings["max_new_tokens"])
    scorer = SampleScorer(budgets, stop_ids, info.config.block_size)

    mine = [i for i in range(total) if i % dist.world == dist.rank]
    progress = tqdm(total=len(mine), desc=f"score {info.name}", unit="sample", disable=quiet, dynamic_ncols=True)
    anchors_done = 0
    wanted = set(mine)
    samples = shardset.samples(tensors=["features", "topk_ids", "topk_logprobs", "argmax_mismatch"],
                               keep=wanted.__contains__, pin_memory=device.startswith("cuda"))
    columns = lambda f: select_feature_columns(f, stored_layer_ids, drafter_layer_ids)  # noqa: E731

    def budget_of(sample) -> int:
        # Given (teacher-forced) responses may be longer than the extract's budget.
        return max_new_tokens if sample.greedy else max(max_new_tokens, sample.response_len)

    for group in _sample_groups(zip(mine, samples), config.anchors, config.walk_group_tokens):
        if config.anchors == "all":
            results = [replay_sample(drafter, embed, lm_head, s, columns, budget_of(s), options) for _, s in group]
        else:
            results = _replay_group_walks(drafter, embed, lm_head, [s for _, s in group], columns,
                                          [budget_of(s) for _, s in group], scorer, options)
        for (index, sample), result in zip(group, results):
            scorer.add(index, sample, result)
            anchors_done += int(result.computed.sum())
        progress.update(len(group))
        progress.set_postfix(anchors_per_s=f"{anchors_done / max(time.time() - started, 1e-9):.0f}")
        del group, results, sample, result  # the next sample's replay must not keep this one's tensors alive
    progress.close()

    if dist.world > 1:
        gathered = [None] * dist.world if dist.main else None
        torch.distributed.gather_object((scorer, anchors_done), gathered, dst=0)
        if not dist.main:
            return None
        for other, count in gathered[1:]:
            scorer.merge(other)
            anchors_done += count

    identity = {"checkpoint": info.name, "checkpoint_hash": info.content_hash[:16], "checkpoint_step": info.step}
    anchors, walk_table, sample_rows = scorer.tables()
    summary = summarize(scorer, anchors, sample_rows, method_names(budgets), identity)
    summary = summary.append_column("anchor_set", pa.array([config.anchors] * summary.num_rows))
    os.makedirs(out_dir, exist_ok=True)
    if anchors is not None:
        _write_table(_with_identity(anchors, identity), os.path.join(out_dir, "anchors.parquet"))
    _write_table(_with_identity(walk_table, identity), os.path.join(out_dir, "walk.parquet"))
    _write_table(_with_identity(pa.Table.from_pylist(sample_rows), identity), os.path.join(out_dir, "samples.parquet"))
    _write_table(summary, os.path.join(out_dir, "summary.parquet"))

    wall = time.time() - started
    record = {
        "checkpoint": {"path": os.path.abspath(ckpt), "name": info.name, "content_hash": info.content_hash,
                       "step": info.step, "config": info.config_raw},
        "shards": {"uri": shardset.uri, "identity": shards_id, "target": manifest.get("target", {}).get("name"),
                   "samples": total, "feature_dtype": manifest.get("tensors", {}).get("features")},
        "ddtree_budgets": list(config.tree_nodes), "anchor_set": config.anchors,
        "device": device, "dtype": str(dtype).replace("torch.", ""), "attention": options.attention_backend,
        "world_size": dist.world,
        "anchors": anchors_done, "wall_time_s": round(wall, 3),
        "versions": {"specreplay": _version(), "torch": torch.__version__, "python": platform.python_version()},
        "command": sys.argv,
    }
    with open(os.path.join(out_dir, "run.json.tmp"), "w") as f:
        json.dump(record, f, indent=1)
    os.replace(os.path.join(out_dir, "run.json.tmp"), os.path.join(out_dir, "run.json"))
    if not config.quiet:
        print_summary(summary, info.name, out_dir, record)
    return record


def _sample_groups(indexed_samples, anchors_mode: str, group_tokens: int):
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


def _replay_group_walks(drafter, embed, lm_head, samples, columns, budgets, scorer: SampleScorer, options):
    """Walk-only replay of a group: every method's walk, anchors shared between methods once."""
    is_stop = [stop_mask(s.input_ids, scorer.stop_token_ids) for s in samples]
    next_stop = [next_stop_positions(m) for m in is_stop]

    def produced(s: int, m: int, result: AnchorTensors, row: int) -> int:
        accepted = method_accepted(result, scorer.methods[m], slice(row, row + 1))
        anchor = result.anchors[row:row + 1]
        seq_len = samples[s].input_ids.numel()
        return int(metrics.produced_tokens(accepted, anchor, seq_len, next_stop[s][anchor])[0])

    return replay_walks(drafter, embed, lm_head, samples, columns, budgets, len(scorer.methods), produced,
                        is_stop, options)


def already_scored(out_dir: str, content_hash: str, shards_id: str, budgets: list[int], samples: int,
                   anchor_set: str) -> bool:
    """True when out_dir holds results of this checkpoint content on the same shards, budgets,
    number of samples and anchor set."""
    run_path = os.path.join(out_dir, "run.json")
    if not os.path.exists(run_path):
        return False
    with open(run_path) as f:
        previous = json.load(f)
    return (previous.get("checkpoint", {}).get("content_hash") == content_hash
            and previous.get("shards", {}).get("identity") == shards_id
            and previous.get("ddtree_budgets") == list(budgets)
            and previous.get("shards", {}).get("samples") == samples
            and previous.get("anchor_set", "all") == anchor_set)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("specreplay")
    except Exception:  # noqa: BLE001 - running from a source tree
        return "dev"


def print_summary(summary: pa.Table, name: str, out_dir: str, record: dict) -> None:
    import polars as pl

    df = pl.from_arrow(summary)
    print(f"\n{name}: {record['shards']['samples']} samples, {record['anchors']} anchors, "
          f"{record['dtype']} on {record['device']}, {record['wall_time_s']:.1f}s -> {out_dir}")
    methods = [m for m in df["method"].unique(maintain_order=True).to_list()]
    header = f"{'dataset':<16}" + "".join(f"{m:>12}" for m in methods) + f"{'streak':>10}"
    print("tau (mean accepted + bonus per step, simulated walk)")
    print(header)
    for dataset in df["dataset"].unique(maintain_order=True).to_list():
        d = df.filter(pl.col("dataset") == dataset)
        taus = {r["method"]: r["tau"] for r in d.iter_rows(named=True)}
        chain = d.filter(pl.col("method") == "chain").row(0, named=True)
        streak = chain.get("anchor_accepted_len_mean")
        print(f"{dataset:<16}" + "".join(f"{_fmt(taus.get(m)):>12}" for m in methods) + f"{_fmt(streak):>10}")
    overall = df.filter((pl.col("dataset") == ALL_DATASETS) & (pl.col("method") == "chain")).row(0, named=True)
    rates = overall.get("accept_rate_by_position") or []
    print("chain acceptance per block position (all anchors, given the position was reached):")
    print("  " + " ".join(f"{k + 1}:{_fmt(r, 2)}" for k, r in enumerate(rates)))
    if overall["inexact_samples"]:
        print(f"note: {overall['inexact_samples']} of {overall['samples']} samples are not exact walks "
              f"(given responses or {overall['argmax_mismatches']} positions where the stored token is not the "
              f"full-forward argmax); their walk numbers approximate the online loop")
    if record["shards"].get("feature_dtype") == "float8_e4m3fn":
        print("note: the shards hold lossy fp8 features (extract --feature-dtype fp8); numbers approximate "
              "a lossless extract (bench/README.md measures the tau change)")


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return f"{value:.{digits}f}"


def prepare_target_head(head: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The stored target head as replay uses it, on `device`: the lm_head cast once to the
    compute dtype; the embedding kept in the narrower of its stored dtype and the compute dtype,
    because replay only gathers a block's rows and casts those (a cast is elementwise, so the
    values equal those of a cast table). At 27B shapes on CPU (bf16 shards, fp32 scoring) that
    keeps the embedding at 2.4 GiB instead of 4.7 GiB; the caller drops the stored-dtype lm_head,
    so only its compute-dtype copy stays (bench/scale.py measures the peak)."""
    embed, lm_head = head["embed_tokens"], head["lm_head"]
    if embed.element_size() >= torch.empty((), dtype=dtype).element_size():
        embed = embed.to(dtype=dtype)
    return {"embed_tokens": embed.to(device=device), "lm_head": lm_head.to(device=device, dtype=dtype)}


def run_score(config: ScoreConfig) -> list[dict]:
    """Score every checkpoint; each gets its own results directory (the --out itself for one
    checkpoint, --out/<name> for several)."""
    paths = expand_checkpoints(config.ckpts)
    shardset = ShardSet(config.shards)
    dist = dist_from_env()
    device, dtype = resolve_device_dtype(config.device, config.dtype, dist)
    head = prepare_target_head(shardset.target_head(), device, dtype)  # the stored-dtype copy is dropped here
    init_dist(dist)
    records = []
    for path in paths:
        out_dir = config.out if len(paths) == 1 else os.path.join(config.out, result_dir_name(path))
        record = score_checkpoint(path, shardset, head, out_dir, config, dist)
        barrier(dist)  # every rank sees run.json before the next checkpoint's skip check
        if record is not None:
            records.append(record)
    return records
