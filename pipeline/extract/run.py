"""`specreplay extract`: run the target once over a prompt set and write shards + manifest.

A run is four steps (`run_extract`); every check happens before the first byte is written:
  1. plan (`plan_extract`, pure): render and check the prompts, resolve and check layer ids,
     top-k and dtypes, size the lm_head window and the shard chunk, build the settings identity.
     Then every rank checks OUT (`check_out_dir`, read-only): a manifest with other settings is
     refused (the message lists each differing setting) unless `overwrite`;
  2. rank 0 prepares OUT (`prepare_out_dir`): delete the old outputs on `overwrite`, remove
     temporary files of an interrupted run, store the target head and the tokenizer
     (OUT/tokenizer/, save_pretrained) once, write manifest.json with complete=false;
  3. every rank writes its share (`write_rank_share`): skip samples already in finished shards
     (by id), take pending[rank::world], generate (batched, greedy or sampled) + capture (one
     forward per sample), write its own shards;
  4. rank 0 finishes the manifest (`finish_manifest`): every finished shard entry (sorted by file
     name), complete=true, totals.

Resume is exact because a sample is either in a finished shard (never touched again) or redone
from scratch: shards land atomically (see pipeline/shards.py) and settings cannot change
between runs without `--overwrite`.

A sample whose features or logits hold NaN/Inf (fp16 overflow, usually) is never written: the
entry of the next shard to land lists it under `excluded` (sample id, dataset, what, first bad
position, how many), so resume counts it as done, and the manifest's totals carry
`excluded_samples` and `excluded` (keys absent when nothing was excluded). `inspect` and
`score` report them.

Sampling (temperature > 0): each prompt without a given response becomes `num_samples` items
with ids `<id>#<k>`, k = 0..K-1 (every sampled id carries its draw, also when K = 1); a record
with a given response stays one item under its own id. A draw's generator is seeded from (seed,
prompt id, k) only (pipeline/extract/generate.py), so which batch, rank or run redoes it changes nothing.
The shards then also hold sample_logprob (pipeline/extract/capture.py); greedy shards and manifests are
exactly what they were before sampling existed.

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

import contextlib
import hashlib
import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pipeline import shards
from pipeline.common import timing
from pipeline.common.distributed import Dist, barrier, dist_from_env, init_dist, resolve_device
from pipeline.common.dtypes import COMPUTE_DTYPES
from pipeline.common.errors import UserError
from pipeline.common.layer_ids import build_target_layer_ids, check_layer_ids, drafter_layer_ids
from pipeline.common.sampling import Sampling
from pipeline.common.settings import settings_diff
from pipeline.common.versions import specreplay_version
from pipeline.extract.config import ExtractConfig
from pipeline.shards.writer import excluded_records

# Feature storage dtypes beyond the compute dtypes: e4m3 with one scale per token and layer (lossy).
FP8_NAMES = ("float8_e4m3fn", "fp8")


@dataclass
class Item:
    """One prompt ready to run: rendered prompt ids and, when given, the response to teacher-force."""

    sample_id: str
    dataset: str
    prompt_ids: list[int]
    prompt_text: str
    given: list[int] | None = None
    draw: int | None = None  # sampled: which draw of its prompt (sample id `<prompt_id>#<draw>`)
    prompt_id: str | None = None  # sampled: the prompt record's id, what the draw's seed is made of


# ---------------------------------------------------------------------------------------------
# inputs: checked and rendered (pure, read-only)


def draft_layer_ids(path: str, num_target_layers: int) -> list[int]:
    """Feature layers the drafter config at `path` asks for (pipeline/common/layer_ids.py)."""
    config_path = Path(path)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"--draft-config {path}: no such file (pass a drafter config.json or its directory)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(
            f"--draft-config {config_path}: not valid JSON ({error}); pass a drafter config.json"
        ) from error
    return drafter_layer_ids(config, f"--draft-config {config_path}", num_target_layers)


def resolve_layer_ids(config: ExtractConfig, num_target_layers: int) -> list[int]:
    if config.layer_ids is not None:
        ids, where = list(config.layer_ids), "--layer-ids"
    elif config.draft_config is not None:
        ids, where = draft_layer_ids(config.draft_config, num_target_layers), f"--draft-config {config.draft_config}"
    else:
        ids = build_target_layer_ids(num_target_layers, config.num_draft_layers)
        where = f"the default layer ids for {config.num_draft_layers} drafter layers"
    if not ids:
        raise UserError(f"{where}: no layer ids; pass --layer-ids explicitly")
    if len(set(ids)) != len(ids):
        fix = (
            "pass --layer-ids explicitly or fewer --num-draft-layers"
            if config.layer_ids is None and config.draft_config is None
            else "list each layer once"
        )
        raise UserError(f"{where}: duplicate layer ids {ids} (target has {num_target_layers} layers); {fix}")
    check_layer_ids(ids, num_target_layers, where)
    return ids


def with_neighbours(ids: list[int], num_target_layers: int) -> list[int]:
    """`--neighbour-layers`: the requested ids in their order, then every i - 1 and i + 1 that
    is a decoder layer and not already there, ascending (drafters select their ids by value)."""
    extra = {j for i in ids for j in (i - 1, i + 1) if 0 <= j < num_target_layers} - set(ids)
    return list(ids) + sorted(extra)


def parse_feature_dtype(name: str | None, model_dtype: str) -> str:
    """Storage dtype name of the features: the model dtype (lossless) unless `--feature-dtype`."""
    if name is None:
        return model_dtype
    key = str(name).lower().removeprefix("torch.")
    if key in FP8_NAMES:
        return "float8_e4m3fn"
    if key not in COMPUTE_DTYPES:
        raise UserError(
            f"--feature-dtype {name!r} is not supported; use one of {', '.join([*COMPUTE_DTYPES, *FP8_NAMES])}"
        )
    return shards.DTYPE_NAMES[COMPUTE_DTYPES[key]]


def validate_numbers(config: ExtractConfig) -> None:
    checks = [
        ("--max-new-tokens", config.max_new_tokens),
        ("--top-k", config.top_k),
        ("--batch-size", config.batch_size),
        ("--shard-bytes", config.shard_bytes),
        ("--num-draft-layers", config.num_draft_layers),
        ("--memory-budget", config.memory_bytes),
    ]
    for name, value in checks:
        if value < 1:
            raise UserError(f"{name} must be >= 1, got {value}")
    if config.limit is not None and config.limit < 1:
        raise UserError(f"--limit must be >= 1, got {config.limit}; leave it out to use every prompt")
    validate_sampling(config)


def validate_sampling(config: ExtractConfig) -> None:
    """The sampling options, checked as the reference's `_validate_sampling` does, and refused
    when they would be silently ignored (a filter or several draws with greedy decoding)."""
    if config.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0 = greedy decoding), got {config.temperature}")
    if not 0 < config.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1] (1 = no top-p filter), got {config.top_p}")
    if config.sample_top_k < 0:
        raise UserError(f"--sample-top-k must be >= 0 (0 = no top-k filter), got {config.sample_top_k}")
    if config.num_samples < 1:
        raise UserError(f"--num-samples must be >= 1, got {config.num_samples}")
    if config.temperature == 0:
        ignored = [
            name
            for name, used in (
                (f"--num-samples {config.num_samples}", config.num_samples > 1),
                (f"--top-p {config.top_p:g}", config.top_p < 1),
                (f"--sample-top-k {config.sample_top_k}", config.sample_top_k > 0),
            )
            if used
        ]
        if ignored:
            raise UserError(
                f"{', '.join(ignored)} need sampling: pass --temperature > 0 (e.g. 0.6); "
                f"temperature 0, the default, is greedy decoding"
            )


def sampling_of_config(config: ExtractConfig) -> Sampling | None:
    """The distribution responses are drawn from; None for greedy decoding."""
    if config.temperature <= 0:
        return None
    return Sampling(float(config.temperature), float(config.top_p), int(config.sample_top_k)).check()


def sampling_settings(config: ExtractConfig) -> dict | None:
    """manifest settings["sampling"] (None for greedy: a greedy manifest has no such key)."""
    sampling = sampling_of_config(config)
    if sampling is None:
        return None
    return {**sampling.as_dict(), "seed": int(config.seed), "num_samples": int(config.num_samples)}


def prepare_items(records, tokenizer, enable_thinking) -> list[Item]:
    from pipeline.extract.prompts import render_prompt, render_response

    items, seen = [], set()
    for record in records:
        if record.id in seen:
            raise UserError(f"prompt set: duplicate id {record.id!r}; every prompt needs a unique id")
        seen.add(record.id)
        prompt_ids, prompt_text = render_prompt(record, tokenizer, enable_thinking)
        if not prompt_ids:
            raise UserError(f"prompt {record.id!r} renders to zero tokens; give it some text or input_ids")
        given = render_response(record, tokenizer)
        if given is not None and len(given) == 0:
            raise UserError(
                f"prompt {record.id!r}: its given response is empty; give it some text or token ids, "
                f'or leave "response" out to generate one'
            )
        items.append(
            Item(
                record.id,
                record.dataset,
                [int(t) for t in prompt_ids],
                prompt_text,
                None if given is None else [int(t) for t in given],
            )
        )
    if not items:
        raise UserError("the prompt set is empty; give at least one prompt (or a larger --limit)")
    return items


def sampled_items(items: list[Item], num_samples: int) -> list[Item]:
    """Each prompt to generate as `num_samples` draws `<id>#<k>`, adjacent (a batch then runs a
    prompt's draws together); a prompt with a given response stays one item, id unchanged."""
    out = []
    for item in items:
        if item.given is not None:
            out.append(item)
            continue
        for draw in range(num_samples):
            out.append(replace(item, sample_id=f"{item.sample_id}#{draw}", draw=draw, prompt_id=item.sample_id))
    clashes = [sample_id for sample_id, n in Counter(item.sample_id for item in out).items() if n > 1]
    if clashes:
        clash = clashes[0]
        raise UserError(
            f"sample id {clash!r} occurs twice: a record with a given response has the id of another "
            f"prompt's draw (<id>#<k>); rename that record"
        )
    return out


def rendered_hash(items: list[Item]) -> str:
    """sha256 of exactly what the target sees (ids, prompt tokens, given responses)."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(json.dumps([item.sample_id, item.prompt_ids, item.given]).encode())
    return digest.hexdigest()


def weights_fingerprint(model, per_tensor: int = 4096) -> str:
    """sha256 of a strided sample of every parameter: cheap even at 27B, and tells two targets
    with the same config.json apart (a fine-tune), which config_hash cannot."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        if param.device.type == "meta":
            continue
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // per_tensor)
        sample = flat[::step][:per_tensor].float().cpu().contiguous()
        digest.update(name.encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# settings identity and sizes (pure)


TARGET_IDENTITY = (
    "architecture",
    "num_layers",
    "hidden_size",
    "vocab_size",
    "config_hash",
    "dtype",
    "stop_token_ids",
    "pad_token_id",
    "bos_token_id",
    "chat_template_hash",
)


def settings_identity(
    config: ExtractConfig,
    info,
    fingerprint: str,
    layer_ids: list[int],
    feature_dtype: str,
    prompts: dict,
    requested: list[int] | None = None,
) -> dict:
    """What must not change between a run and its resume (compared key by key on resume)."""
    target = {key: getattr(info, key) for key in TARGET_IDENTITY}
    target["weights_fingerprint"] = fingerprint
    identity = {
        "format_version": shards.FORMAT_VERSION,
        "target": target,
        "layer_ids": list(layer_ids),
        "feature_dtype": feature_dtype,
        "top_k": config.top_k,
        "max_new_tokens": int(config.max_new_tokens),
        "enable_thinking": config.enable_thinking,
        "decoding": "greedy",
        "prompts": {key: prompts[key] for key in ("hash", "count", "rendered_hash")},
    }
    sampling = sampling_settings(config)
    if sampling is not None:  # absent for greedy, so a greedy identity is what it always was
        identity.update(decoding="sampled", sampling=sampling)
    if config.neighbour_layers:  # likewise absent unless asked for; the drafter's own ids
        identity["neighbour_layers"] = {"requested": list(requested or layer_ids)}
    return identity


def tensor_dtypes(feature_dtype: str, sampled: bool = False) -> dict[str, str]:
    """{tensor name: dtype name} of what the shards store (see pipeline/extract/capture.py)."""
    dtypes = {"features": feature_dtype, "topk_ids": "int32", "topk_logprobs": "float32", "argmax_mismatch": "uint8"}
    if feature_dtype == "float8_e4m3fn":
        dtypes["features_scale"] = "float32"
    if sampled:
        dtypes["sample_logprob"] = "float32"
    return dtypes


def stored_bytes_per_token(dtypes: dict[str, str], n_layers: int, hidden: int, top_k: int) -> int:
    """Raw bytes the shards hold per token (features, scales, top-k, flags)."""
    width = {
        "features": n_layers * hidden,
        "features_scale": n_layers,
        "topk_ids": top_k,
        "topk_logprobs": top_k,
        "argmax_mismatch": 1,
        "sample_logprob": 1,
    }
    return sum(width[name] * shards.TENSOR_DTYPES[dtype].itemsize for name, dtype in dtypes.items())


def split_memory_budget(budget_bytes: int, bytes_per_token: int) -> tuple[int, int]:
    """(lm_head window bytes, tokens per shard chunk): half the budget each. The model's weights
    and one sample's own activations and stored tensors come on top (they scale with the model
    and the sample, not with anything extract chooses)."""
    return budget_bytes // 2, shards.chunk_tokens_for(budget_bytes // 2, bytes_per_token)


# ---------------------------------------------------------------------------------------------
# OUT as it is: resumable, refused, or deleted with --overwrite


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


def delete_outputs(out: str) -> None:
    """Remove what extract writes in OUT (manifest, target head, shards/, tokenizer/); nothing else."""
    fs, root = shards.open_fs(out)
    for name in (shards.MANIFEST_NAME, shards.TARGET_HEAD_NAME):
        path = shards.join(root, name)
        if shards.exists(fs, path):
            fs.delete_file(path)
    for name in (shards.SHARD_DIR, shards.TOKENIZER_DIR):
        path = shards.join(root, name)
        if shards.exists(fs, path):
            fs.delete_dir(path)


# ---------------------------------------------------------------------------------------------
# finished shard entries


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
    excluded = excluded_records(entries)
    if excluded:  # samples with NaN/Inf, never written; keys absent when there are none
        out["excluded_samples"] = len(excluded)
        out["excluded"] = excluded
    return out


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


# ---------------------------------------------------------------------------------------------
# step 1: the plan (pure)


@dataclass
class Plan:
    """Everything a run decides before it touches OUT; a function of the config, the target and
    the prompts only."""

    items: list[Item]  # the prompts, rendered, in extraction order
    layer_ids: list[int]
    feature_dtype: str  # storage dtype name of the features
    tensors: dict[str, str]  # {tensor name: dtype name} as stored in the shards
    head_window_bytes: int  # memory for one lm_head window over the vocabulary
    chunk_tokens: int  # tokens per shard chunk (record batch)
    raw_bytes_per_token: int  # the features as raw bf16, what `totals` compares the shards against
    prompts: dict  # {name, hash, count, rendered_hash}
    settings: dict  # the identity compared on resume (see settings_identity)
    sampling: Sampling | None = None  # the responses' distribution; None: greedy


def plan_extract(config: ExtractConfig, records, tokenizer, info, fingerprint: str) -> Plan:
    """Check the inputs against the target and decide every size and dtype; raises UserError."""
    from pipeline.extract.prompts import prompt_set_hash

    items = prepare_items(records, tokenizer, config.enable_thinking)
    requested = resolve_layer_ids(config, info.num_layers)
    layer_ids = with_neighbours(requested, info.num_layers) if config.neighbour_layers else requested
    if config.top_k > info.vocab_size:
        raise UserError(
            f"--top-k {config.top_k} exceeds the target's vocabulary ({info.vocab_size}); pass a smaller --top-k"
        )
    feature_dtype = parse_feature_dtype(config.feature_dtype, info.dtype)
    prompts = {
        "name": str(config.prompts),
        "hash": prompt_set_hash(records),
        "count": len(items),
        "rendered_hash": rendered_hash(items),
    }
    sampling = sampling_of_config(config)
    if sampling is not None:  # after the prompt facts: they describe the prompts, not the draws
        items = sampled_items(items, config.num_samples)
    tensors = tensor_dtypes(feature_dtype, sampled=sampling is not None)
    head_bytes, chunk_tokens = split_memory_budget(
        config.memory_bytes, stored_bytes_per_token(tensors, len(layer_ids), info.hidden_size, config.top_k)
    )
    return Plan(
        items=items,
        layer_ids=layer_ids,
        feature_dtype=feature_dtype,
        tensors=tensors,
        head_window_bytes=head_bytes,
        chunk_tokens=chunk_tokens,
        raw_bytes_per_token=len(layer_ids) * info.hidden_size * 2,
        prompts=prompts,
        settings=settings_identity(config, info, fingerprint, layer_ids, feature_dtype, prompts, requested),
        sampling=sampling,
    )


def new_manifest(plan: Plan, info, run: dict) -> dict:
    """The manifest of a run before any shard is merged into it (complete=false)."""
    return {
        "format_version": shards.FORMAT_VERSION,
        "complete": False,
        "settings": plan.settings,
        "target": {**info.to_json(), "weights_fingerprint": plan.settings["target"]["weights_fingerprint"]},
        "tensors": plan.tensors,
        "prompts": plan.prompts,
        "run": {**run, "chunk_tokens": plan.chunk_tokens, "head_window_bytes": plan.head_window_bytes},
    }


def run_facts(config: ExtractConfig, dist: Dist, device: str) -> dict:
    """Informational facts of this run (versions, world size, device, sizes); not compared on resume."""
    import transformers

    return {
        "specreplay": specreplay_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "world_size": dist.world,
        "device": device,
        "batch_size": config.batch_size,
        "shard_bytes": config.shard_bytes,
        "zstd_level": config.zstd_level,
        "memory_bytes": config.memory_bytes,
    }


# ---------------------------------------------------------------------------------------------
# step 2: rank 0 prepares OUT


def prepare_out_dir(config: ExtractConfig, model, tokenizer, plan: Plan, manifest: dict) -> None:
    """After check_out_dir accepted OUT: delete old outputs (--overwrite), remove what an interrupted
    run left unfinished, store the target head and tokenizer once, write the manifest with
    complete=false."""
    if config.overwrite:
        delete_outputs(config.out)
    shards.remove_unfinished(config.out)
    with timing.stage("store target head"):
        manifest["target_head"] = stored_target_head(config.out, model)
    if tokenizer is not None:
        manifest["tokenizer"] = stored_tokenizer(config.out, tokenizer)
    entries = shards.finished_shard_entries(config.out)
    manifest.update(shards=entries, totals=totals(entries, plan.raw_bytes_per_token))
    shards.write_manifest(config.out, manifest)


def stored_target_head(out: str, model) -> dict:
    """Store the embedding and lm_head once; a resumed run keeps the file the first run wrote."""
    from pipeline.extract.target import input_embedding_weight, output_head_weight

    fs, root = shards.open_fs(out)
    fs.create_dir(root, recursive=True)
    path = shards.join(root, shards.TARGET_HEAD_NAME)
    if shards.exists(fs, path):
        previous = previous_entry(out, "target_head")
        if previous:
            return previous
    return shards.save_target_head(out, input_embedding_weight(model), output_head_weight(model))


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


# ---------------------------------------------------------------------------------------------
# step 3: every rank writes its share


class SilentProgress:
    """The progress bar of a run nobody watches (the library never prints)."""

    def update(self, n: int = 1, **postfix) -> None:
        pass

    def close(self) -> None:
        pass


def write_rank_share(model, info, plan: Plan, config: ExtractConfig, dist: Dist, progress=None) -> None:
    """This rank's samples (pending ones, every world-th from its rank) into its own shards."""
    from pipeline.extract.capture import CaptureConfig

    entries = shards.finished_shard_entries(config.out)
    done = check_entries(entries, {item.sample_id for item in plan.items})
    pending = [item for item in plan.items if item.sample_id not in done]
    mine = pending[dist.rank :: dist.world]
    capture_config = CaptureConfig(
        layer_ids=plan.layer_ids,
        feature_dtype=shards.TENSOR_DTYPES[plan.feature_dtype],
        top_k=config.top_k,
        head_budget_bytes=plan.head_window_bytes,
        sampling=plan.sampling,
    )
    writer = shards.ShardWriter(
        config.out,
        dist.rank,
        plan.tensors,
        shard_bytes=config.shard_bytes,
        zstd_level=config.zstd_level,
        first_index=next_shard_index(entries, dist.rank),
        chunk_tokens=plan.chunk_tokens,
    )
    budget = token_budget(mine, config.max_new_tokens)
    bar = progress(budget, "extract", unit="tok") if progress is not None else SilentProgress()
    try:
        run_items(
            model,
            info,
            mine,
            writer,
            capture_config,
            config.max_new_tokens,
            config.batch_size,
            bar,
            sampling=plan.sampling,
            seed=config.seed,
        )
        writer.close()
    finally:
        bar.close()


def batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def token_budget(items: list[Item], max_new_tokens: int) -> int:
    """The progress bar's total in tokens: every generated sample's full budget (an upper bound;
    TokenProgress tops it up when a response stops early) plus every given response's length."""
    return sum(max_new_tokens if item.given is None else len(item.given) for item in items)


class TokenProgress:
    """Counts decoded tokens into a bar as they are generated (a batch of long responses takes
    minutes: counting finished prompts left the bar at 0 until the first batch was done), with
    the samples written so far as its postfix."""

    def __init__(self, bar, samples: int):
        self.bar, self.samples, self.done = bar, samples, 0

    def tokens(self, n: int) -> None:
        self.bar.update(n, samples=f"{self.done}/{self.samples}")

    def written(self, item: Item) -> None:
        """One sample stored; a teacher-forced one counts its response now, its forward is done."""
        self.done += 1
        self.bar.update(0 if item.given is None else len(item.given), samples=f"{self.done}/{self.samples}")


def run_items(
    model,
    info,
    items: list[Item],
    writer: shards.ShardWriter,
    capture_config,
    max_new_tokens: int,
    batch_size: int,
    progress,
    sampling: Sampling | None = None,
    seed: int = 0,
) -> None:
    """Generate in batches, then one capture forward per sample, written in item order; `progress`
    (a tqdm-like bar of token_budget(items) tokens) advances every decode step. Responses are
    drawn from `sampling` when it is set (None: greedy), each draw seeded from `seed` (draw_seed)."""
    from pipeline.extract.generate import draw_seed, generate_responses

    counter = TokenProgress(progress, len(items))
    for batch in batches(items, batch_size):
        responses = generate_responses(
            model,
            [i.prompt_ids for i in batch],
            [i.given for i in batch],
            max_new_tokens,
            info.stop_token_ids,
            info.pad_token_id,
            on_tokens=counter.tokens,
            sampling=sampling,
            seeds=[None if i.draw is None else draw_seed(seed, i.prompt_id, i.draw) for i in batch],
        )
        for item, response in zip(batch, responses):
            capture_and_write(model, item, response, capture_config, writer)
            counter.written(item)


def capture_and_write(model, item: Item, response, capture_config, writer: shards.ShardWriter) -> None:
    """One capture forward over prompt + response, written as one sample; a sample with NaN/Inf
    in a feature layer or its logits is never written, only recorded as excluded (where first)."""
    from pipeline.extract.capture import capture_sample, nonfinite_values

    input_ids = item.prompt_ids + response.token_ids
    tensors = capture_sample(model, input_ids, len(item.prompt_ids), capture_config)
    bad = nonfinite_values(tensors, getattr(capture_config, "layer_ids", None), len(item.prompt_ids))
    if bad is not None:
        writer.exclude({"sample_id": item.sample_id, "dataset": item.dataset, **bad})
        return
    writer.write(
        shards.Sample(
            sample_id=item.sample_id,
            dataset=item.dataset,
            prompt_text=item.prompt_text,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            prompt_len=len(item.prompt_ids),
            finish_reason=response.finish_reason,
            greedy=response.greedy,
            tensors=tensors,
        )
    )
    # The writer owns the tensors now; returning drops our reference, so the next forward
    # does not keep them alive.


# ---------------------------------------------------------------------------------------------
# step 4: rank 0 finishes the manifest


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


# ---------------------------------------------------------------------------------------------
# the run


def run_extract(config: ExtractConfig, progress=None, loaded=None) -> dict:
    """Run (or resume) an extract; returns the final manifest. See the module docstring.

    `progress`: called once per rank as progress(total, desc, unit="tok") with the tokens this
    rank will generate or teacher-force (token_budget); returns a bar (specreplay/progress.py:
    update(n, **postfix), close), advanced every decode step. None: nothing is shown.
    `loaded`: the (model, tokenizer, info) that pipeline.extract.target.load_target returned, to reuse
    instead of loading config.model again.
    """
    from pipeline.extract.prompts import load_prompts

    dist = dist_from_env()
    validate_numbers(config)
    records = load_prompts(config.prompts, limit=config.limit)  # parse errors surface before any load
    init_dist(dist)
    lock = output_lock(config.out) if dist.main else None  # ranks of one job share rank 0's lock
    try:
        with lock or contextlib.nullcontext():
            return _run(config, dist, records, progress, loaded)
    finally:
        if dist.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


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


def load_model_once(config: ExtractConfig, dist: Dist, device: str):
    """Rank 0 loads first: the first load of a GGUF target converts it into a shared cache dir."""
    from pipeline.extract.target import load_target

    if not dist.main:
        barrier(dist)
    with timing.stage("load target"):
        loaded = load_target(config.model, dtype=config.dtype, device=device)
    if dist.main:
        barrier(dist)
    return loaded


def _run(config: ExtractConfig, dist: Dist, records, progress, loaded) -> dict:
    device = resolve_device(config.device, dist)
    model, tokenizer, info = loaded if loaded is not None else load_model_once(config, dist, device)
    with timing.stage("weights fingerprint"):
        fingerprint = weights_fingerprint(model)
    # Planning and check_out_dir only read: a bad input leaves OUT untouched.
    plan = plan_extract(config, records, tokenizer, info, fingerprint)
    existing = check_out_dir(config.out, plan.settings, config.overwrite)  # every rank, so all refuse together
    if existing is not None and existing.get("complete") and not missing_shards(config.out, existing):
        return existing  # already done with these settings: touch nothing

    manifest = new_manifest(plan, info, run_facts(config, dist, device))
    if dist.main:
        prepare_out_dir(config, model, tokenizer, plan, manifest)
    barrier(dist)
    write_rank_share(model, info, plan, config, dist, progress)
    barrier(dist)
    if dist.main:
        finish_manifest(config.out, manifest, plan.items, plan.raw_bytes_per_token)
    barrier(dist)
    return manifest if dist.main else shards.read_manifest(config.out)
