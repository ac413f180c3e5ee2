"""OUT, the output directory of every stage 1 source: as it is (resumable, refused, or deleted
with --overwrite), locked while a run writes it, prepared by one process (target head, tokenizer,
manifest with complete=false), and the writer that resumes a rank's shards after those finished."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from pipeline import shards
from pipeline.common import timing
from pipeline.common.errors import Interrupted, Terminated
from pipeline.common.settings import ABSENT, flatten, settings_diff
from pipeline.outdir.entries import check_entries, next_shard_index, totals
from pipeline.outdir.storage import Storage

LOCK_NAME = ".specreplay.lock"


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
        raise no_manifest_error(out)
    diff = settings_diff(manifest.get("settings", {}), settings)
    if diff:
        raise different_settings_error(out, diff)
    return manifest


def no_manifest_error(out: str) -> shards.ShardError:
    return shards.ShardError(
        f"{out} holds extract outputs (shards/ or {shards.TARGET_HEAD_NAME}) but no {shards.MANIFEST_NAME}; "
        f"refusing to mix them with a new run. Pass --overwrite to delete them, or choose another --out."
    )


def different_settings_error(out: str, diff: list[str]) -> shards.ShardError:
    return shards.ShardError(
        f"{out} already holds an extract with different settings:\n  "
        + "\n  ".join(diff)
        + "\nPass --overwrite to delete the old outputs and start over, or choose another --out."
    )


def check_known_settings(out: str, known: dict, overwrite: bool, whole: tuple[str, ...] = ()) -> None:
    """Before the target loads: refuse OUT when what it holds differs in a setting the command
    line alone decides (`known`, nested as the manifest's settings; the top-level keys in `whole`
    compared whole, absent ones too), so that error comes in a second, not after minutes of
    loading; check_out_dir compares every setting once the model is in."""
    if overwrite:
        return
    try:
        manifest, ours = existing_outputs(out)
    except shards.ShardError:
        return  # check_out_dir says what is wrong with it, and the fix
    if ours and manifest is None:
        raise no_manifest_error(out)
    if manifest is None:
        return
    old, new = flatten(manifest.get("settings", {})), flatten(known)
    keys = set(new) | {key for key in old if key.split(".")[0] in whole}
    diff = [
        f"{key}: {old.get(key, ABSENT)!r} -> {new.get(key, ABSENT)!r}"
        for key in sorted(keys)
        if old.get(key, ABSENT) != new.get(key, ABSENT)
    ]
    if diff:
        raise different_settings_error(out, diff)


def finished_before(out: str, settings: dict, overwrite: bool) -> dict | None:
    """OUT's manifest when it already holds this run, finished and whole: nothing to do then.
    Refuses what check_out_dir refuses (every rank calls it, so all refuse together)."""
    existing = check_out_dir(out, settings, overwrite)
    if existing is not None and existing.get("complete") and not missing_shards(out, existing):
        return existing
    return None


def missing_shards(out: str, manifest: dict) -> list[str]:
    """Shards a finished manifest lists that are gone (deleted after damage, as the reader's
    errors advise): the same command then resumes and writes their samples again."""
    fs, root = shards.open_fs(out)
    return [e["file"] for e in manifest.get("shards", []) if not shards.exists(fs, shards.join(root, e["file"]))]


def delete_outputs(out: str) -> None:
    """Remove what stage 1 writes in OUT (manifest, target head, shards/, tokenizer/, the engine
    responses/ of --responses-from); nothing else."""
    fs, root = shards.open_fs(out)
    for name in (shards.MANIFEST_NAME, shards.TARGET_HEAD_NAME):
        path = shards.join(root, name)
        if shards.exists(fs, path):
            fs.delete_file(path)
    for name in (shards.SHARD_DIR, shards.TOKENIZER_DIR, shards.RESPONSES_DIR):
        path = shards.join(root, name)
        if shards.exists(fs, path):
            fs.delete_dir(path)


def output_lock(out: str, command: str):
    """The lock that keeps a second run out of OUT while this one writes (pipeline/common/lock.py);
    `command` ("extract", "import") names the holder in the message a second run gets."""
    from pipeline.common.lock import local_lock

    return local_lock(out, os.path.join(out, LOCK_NAME), f"{command} --out {out}")


def prepare_out(
    out: str, manifest: dict, storage: Storage, overwrite: bool, head_tensors: Callable[[], tuple], tokenizer
) -> None:
    """After check_out_dir accepted OUT: delete old outputs (--overwrite), remove what an
    interrupted run left unfinished, store the target head (`head_tensors()`: embedding, lm_head,
    final norm weight or None) and the tokenizer once, write the manifest with complete=false."""
    if overwrite:
        delete_outputs(out)
    shards.remove_unfinished(out)
    with timing.stage("store target head"):
        manifest["target_head"] = kept_target_head(out) or shards.save_target_head(out, *head_tensors())
    if tokenizer is not None:
        manifest["tokenizer"] = stored_tokenizer(out, tokenizer)
    entries = shards.finished_shard_entries(out)
    manifest.update(shards=entries, totals=totals(entries, storage.raw_bytes_per_token))
    shards.write_manifest(out, manifest)


def kept_target_head(out: str) -> dict | None:
    """The target head entry of the run that wrote OUT before, when its file is there: a resumed
    run keeps the file the first run wrote. Creates OUT."""
    fs, root = shards.open_fs(out)
    fs.create_dir(root, recursive=True)
    if not shards.exists(fs, shards.join(root, shards.TARGET_HEAD_NAME)):
        return None
    return previous_entry(out, "target_head")


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


def resume_writer(
    out: str, rank: int, storage: Storage, sample_ids: set[str], shard_bytes: int, zstd_level: int
) -> tuple[shards.ShardWriter, set[str]]:
    """(this rank's ShardWriter, numbered after the shards finished before; the ids of `sample_ids`
    those shards already account for, never written again)."""
    finished = shards.finished_shard_entries(out)
    done = check_entries(finished, sample_ids)
    writer = shards.ShardWriter(
        out,
        rank,
        storage.tensors,
        shard_bytes=shard_bytes,
        zstd_level=zstd_level,
        first_index=next_shard_index(finished, rank),
        chunk_tokens=storage.chunk_tokens,
    )
    return writer, done


def kept_on_stop(writer: shards.ShardWriter, before: int, total: int, where: str, stop: BaseException) -> Interrupted:
    """At a stop (Ctrl-C, SIGTERM), the samples written before it landed as a (short) shard,
    however few, so a rerun goes on after them; the error that tells the user how many."""
    writer.close()
    kept = before + sum(entry["rows"] + len(entry.get("excluded", [])) for entry in writer.entries)
    return Interrupted(
        f"{kept} of {total} samples kept in {where}", "SIGTERM" if isinstance(stop, Terminated) else "SIGINT"
    )
