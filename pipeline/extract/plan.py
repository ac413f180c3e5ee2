"""Step 1 of an extract, pure: the prompts rendered and checked, layer ids, top-k and dtypes
resolved and checked, and the extract described to the manifest builder (pipeline/outdir/: what
the shards hold and their sizes, the settings identity a resume compares) before the first byte
is written."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.common.errors import UserError
from pipeline.common.layer_ids import build_target_layer_ids, check_layer_ids
from pipeline.common.sampling import Sampling
from pipeline.extract.config import ExtractConfig
from pipeline.extract.items import Item, label
from pipeline.outdir.builder import Source, settings_identity
from pipeline.outdir.storage import Storage, parse_feature_dtype, plan_storage
from proposers.layouts import read_drafter_format


def read_draft_config(path: str) -> tuple[Path, dict]:
    """(the config.json path, its JSON) of a --draft-config path (a file or its directory)."""
    config_path = Path(path)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"--draft-config {path}: no such file (pass a drafter config.json or its directory)")
    try:
        return config_path, json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(
            f"--draft-config {config_path}: not valid JSON ({error}); pass a drafter config.json"
        ) from error


def draft_layer_use(path: str, num_target_layers: int) -> dict:
    """What the drafter config at `path` asks extract to store: {by, family, layout, layer_ids}
    (the ids in this project's convention, pipeline/common/layer_ids.py)."""
    config_path, raw = read_draft_config(path)
    source = f"--draft-config {config_path}"
    checked = read_drafter_format(raw, source, complete=False)
    ids = checked.feature_layers(source, num_target_layers)
    return {"by": source, "family": checked.family, "layout": checked.LAYOUT, "layer_ids": list(ids)}


def draft_config_paths(config: ExtractConfig) -> list[str]:
    """--draft-config, given once or several times (one path in a library call)."""
    paths = config.draft_config
    return [] if paths is None else [paths] if isinstance(paths, str) else list(paths)


def layer_uses(config: ExtractConfig, num_target_layers: int) -> list[dict]:
    """Who asks for which feature layers: each --draft-config (several drafters, of any families,
    share one extract: a layer two of them read is stored once), else --layer-ids, else the
    DFlash formula. `inspect` shows it per stored layer."""
    if config.layer_ids is not None:
        return [{"by": "--layer-ids", "layer_ids": list(config.layer_ids)}]
    paths = draft_config_paths(config)
    if paths:
        return [draft_layer_use(path, num_target_layers) for path in paths]
    ids = build_target_layer_ids(num_target_layers, config.num_draft_layers)
    return [{"by": f"the default layer ids for {config.num_draft_layers} drafter layers", "layer_ids": ids}]


def resolve_layer_ids(config: ExtractConfig, num_target_layers: int, uses: list[dict]) -> list[int]:
    """The feature layers to store: every use's ids (layer_uses), each once, in the order first asked for."""
    for use in uses:
        if len(set(use["layer_ids"])) != len(use["layer_ids"]):
            fix = (
                "pass --layer-ids explicitly or fewer --num-draft-layers"
                if config.layer_ids is None and not draft_config_paths(config)
                else "list each layer once"
            )
            raise UserError(
                f"{use['by']}: duplicate layer ids {use['layer_ids']} (target has {num_target_layers} layers); {fix}"
            )
    ids = list(dict.fromkeys(i for use in uses for i in use["layer_ids"]))
    where = " and ".join(use["by"] for use in uses)
    if not ids and config.layer_ids != []:  # [] is --layer-ids none, asked for
        raise UserError(f"{where}: no layer ids; pass --layer-ids explicitly")
    check_layer_ids(ids, num_target_layers, where)
    return ids


def with_neighbours(ids: list[int], num_target_layers: int) -> list[int]:
    """`--neighbour-layers`: the requested ids in their order, then every i - 1 and i + 1 that
    is a decoder layer and not already there, ascending (drafters select their ids by value)."""
    extra = {j for i in ids for j in (i - 1, i + 1) if 0 <= j < num_target_layers} - set(ids)
    return list(ids) + sorted(extra)


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
    validate_engine_numbers(config)
    if config.limit is not None and config.limit < 1:
        raise UserError(f"--limit must be >= 1, got {config.limit}; leave it out to use every prompt")
    validate_sampling(config)
    validate_no_layers(config)


def validate_no_layers(config: ExtractConfig) -> None:
    """`--layer-ids none` (layer_ids []) stores no feature layers: an option about them would be
    silently ignored, so it is refused."""
    if config.layer_ids != []:
        return
    ignored = [
        name
        for name, used in (
            ("--draft-config", bool(draft_config_paths(config))),
            ("--neighbour-layers", config.neighbour_layers),
            ("--feature-dtype", config.feature_dtype is not None),
        )
        if used
    ]
    if ignored:
        names = " and ".join(ignored)
        raise UserError(
            f"--layer-ids none stores no feature layers, so {names} would be ignored; leave {names} out, "
            f"or drop --layer-ids none to store feature layers"
        )


def validate_engine_numbers(config: ExtractConfig) -> None:
    """--concurrency, --request-timeout and --retries (read only with --responses-from)."""
    if config.concurrency < 1:
        raise UserError(f"--concurrency must be >= 1, got {config.concurrency}")
    if not config.request_timeout > 0:
        raise UserError(f"--request-timeout must be > 0 seconds, got {config.request_timeout}")
    if config.retries < 0:
        raise UserError(f"--retries must be >= 0, got {config.retries}")


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


def known_settings(config: ExtractConfig, records) -> dict:
    """The manifest settings the command line alone decides (settings_identity's keys, nested the
    same way): what an existing OUT is checked against before the target loads."""
    from pipeline.extract.prompts import prompt_set_hash

    sampling = sampling_settings(config)
    known = {
        "max_new_tokens": int(config.max_new_tokens),
        "enable_thinking": config.enable_thinking,
        "decoding": "greedy" if sampling is None else "sampled",
        "prompts": {"hash": prompt_set_hash(records)},
    }
    return known | ({"sampling": sampling} if sampling is not None else {})


def prepare_items(records, tokenizer, enable_thinking) -> list[Item]:
    from pipeline.extract.prompts import render_prompt, render_response
    from pipeline.extract.turns import conversation_items

    items, seen = [], set()
    for record in records:
        if record.id in seen:
            raise UserError(f"prompt set: duplicate id {record.id!r}; every prompt needs a unique id")
        seen.add(record.id)
        if record.turns is not None:  # a conversation: one item per user turn
            items.extend(conversation_items(record, tokenizer, enable_thinking))
            continue
        prompt_ids, prompt_text = render_prompt(record, tokenizer, enable_thinking)
        if not prompt_ids:
            raise UserError(f"{label(record)} renders to zero tokens; give it some text or input_ids")
        given = render_response(record, tokenizer)
        if given is not None and len(given) == 0:
            raise UserError(
                f"{label(record)}: its given response is empty; give it some text or token ids, "
                f'or leave "response" out to generate one'
            )
        items.append(
            Item(
                record.id,
                record.dataset,
                [int(t) for t in prompt_ids],
                prompt_text,
                None if given is None else [int(t) for t in given],
                where=record.where,
            )
        )
    if not items:
        raise UserError("the prompt set is empty; give at least one prompt (or a larger --limit)")
    check_unique([item.sample_id for item in items], "a record's id is a conversation's turn id (<id>/turn-<r>)")
    return items


def check_unique(sample_ids: list[str], why: str) -> None:
    """Every sample id once: a record's own id can be another record's derived one."""
    clashes = [sample_id for sample_id, n in Counter(sample_ids).items() if n > 1]
    if clashes:
        raise UserError(f"sample id {clashes[0]!r} occurs twice: {why}; rename that record")


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
    check_unique(
        [item.sample_id for item in out],
        "a record with a given response has the id of another prompt's draw (<id>#<k>)",
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


@dataclass
class Plan:
    """Everything a run decides before it touches OUT; a function of the config, the target and
    the prompts only (with --responses-from, also of the engine: run.py's with_engine)."""

    items: list[Item]  # the prompts, rendered, in extraction order
    storage: Storage  # what the shards hold, and the lm_head window and shard chunk sizes
    source: Source  # what this extract tells the manifest builder about itself
    sampling: Sampling | None = None  # the responses' distribution; None: greedy

    @property
    def settings(self) -> dict:
        """The identity compared on resume (pipeline/outdir/builder.py)."""
        return settings_identity(self.source, self.storage)


def check_token_ids(items: list[Item], vocab_size: int) -> None:
    """Every prompt and given-response token id is a row of the target's embedding: an id past it
    (a prompt set tokenized for another model) would fail deep inside the forward."""
    for item in items:
        for part, ids in (("prompt", item.prompt_ids), ("response", item.given or [])):
            if not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # the common case, without a Python loop
                continue
            position, token = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
            raise UserError(
                f"{item.label}: {part} token id {token} at position {position} is outside the target's "
                f"vocabulary (0..{vocab_size - 1}); were these ids made by another model's tokenizer?"
            )


def check_positions(items: list[Item], max_new_tokens: int, max_positions: int | None, allowed: bool) -> None:
    """Prompt plus response within the target's trained positions (max_position_embeddings),
    unless `--beyond-positions`: past them its features are not what a drafter trains on."""
    if max_positions is None or allowed:
        return
    for item in items:
        response = len(item.given) if item.given is not None else max_new_tokens
        # a later turn's prompt is built in the run: at most its frame and every earlier answer
        prompt = len(item.prompt_ids) or item.frame_len + ((item.turn or 1) - 1) * max_new_tokens
        if prompt + response > max_positions:
            raise UserError(
                f"{item.label}: {prompt} prompt tokens + {response} response tokens "
                f"exceed the target's max_position_embeddings ({max_positions}); shorten it, lower "
                f"--max-new-tokens, or pass --beyond-positions to extract it anyway"
            )


def plan_extract(
    config: ExtractConfig, records, tokenizer, info, fingerprint: str, max_positions: int | None = None
) -> Plan:
    """Check the inputs against the target and decide every size and dtype; raises UserError."""
    from pipeline.extract.prompts import prompt_set_hash

    items = prepare_items(records, tokenizer, config.enable_thinking)
    check_token_ids(items, info.vocab_size)
    check_positions(items, config.max_new_tokens, max_positions, config.beyond_positions)
    uses = layer_uses(config, info.num_layers)
    requested = resolve_layer_ids(config, info.num_layers, uses)
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
    storage = plan_storage(
        layer_ids, feature_dtype, config.top_k, info.hidden_size, config.memory_bytes, sampled=sampling is not None
    )
    source = Source(
        target=info,
        fingerprint_key="weights_fingerprint",
        fingerprint=fingerprint,
        prompts=prompts,
        max_new_tokens=config.max_new_tokens,
        enable_thinking=config.enable_thinking,
        sampling=sampling_settings(config),
        layer_uses=uses,
        requested_layer_ids=requested if config.neighbour_layers else None,
        beyond_positions=bool(config.beyond_positions),
    )
    return Plan(items=items, storage=storage, source=source, sampling=sampling)
