"""The extract's output directory: as it is (resumable, refused, or deleted with --overwrite),
prepared by rank 0 (target head, tokenizer, manifest with complete=false), its finished shard
entries, and the manifest finished (complete=true, totals).

Manifest layout (manifest.json):
    format_version, complete
    settings   the identity compared on resume: format_version, target (architecture,
               num_layers, hidden_size, vocab_size, config_hash, dtype, stop/pad/bos ids,
               chat_template_hash, weights_fingerprint), layer_ids, feature_dtype, top_k,
               max_new_tokens, enable_thinking, decoding ("greedy" | "sampled"),
               sampling (only when sampled: temperature, top_p, top_k, seed, num_samples),
               prompts (hash, count, rendered_hash)
    target     the full TargetInfo (name and path included; not part of the identity, so a
               moved model directory still resumes)
    tensors    {tensor name: dtype name} as stored in the shards
    prompts    {name, hash, count, rendered_hash}
    target_head, tokenizer ({dir, files: {name: bytes}}), shards (entries sorted by file name),
    totals, run (informational)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pipeline import shards
from pipeline.common import timing
from pipeline.common.layer_ids import final_prenorm_id
from pipeline.common.settings import settings_diff
from pipeline.extract.config import ExtractConfig
from pipeline.extract.plan import (
    Item,
    Plan,
)
from pipeline.shards.writer import excluded_records


def existing_outputs(out: str) -> tuple[dict | None, bool]:
    """(manifest or None, whether anything of ours is there). Raises ShardError on a bad manifest."""
    fs, root = shards.open_fs(out)
    has_manifest = shards.exists(fs, shards.join(root, shards.MANIFEST_NAME))
    has_shards = shards.exists(fs, shards.join(root, shards.SHARD_DIR))
    has_head = shards.exists(fs, shards.join(root, shards.TARGET_HEAD_NAME))
    manifest = shards.read_manifest(out) if has_manifest else None
    return manifest, has_manifest or has_shards or has_head


def check_out_dir(out: str, settings: dict, overwrite: bool) -> dict | None:
    """The resumable manifest in OUT, None when starting fresh; refuses anything else (read-only)."""
    try:
        manifest, ours = existing_outputs(out)
    except shards.ShardError as error:
        if overwrite:
            return None
        raise shards.ShardError(f"{error}\n(--overwrite deletes the old outputs in {out} and starts over)") from error
    if overwrite or not ours:
        return None
    if manifest is None:
        raise shards.ShardError(
            f"{out} holds extract outputs (shards/ or {shards.TARGET_HEAD_NAME}) but no {shards.MANIFEST_NAME}; "
            f"refusing to mix them with a new run. Pass --overwrite to delete them, or choose another --out."
        )
    diff = settings_diff(manifest.get("settings", {}), settings)
    if diff:
        raise shards.ShardError(
            f"{out} already holds an extract with different settings:\n  "
            + "\n  ".join(diff)
            + "\nPass --overwrite to delete the old outputs and start over, or choose another --out."
        )
    return manifest


def finished_with_engine(out: str, settings: dict, overwrite: bool) -> dict | None:
    """OUT's complete manifest when it already holds this extract with engine responses, whichever
    servers made them: a finished run has nothing left to ask, so it needs no server up."""
    try:
        manifest, _ = existing_outputs(out)
    except shards.ShardError:
        return None
    recorded = (manifest or {}).get("settings", {})
    if overwrite or not (manifest and manifest.get("complete") and "responses" in recorded):
        return None
    if settings_diff(recorded, {**settings, "responses": recorded["responses"]}) or missing_shards(out, manifest):
        return None
    return manifest


def delete_outputs(out: str) -> None:
    """Remove what extract writes in OUT (manifest, target head, shards/, tokenizer/, the engine
    responses/ of --responses-from); nothing else."""
    from pipeline.extract.engines.cache import RESPONSES_DIR

    fs, root = shards.open_fs(out)
    for name in (shards.MANIFEST_NAME, shards.TARGET_HEAD_NAME):
        path = shards.join(root, name)
        if shards.exists(fs, path):
            fs.delete_file(path)
    for name in (shards.SHARD_DIR, shards.TOKENIZER_DIR, RESPONSES_DIR):
        path = shards.join(root, name)
        if shards.exists(fs, path):
            fs.delete_dir(path)


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


def prepare_out_dir(config: ExtractConfig, model, tokenizer, plan: Plan, manifest: dict) -> None:
    """After check_out_dir accepted OUT: delete old outputs (--overwrite), remove what an interrupted
    run left unfinished, store the target head and tokenizer once, write the manifest with
    complete=false."""
    if config.overwrite:
        delete_outputs(config.out)
    shards.remove_unfinished(config.out)
    with timing.stage("store target head"):
        manifest["target_head"] = stored_target_head(config.out, model, stores_final_prenorm(plan))
    if tokenizer is not None:
        manifest["tokenizer"] = stored_tokenizer(config.out, tokenizer)
    entries = shards.finished_shard_entries(config.out)
    manifest.update(shards=entries, totals=totals(entries, plan.raw_bytes_per_token))
    shards.write_manifest(config.out, manifest)


def stores_final_prenorm(plan: Plan) -> bool:
    """Whether the features include id L, the final hidden state before the norm (MTP heads read it)."""
    return final_prenorm_id(plan.settings["target"]["num_layers"]) in plan.layer_ids


def stored_target_head(out: str, model, with_final_norm: bool = False) -> dict:
    """Store the embedding and lm_head once, and the final norm's weight with the final hidden state
    before the norm (id L: what an MTP head reads, after that norm); a resumed run keeps the file
    the first run wrote."""
    from pipeline.extract.target import final_norm_weight, input_embedding_weight, output_head_weight

    fs, root = shards.open_fs(out)
    fs.create_dir(root, recursive=True)
    path = shards.join(root, shards.TARGET_HEAD_NAME)
    if shards.exists(fs, path):
        previous = previous_entry(out, "target_head")
        if previous:
            return previous
    norm = final_norm_weight(model) if with_final_norm else None
    return shards.save_target_head(out, input_embedding_weight(model), output_head_weight(model), norm)


def previous_entry(out: str, key: str):
    """manifest[key] of the run that wrote OUT before (None when there is no readable manifest)."""
    try:
        return shards.read_manifest(out).get(key)
    except shards.ShardError:
        return None


def stored_tokenizer(out: str, tokenizer) -> dict:
    """Store the target's tokenizer in OUT/tokenizer/ (save_pretrained), so reports can show
    stored tokens as text with AutoTokenizer.from_pretrained; returns the manifest entry.

    The manifest entry is the commit point, not a directory rename: object stores (s3://, gs://)
    cannot move a directory, so files land one by one (each atomically). A resumed run keeps a
    tokenizer whose entry the previous manifest holds and whose files are all there at their
    sizes; anything else (an interrupted first write) is deleted and written again."""
    fs, root = shards.open_fs(out)
    directory = shards.join(root, shards.TOKENIZER_DIR)
    previous = previous_entry(out, "tokenizer")
    if previous and tokenizer_files_present(fs, directory, previous.get("files", {})):
        return previous
    if shards.exists(fs, directory):
        fs.delete_dir(directory)
    fs.create_dir(directory, recursive=True)
    files = {}
    with tempfile.TemporaryDirectory(prefix="specreplay-tokenizer-") as local:
        tokenizer.save_pretrained(local)
        for name in sorted(os.listdir(local)):  # save_pretrained writes flat files
            data = Path(local, name).read_bytes()
            shards.write_bytes_atomic(fs, shards.join(directory, name), data)
            files[name] = len(data)
    return {"dir": shards.TOKENIZER_DIR, "files": files}


def tokenizer_files_present(fs, directory: str, files: dict[str, int]) -> bool:
    """Every file of a manifest's tokenizer entry exists with its recorded size."""
    if not files:
        return False
    infos = fs.get_file_info([shards.join(directory, name) for name in files])
    return all(info.size == size for info, size in zip(infos, files.values()))


def finish_manifest(out: str, manifest: dict, items: list[Item], raw_per_token: int) -> None:
    """Merge every finished shard (all ranks, all runs) into the manifest and mark it complete."""
    entries = shards.finished_shard_entries(out)  # sorted by file name
    missing = {item.sample_id for item in items} - check_entries(entries)  # excluded samples are done too
    if missing:
        raise shards.ShardError(
            f"{out}: {len(missing)} samples were not written (e.g. {sorted(missing)[:3]}); "
            f"run the same command again to resume"
        )
    manifest.update(complete=True, shards=entries, totals=totals(entries, raw_per_token))
    shards.write_manifest(out, manifest)


def missing_shards(out: str, manifest: dict) -> list[str]:
    """Shards a finished manifest lists that are gone (deleted after damage, as the reader's
    errors advise): the same extract command then resumes and writes their samples again."""
    fs, root = shards.open_fs(out)
    return [e["file"] for e in manifest.get("shards", []) if not shards.exists(fs, shards.join(root, e["file"]))]


LOCK_NAME = ".specreplay.lock"


def output_lock(out: str):
    """The lock that keeps a second extract out of OUT while this one writes (pipeline/common/lock.py)."""
    from pipeline.common.lock import local_lock

    return local_lock(out, os.path.join(out, LOCK_NAME), f"extract --out {out}")
