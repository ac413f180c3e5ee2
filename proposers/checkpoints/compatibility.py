"""Whether a drafter fits the extracted shards: every mismatch an error naming both sides,
checked from the configs alone, before any weight is read."""

from __future__ import annotations

from pipeline.common.errors import UserError
from proposers.toolkit.config import DrafterConfig


class CompatibilityError(UserError):
    """A drafter that does not fit the target whose features the shards hold."""


def _manifest_target(manifest: dict) -> tuple[list[int], dict, str]:
    """(stored feature layer ids, target facts, a name for messages) from an extract manifest.

    pipeline/extract/run.py writes `settings.layer_ids`, the target's identity (num_layers,
    hidden_size, vocab_size = embedding rows, ...) at `settings.target`, and the full TargetInfo
    (with `name` and `path`) at the top-level `target`.
    """
    settings = manifest.get("settings") or {}
    layer_ids = settings.get("layer_ids")
    target = {**(manifest.get("target") or {}), **(settings.get("target") or {})}
    if layer_ids is None or not target:
        raise CompatibilityError(
            "manifest has no settings.layer_ids / settings.target; it was not written by this specreplay's "
            "extract (re-run extract)"
        )
    for name in ("num_layers", "hidden_size", "vocab_size"):
        if name not in target:
            raise CompatibilityError(f"manifest settings.target lacks {name!r}; re-run extract")
    label = target.get("name") or target.get("path") or target.get("architecture") or "the extracted target"
    return [int(i) for i in layer_ids], target, str(label)


def target_layers(manifest: dict) -> int | None:
    """The target's decoder layer count an extract records (None when it records none)."""
    num = ((manifest.get("settings") or {}).get("target") or {}).get("num_layers")
    return None if num is None else int(num)


def extract_words(manifest: dict, layer_ids: list[int], out: str) -> str:
    """The `extract` flags that re-run the extract that wrote `manifest` with its own settings,
    storing `layer_ids` into `out` (one line a user can paste)."""
    settings = manifest.get("settings") or {}
    target, prompts = manifest.get("target") or {}, manifest.get("prompts") or {}
    sampling = settings.get("sampling") or {}
    flags = {
        "--model": target.get("path") or target.get("name"),
        "--prompts": prompts.get("name"),
        "--layer-ids": ",".join(map(str, layer_ids)),
        "--max-new-tokens": settings.get("max_new_tokens"),
        "--top-k": settings.get("top_k"),
        "--dtype": target.get("dtype"),
        "--feature-dtype": settings.get("feature_dtype"),
        "--temperature": sampling.get("temperature"),
        "--top-p": sampling.get("top_p"),
        "--sample-top-k": sampling.get("top_k"),
        "--num-samples": sampling.get("num_samples"),
        "--seed": sampling.get("seed"),
        "--out": out,
    }
    words = " ".join(f"{flag} {value}" for flag, value in flags.items() if value is not None)
    thinking = settings.get("enable_thinking")
    if thinking is not None:
        words += " --enable-thinking" if thinking else " --disable-thinking"
    return words


def check_compatibility(config: DrafterConfig, manifest: dict, ckpt_path: str, shards: str | None = None) -> None:
    """Every drafter/target mismatch as an error naming both sides, before any weight is read.

    The drafter has no embedding or head of its own: block inputs are the target's embeddings
    and `fc` maps the concatenated target features (n * target hidden) to its hidden size, so
    its hidden size must equal the target's and the mask token must be a row of the target's
    embedding. The drafter's `vocab_size` field is otherwise unused by the reference, but a
    different value means it was trained for another tokenizer.
    """
    stored, target, label = _manifest_target(manifest)
    where = f"drafter {ckpt_path} vs shards of {label}"
    _check_block_and_target(config, target, where)
    _check_final_layer(config, int(target["num_layers"]), where)
    _check_layers(config, stored, where, _rerun(manifest, shards))
    _check_final_norm(config, manifest, stored, where, _rerun(manifest, shards))
    _check_widths(config, target, where, gguf=ckpt_path.lower().endswith(".gguf"))


