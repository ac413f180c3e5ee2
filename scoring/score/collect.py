"""Per-sample replay results gathered into the four results tables that scoring/results.py declares.

`Collector.add` turns one sample's AnchorTensors into its walk steps, per-method sample rows,
anchor rows and per-position counts; `Collector.tables` orders them by sample index (so the
output does not depend on how samples were split over torchrun ranks) and builds the summary.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from pipeline.common.sampling import Sampling
from scoring import results
from scoring.methods import registry as methods
from scoring.methods.chain import CHAIN
from scoring.prompts import user_message
from scoring.replay import metrics
from scoring.replay.anchors import AnchorTensors, at_rows, step_inputs
from scoring.replay.walk import (
    expected_tau as walk_expected_tau,
    next_stop_positions,
    steps_distribution,
    stop_mask,
    walk,
    walk_end,
)
from scoring.replay.walk_rules import DEFAULT_RULE, RULES, Counts, WalkRule

GREEDY = Sampling()


def _list_column(values: np.ndarray, lengths: np.ndarray, value_type) -> pa.Array:
    """A list<...> Arrow column from a flat array and per-row lengths, without Python loops."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def _zero_counts(positions: int, dtype=np.int64) -> dict[str, np.ndarray]:
    return {k: np.zeros(positions, dtype=dtype) for k in ("reached", "accepted", "match", "known")}


def sample_row(sample, method: str, produced: list[int], mismatches: int, chain: SampledChain | None = None) -> dict:
    """samples.parquet's row (without the identity) for one sample and method; for the chain
    on sampled shards (`chain` given) the expected tau, no step count."""
    if chain is not None:
        return {
            **sample_row(sample, method, [], mismatches),
            "steps": None,
            "tokens_produced": chain.tokens,
            "tau": chain.expected_tau,
        }
    return {
        "dataset": sample.dataset,
        "sample_id": sample.sample_id,
        "method": method,
        "prompt_len": sample.prompt_len,
        "response_len": sample.response_len,
        "finish_reason": sample.finish_reason,
        "greedy": sample.greedy,
        "argmax_mismatches": mismatches,
        "exact": bool(from_target(sample) and mismatches == 0),
        "steps": len(produced),
        "tokens_produced": sum(produced),
        "tau": metrics.sample_tau(produced),
        "prompt_text": sample.prompt_text,
        "prompt_message": user_message(sample.prompt_text),
        "tokens_hash": tokens_hash(sample.input_ids),
    }


def from_target(sample) -> bool:
    """The response is the target's own: its greedy output, or sampled from it (not given text)."""
    return bool(sample.greedy or ("sample_logprob" in sample.tensors and sample.finish_reason != "given"))


def tokens_hash(input_ids: torch.Tensor) -> str:
    """results.SAMPLES' `tokens_hash`: sha256 of the int64 token ids, first 16 hex digits."""
    return hashlib.sha256(input_ids.to(torch.int64).numpy().astype("<i8").tobytes()).hexdigest()[:16]


def draft_block(result: AnchorTensors, i: int) -> list[int]:
    """The drafter's chain draft at anchor index i: its block's drafts 1 .. depth."""
    return result.draft_tokens[i, : int(result.depth[i])].tolist()


@dataclass
class SampledChain:
    """The chain on a sampled response (docs/sampling.md): per-anchor acceptance probabilities
    and the expected walk over them."""

    accept_probs: torch.Tensor  # [A, L] a_j = min(1, q_j(y_j) / p_j(y_j)), 0 where unknown
    expected_accepted: torch.Tensor  # [A] E[accepted], bonus-exclusive
    expected_tau: float | None  # E[N / S] (None: no step)
    expected_steps: float  # E[S]
    tokens: int  # N, the same for every walk over this response


def target_sampling_logprob(sample, result: AnchorTensors) -> torch.Tensor:
    """[A, L] log p_j(y_j): the stored sampling log-probability of the response token at each
    anchor's block position j (NaN where unknown)."""
    stored = sample.tensors["sample_logprob"].double()  # [R], row i = position prompt_len + i
    L = result.target_tokens.shape[1]
    rows = result.anchors[:, None] + torch.arange(1, L + 1)[None, :] - sample.prompt_len
    known = result.target_tokens >= 0
    return torch.where(known, stored[rows.clamp(max=stored.numel() - 1)], torch.full(rows.shape, float("nan")))


