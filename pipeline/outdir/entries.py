"""A run's finished shard entries: the sample ids they account for, the next shard number a rank
may use, and the manifest's totals over them (`inspect` sums an unfinished run's the same way)."""

from __future__ import annotations

from pipeline import shards
from pipeline.shards.writer import excluded_records


def totals(entries: list[dict], raw_feature_bytes_per_token: int) -> dict:
    """The manifest's totals over finished shard entries (samples, tokens, bytes, finish reasons...)."""
    out = {
        "samples": 0,
        "tokens": 0,
        "response_tokens": 0,
        "bytes": 0,
        "finish_reasons": {},
        "argmax_mismatches": 0,
        "greedy_samples": 0,
        "greedy_response_tokens": 0,
        "greedy_argmax_mismatches": 0,
    }
    for entry in entries:
        out["samples"] += entry["rows"]
        out["tokens"] += entry["tokens"]
        out["bytes"] += entry["bytes"]
        for key in (
            "response_tokens",
            "argmax_mismatches",
            "greedy_samples",
            "greedy_response_tokens",
            "greedy_argmax_mismatches",
        ):
            out[key] += entry.get(key, 0)
        for reason, count in entry.get("finish_reasons", {}).items():
            out["finish_reasons"][reason] = out["finish_reasons"].get(reason, 0) + count
    out["prompt_tokens"] = out["tokens"] - out["response_tokens"]
    out["raw_bf16_feature_bytes"] = out["tokens"] * raw_feature_bytes_per_token
    for key in ("sampled_response_tokens", "zero_prob_tokens"):  # sampled extracts only
        if any(key in entry for entry in entries):
            out[key] = sum(entry.get(key, 0) for entry in entries)
    mismatched = mismatched_samples(entries)
    if mismatched:  # greedy samples that are not exact walks; key absent when every one is
        out["mismatched_greedy_samples"] = len(mismatched)
    excluded = excluded_records(entries)
    if excluded:  # samples with NaN/Inf, never written; keys absent when there are none
        out["excluded_samples"] = len(excluded)
        out["excluded"] = excluded
    return out


def mismatched_samples(entries: list[dict]) -> dict[str, int]:
    """{sample id: argmax mismatches} of every greedy sample with any, in entry order."""
    return {sample_id: n for entry in entries for sample_id, n in entry.get("mismatched_samples", {}).items()}


def check_entries(entries: list[dict], wanted: set[str] | None = None) -> set[str]:
    """Sample ids finished shards account for, written or excluded (non-finite values, never
    written, not redone on resume); a duplicate or an id outside the prompt set is an error."""
    ids: dict[str, str] = {}
    for entry in entries:
        for sample_id in entry["sample_ids"] + [r["sample_id"] for r in entry.get("excluded", [])]:
            if sample_id in ids:
                raise shards.ShardError(
                    f"sample {sample_id!r} is in both {ids[sample_id]} and {entry['file']}; the output is "
                    f"inconsistent, re-run with --overwrite"
                )
            if wanted is not None and sample_id not in wanted:
                raise shards.ShardError(f"{entry['file']} holds sample {sample_id!r}, which is not in the prompt set")
            ids[sample_id] = entry["file"]
    return set(ids)


def next_shard_index(entries: list[dict], rank: int) -> int:
    """First shard number for this rank after those already finished (never reuse a name)."""
    prefix = f"{shards.SHARD_DIR}/r{rank:03d}-"
    used = [int(e["file"][len(prefix) :].split(".")[0]) for e in entries if e["file"].startswith(prefix)]
    return max(used) + 1 if used else 0