def _check_block_and_target(config: DrafterConfig, target: dict, where: str) -> None:
    if config.max_drafts < 1:
        raise CompatibilityError(
            f"{where}: block_size {config.block_size} drafts nothing (a block is [last token, B-1 masks]); "
            f"block_size must be >= 2"
        )
    if config.num_target_layers is not None and config.num_target_layers != int(target["num_layers"]):
        raise CompatibilityError(
            f"{where}: drafter num_target_layers {config.num_target_layers} != target num_layers "
            f"{target['num_layers']}; the drafter was trained for a different target model"
        )


def _check_final_layer(config: DrafterConfig, num_layers: int, where: str) -> None:
    """A before-layer id equal to the target's layer count (speculators') names the residual after
    the last layer BEFORE the final norm, stored as id L, never the post-norm id L - 1
    (docs/layer-numbering.md): the config must have been read knowing the target's layer count."""
    stated = config.stated_layer_ids or []
    if config.layer_convention == "before" and num_layers in stated and num_layers not in config.target_layer_ids:
        raise CompatibilityError(
            f"{where}: internal: the drafter's before-layer ids {stated} were read without the target's layer "
            f"count, so id {num_layers} (the final hidden state before the norm) would be read as the layer after it"
        )


def _rerun(manifest: dict, shards: str | None):
    """layer ids -> the extract command storing them beside the shards' (None: the shards are unnamed)."""
    if shards is None:
        return None
    return lambda ids: f"specreplay extract {extract_words(manifest, ids, shards.rstrip('/') + '-layers')}"


def _check_layers(config: DrafterConfig, stored: list[int], where: str, rerun=None) -> None:
    missing = [i for i in config.target_layer_ids if i not in stored]
    if missing:
        union = sorted(set(stored) | set(config.target_layer_ids))
        stated = ""
        if config.layer_convention == "before":
            stated = f" (its config states {config.stated_layer_ids}, counted before layer i: ours are one lower)"
        command = "" if rerun is None else f": `{rerun(union)}`"
        raise CompatibilityError(
            f"{where}: drafter target_layer_ids {config.target_layer_ids}{stated} but the shards store layer ids "
            f"{stored} (missing {missing}); re-run extract with --layer-ids {','.join(map(str, union))} (or "
            f"--draft-config with the drafter's config.json){command}"
        )


def _check_final_norm(config: DrafterConfig, manifest: dict, stored: list[int], where: str, rerun=None) -> None:
    """An MTP head reads the target's final hidden state after its final norm (vLLM), made from the
    stored pre-norm one (id L) with the norm's weight, which the target head holds only when the
    extract stored id L (target_head.py); shards written before that hold none."""
    if not config.reads_final_norm or (manifest.get("target_head") or {}).get("final_norm"):
        return
    command = "" if rerun is None else f": `{rerun(sorted(stored))}`"
    raise CompatibilityError(
        f"{where}: an MTP head reads the target's final hidden state after its final norm, and these shards "
        f"hold no final norm weight in their target head; re-run extract (which stores it with layer id "
        f"{config.target_layer_ids[0]}){command}"
    )


def _check_widths(config: DrafterConfig, target: dict, where: str, gguf: bool = False) -> None:
    hidden, vocab = int(target["hidden_size"]), int(target["vocab_size"])
    if config.hidden_size != hidden:
        raise CompatibilityError(
            f"{where}: drafter hidden_size {config.hidden_size} (fc expects {len(config.target_layer_ids)} x "
            f"{config.hidden_size} feature columns) != target hidden_size {hidden}; the drafter was trained for a "
            f"different target model"
        )
    if config.mask_token_id is not None and not 0 <= config.mask_token_id < vocab:
        raise CompatibilityError(
            f"{where}: drafter mask_token_id {config.mask_token_id} is not a row of the target embedding "
            f"(vocab_size {vocab}, valid ids 0..{vocab - 1}); the drafter was trained for a different tokenizer"
        )
    if config.vocab_size != vocab:
        fix = (
            "convert it again with --target-model-dir naming the target these shards were extracted from (a "
            "drafter GGUF's vocabulary is that directory's tokenizer, padded to the drafter's vocab_size)"
            if gguf
            else f"set vocab_size {vocab} in its config.json if only the field is off: the drafter uses the "
            f"target's embedding and lm_head"
        )
        raise CompatibilityError(
            f"{where}: drafter vocab_size {config.vocab_size} != target vocab_size {vocab}; the drafter was "
            f"configured for a different tokenizer ({fix})"
        )