def sampled_chain(sample, result: AnchorTensors, is_stop: torch.Tensor, next_stop: torch.Tensor) -> SampledChain:
    """Expected chain acceptance and expected tau of one sampled response."""
    accept = metrics.acceptance_probs(result.sampled_logprob, target_sampling_logprob(sample, result))
    produced = metrics.produced_distribution(accept, result.anchors, sample.input_ids.numel(), next_stop)
    end = walk_end(sample.prompt_len, is_stop)
    steps = steps_distribution(produced, sample.prompt_len, end)
    expected_tau, expected_steps = walk_expected_tau(steps, end - sample.prompt_len)
    return SampledChain(
        accept, metrics.expected_accepted_sampled(accept), expected_tau, expected_steps, end - sample.prompt_len
    )


def inexact_positions(sample, chain: SampledChain | None) -> int:
    """Positions that make a walk inexact: greedy shards, the stored token is not the full
    forward's argmax; sampled shards, it has probability 0 under the full forward's sampling
    distribution (batched vs full-forward numerics)."""
    if "sample_logprob" in sample.tensors:
        return int(torch.isneginf(sample.tensors["sample_logprob"]).sum())
    return int(sample.argmax_mismatch.sum()) if "argmax_mismatch" in sample.tensors else 0


def add_walk_rows(columns: dict, sample, method: str, steps: list, accepted: list[int], counts, result) -> None:
    """walk.parquet's rows of one method's walk over one sample, appended column by column;
    `counts`: what the walk rule's loop reports at each anchor (walk_rules.Counts, as lists)."""
    for step, (anchor, count) in enumerate(steps):
        i = anchor - sample.prompt_len
        row = (
            sample.dataset,
            sample.sample_id,
            method,
            step,
            anchor,
            count,
            accepted[i],
            counts.drafted[i],
            counts.accepted[i],
            counts.exact[i],
            draft_block(result, i) if method == CHAIN else None,
        )
        for column, value in zip(columns.values(), row):
            column.append(value)


def computed_only(result: AnchorTensors) -> AnchorTensors:
    """The anchors actually scored (walk mode scores only those the walks visit)."""
    return at_rows(result, result.computed)


class Collector:
    """Everything `score` writes for one checkpoint, sample by sample."""

    def __init__(
        self,
        plan: dict,
        stop_token_ids: list[int],
        positions: int,
        drafts: bool = False,
        sampling: Sampling = GREEDY,
        rule: WalkRule = RULES[DEFAULT_RULE],
    ):
        self.rule = rule  # whose loop's counts walk.parquet reports (scoring/replay/walk_rules.py)
        self.plan = plan  # the tree methods' settings by kind (scoring/methods/registry.py)
        self.sampling = sampling  # the shards' settings: the chain is an expectation at T > 0
        self.drafts = drafts  # anchors.parquet keeps every anchor's draft block
        self.methods = methods.method_names(plan)
        self.stop_token_ids = stop_token_ids
        self.positions = positions  # drafts of a full block
        self.parts: dict[int, tuple] = {}  # sample index -> (anchor columns or None, walk columns, sample rows)
        # sample index -> {sample_id, dataset, anchors}: the drafter's logits held NaN/Inf at those
        # anchors; such a sample is in no table and no summary, only in run.json's nonfinite_drafter
        self.nonfinite: dict[int, dict] = {}
        self.counts: dict[str, dict[str, np.ndarray]] = {}  # dataset -> per-position counts (integer sums)

    def merge(self, other: Collector) -> None:
        self.parts.update(other.parts)
        self.nonfinite.update(other.nonfinite)
        for dataset, counts in other.counts.items():
            mine = self.counts.setdefault(dataset, self.zero_counts())
            for key in mine:
                mine[key] += counts[key]

    def zero_counts(self) -> dict[str, np.ndarray]:
        """Per-position counts: integers, or expected (float) counts for sampled shards."""
        return _zero_counts(self.positions, np.int64 if self.sampling.greedy else np.float64)

    def accepted(self, result: AnchorTensors) -> dict[str, torch.Tensor]:
        """Accepted length per anchor (bonus-exclusive) of every method."""
        return {m: methods.accepted(result, m, self.plan) for m in self.methods}

    def nonfinite_samples(self) -> list[dict]:
        """The samples left out for NaN/Inf drafter logits, in sample index order."""
        return [self.nonfinite[i] for i in sorted(self.nonfinite)]

    def add(self, index: int, sample, result: AnchorTensors) -> None:
        bad = result.nonfinite & result.computed
        if bool(bad.any()):  # never averaged into anything: reported with its anchors instead
            anchors = result.anchors[bad].tolist()
            self.nonfinite[index] = {"sample_id": sample.sample_id, "dataset": sample.dataset, "anchors": anchors}
            return
        is_stop = stop_mask(sample.input_ids, self.stop_token_ids)
        next_stop = next_stop_positions(is_stop)
        accepted = self.accepted(result)
        seq_len = sample.input_ids.numel()
        produced = {
            m: metrics.produced_tokens(a, result.anchors, seq_len, next_stop[result.anchors])
            for m, a in accepted.items()
        }
        chain = None if self.sampling.greedy else sampled_chain(sample, result, is_stop, next_stop)
        mismatches = inexact_positions(sample, chain)
        walk_columns = {name: [] for name in results.columns(results.WALK)}
        sample_rows = []
        for method in self.methods:
            if chain is not None and method == CHAIN:  # no single walk: its expectation
                sample_rows.append(sample_row(sample, method, [], mismatches, chain))
                continue
            steps = walk(produced[method], sample.prompt_len, is_stop)
            counts = self.step_counts(result, accepted[method], produced[method], next_stop)
            add_walk_rows(walk_columns, sample, method, steps, accepted[method].tolist(), counts, result)
            sample_rows.append(sample_row(sample, method, [c for _, c in steps], mismatches))
        self.parts[index] = (
            self.anchor_columns(sample, result, accepted, produced[CHAIN], chain),
            walk_columns,
            sample_rows,
        )

    def step_counts(self, result: AnchorTensors, accepted, produced, next_stop) -> Counts:
        """The walk rule's drafted and accepted counts at every anchor, as lists."""
        counts = self.rule.counts(step_inputs(result, accepted, produced, next_stop))
        return Counts(*(values.tolist() for values in (counts.drafted, counts.accepted, counts.exact)))

    def anchor_columns(
        self,
        sample,
        result: AnchorTensors,
        accepted: dict[str, torch.Tensor],
        produced: torch.Tensor,
        chain: SampledChain | None = None,
    ) -> dict | None:
        """anchors.parquet's columns (without the identity) for the anchors scored, from `add`'s
        per-anchor accepted lengths and chain `produced`; adds the sample's per-position counts
        to its dataset's."""
        keep = result.computed
        if not bool(keep.any()):
            return None
        result = computed_only(result)
        accepted = {m: a[keep] for m, a in accepted.items()}
        produced = produced[keep]
        match, known = metrics.position_match(result.draft_tokens, result.target_tokens)
        counts = metrics.position_counts(accepted[CHAIN], match, known)
        expected = metrics.expected_accepted(result.target_logprob)
        if chain is not None:  # rejection sampling: expected counts and expected accepted length
            counts.update(metrics.expected_position_counts(chain.accept_probs[keep], known))
            expected = chain.expected_accepted[keep].float()
        mine = self.counts.setdefault(sample.dataset, self.zero_counts())
        for key in mine:
            mine[key] += counts[key].numpy()
        lengths, flat_known, A = known.sum(dim=1).numpy(), known.numpy(), result.anchors.numel()
        columns = {
            "dataset": [sample.dataset] * A,
            "sample_id": [sample.sample_id] * A,
            "anchor": result.anchors.numpy().astype(np.int32),
            "anchor_offset": (result.anchors - sample.prompt_len).numpy().astype(np.int32),
            "block_len": result.block_len.numpy().astype(np.int32),
            "accepted_len": accepted[CHAIN].numpy().astype(np.int32),
            "produced_chain": produced.numpy().astype(np.int32),
            "expected_accepted_len": expected.numpy(),
            "draft_match": _list_column(match.numpy()[flat_known], lengths, pa.bool_()),
            "target_prob": _list_column(result.target_logprob.exp().numpy()[flat_known], lengths, pa.float32()),
            "kl_topk": _list_column(result.kl_topk.numpy()[flat_known], lengths, pa.float32()),
        }
        for method, setting in methods.planned(self.plan)[1:]:  # the tree methods' own columns
            columns[method.column(setting)] = accepted[method.name(setting)].numpy().astype(np.int32)
        if self.drafts:
            columns["draft_tokens"] = [draft_block(result, i) for i in range(A)]
        return columns

    def tables(self, identity: dict, anchor_set: str) -> dict[str, pa.Table | None]:
        """{'anchors' (None when no anchor was scored), 'walk', 'samples', 'summary'} in sample index order."""
        ordered = [self.parts[i] for i in sorted(self.parts)]
        anchor_parts = [
            results.table(
                results.with_identity(p[0], identity, len(p[0]["anchor"])),
                results.anchors_schema(self.plan, self.drafts),
            )
            for p in ordered
            if p[0] is not None
        ]
        walk_columns = {k: [v for p in ordered for v in p[1][k]] for k in results.columns(results.WALK)}
        sample_rows = [{**identity, **row} for p in ordered for row in p[2]]
        anchors = pa.concat_tables(anchor_parts) if anchor_parts else None
        return {
            "anchors": anchors,
            "walk": results.table(
                results.with_identity(walk_columns, identity, len(walk_columns["step"])), results.walk_schema()
            ),
            "samples": results.rows_table(sample_rows, results.samples_schema()),
            "summary": summarize(self, anchors, sample_rows, identity, anchor_set),
        }


def summarize(
    collector: Collector, anchors: pa.Table | None, sample_rows: list[dict], identity: dict, anchor_set: str
) -> pa.Table:
    """summary.parquet: one row per (dataset, method), plus dataset ALL_DATASETS."""
    import polars as pl

    samples = pl.DataFrame(sample_rows, schema_overrides={"steps": pl.Int64, "tau": pl.Float64})
    sampling = collector.sampling
    settings = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}
    anchor_df = pl.from_arrow(anchors) if anchors is not None and anchors.num_rows else None
    rows = []
    for dataset in sorted(samples["dataset"].unique().to_list()) + [results.ALL_DATASETS]:
        pooled = dataset == results.ALL_DATASETS
        subset = samples if pooled else samples.filter(pl.col("dataset") == dataset)
        a_sub = None if anchor_df is None else anchor_df if pooled else anchor_df.filter(pl.col("dataset") == dataset)
        counts = collector.zero_counts()
        for name, c in collector.counts.items():
            if pooled or name == dataset:
                for key in counts:
                    counts[key] += c[key]
        for method in collector.methods:
            row = {**identity, "dataset": dataset, "method": method, **walk_summary(subset, method, sampling)}
            if a_sub is not None and a_sub.height:
                row.update(anchor_summary(a_sub, method, counts, sampling))
            rows.append({**row, "anchor_set": anchor_set, **settings})
    return results.rows_table(rows, results.summary_schema())


def walk_summary(samples, method: str, sampling: Sampling = GREEDY) -> dict:
    """The walk columns of one summary row, from the samples rows of one (dataset, method); on
    sampled shards tau's sampling error over responses too (the chain's tau is an expectation,
    without a step count)."""
    import polars as pl

    m = samples.filter(pl.col("method") == method)
    scored = m.filter(pl.col("tau").is_not_null())  # a response without a step has no tau
    steps = m["steps"].drop_nulls()
    return {
        "tau": metrics.tau(scored["tau"].to_list()),
        "tau_se": None if sampling.greedy else metrics.tau_standard_error(scored["tau"].to_list()),
        "samples": m.height,
        "samples_without_steps": m.height - scored.height,
        "steps": int(steps.sum()) if steps.len() else None,
        "tokens_produced": int(m["tokens_produced"].sum()),
        "inexact_samples": int((~m["exact"]).sum()),
        "argmax_mismatches": int(m["argmax_mismatches"].sum()),
        "exact": bool(m["exact"].all()),
    }


def anchor_summary(anchors, method: str, counts: dict[str, np.ndarray], sampling: Sampling = GREEDY) -> dict:
    """The all-anchor columns of one summary row (the chain's extra columns only for the chain).
    On sampled shards the chain's streak is its expected accepted length under rejection
    sampling (anchors.parquet `expected_accepted_len`), not the greedy drafts' match run."""
    sampled_chain_row = method == CHAIN and not sampling.greedy
    column = "expected_accepted_len" if sampled_chain_row else methods.accepted_column(method)
    row = {
        "anchors": anchors.height,
        "anchor_accepted_len_mean": metrics.streak(
            torch.from_numpy(np.array(anchors[column].to_numpy(), dtype=np.float64 if sampled_chain_row else None))
        ),
    }
    if method == CHAIN:
        # bonus-inclusive; on sampled shards produced is random per anchor, so left out
        row["anchor_produced_mean"] = None if sampled_chain_row else float(anchors["produced_chain"].mean())
        row["anchor_expected_accepted_len_mean"] = float(anchors["expected_accepted_len"].mean())
        row["target_prob_mean"] = float(anchors["target_prob"].explode().mean())
        row["kl_topk_mean"] = float(anchors["kl_topk"].explode().mean())
        accepted, reached = torch.from_numpy(counts["accepted"]), torch.from_numpy(counts["reached"])
        row["accept_rate_by_position"] = metrics.acceptance_by_position(accepted, reached).tolist()
        low, high = metrics.wilson_interval(accepted, reached)
        row["accept_rate_low_by_position"], row["accept_rate_high_by_position"] = low.tolist(), high.tolist()
        row["reached_by_position"] = counts["reached"].astype(np.float64).tolist()
        row["match_rate_by_position"] = metrics.match_rate_by_position(
            torch.from_numpy(counts["match"]), torch.from_numpy(counts["known"])
        ).tolist()
    return row
