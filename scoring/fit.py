"""A small DFlash drafter trainer over stored shards (`specreplay fit`).

It exists so a newcomer sees real acceptance numbers and tests have fitted drafters; it is not
a training framework. Loss: cross-entropy of the block's draft positions against the stored
target tokens at random anchors, position k weighted by exp(-(k - 1) / gamma) as in the DFlash
paper (gamma 7 for block 16, 5 for 10, 4 for 8). The target's embedding and lm_head stay
frozen (they are the target's); only the drafter's own weights train.
"""

from __future__ import annotations

import json
import math
import os
import random

import torch
from safetensors.torch import save_file

from pipeline.common.errors import UserError
from pipeline.common.layer_ids import build_target_layer_ids, requested_layer_ids
from pipeline.shards import Sample, ShardSet
from proposers.detect import build_drafter, parse_drafter_config
from proposers.dflash.model import DFlashDrafter
from scoring.config import FitOptions
from scoring.replay.packing import select_feature_columns
from scoring.score.record import shards_identity

GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}


def position_decay_gamma(block_size: int) -> float:
    """gamma of the DFlash position-decay loss weights; the paper's values, else block_size / 2."""
    return GAMMA_BY_BLOCK.get(block_size, block_size / 2)


def position_weights(block_size: int) -> torch.Tensor:
    """w_k = exp(-(k - 1) / gamma) for draft positions k = 1..block_size - 1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / position_decay_gamma(block_size))


def new_drafter_config(
    target: dict,
    num_layers: int = 1,
    block_size: int = 8,
    layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    num_heads: int | None = None,
    intermediate_size: int | None = None,
    sliding_window: int | None = None,
    layer_types: list[str] | None = None,
) -> dict:
    """A z-lab-format config.json dict for a drafter of a target described by the manifest's
    `settings.target` (hidden_size, num_layers, vocab_size)."""
    hidden = int(target["hidden_size"])
    heads = num_heads or max(1, hidden // 64)
    kv_heads = heads if heads % 2 else max(1, heads // 2)
    ids = layer_ids or build_target_layer_ids(int(target["num_layers"]), num_layers)
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate_size": intermediate_size or 3 * hidden,
        "vocab_size": int(target["vocab_size"]),
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": block_size,
        "num_target_layers": int(target["num_layers"]),
        "dflash_config": {
            "mask_token_id": int(target["vocab_size"]) - 1 if mask_token_id is None else mask_token_id,
            "target_layer_ids": list(ids),
        },
    }
    if layer_types is not None:
        raw["layer_types"] = layer_types
        raw["use_sliding_window"] = sliding_window is not None  # else Qwen3Config drops the window
        raw["sliding_window"] = sliding_window
    return raw


def save_drafter(drafter: DFlashDrafter, out_dir: str, extra_config: dict | None = None) -> str:
    """Write a z-lab-format checkpoint directory (config.json + model.safetensors)."""
    os.makedirs(out_dir, exist_ok=True)
    raw = dict(drafter.config.raw, **(extra_config or {}))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=1)
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def block_loss(
    drafter: DFlashDrafter,
    sample: Sample,
    features: torch.Tensor,
    head: dict,
    weights: torch.Tensor,
    count: int,
    rng: random.Random,
) -> torch.Tensor:
    """Position-weighted cross-entropy of `count` random anchors' blocks against the stored tokens."""
    config = drafter.config
    ids, B = sample.input_ids, config.block_size
    seq_len, prompt_len = ids.numel(), sample.prompt_len
    count = min(count, seq_len - 1 - prompt_len)
    anchors = torch.tensor(sorted(rng.sample(range(prompt_len, seq_len - 1), count)))
    context = drafter.context_kv(features[: int(anchors.max())])
    block_ids = torch.full((count, B), config.mask_token_id)
    block_ids[:, 0] = ids[anchors]
    embeds = torch.nn.functional.embedding(block_ids, head["embed_tokens"]) * config.input_embedding_scale
    logits = drafter.logits(drafter(embeds, anchors, context)[:, 1:], head["lm_head"])  # [count, B - 1, V]
    positions = anchors[:, None] + torch.arange(1, B)[None, :]
    known = positions < seq_len
    targets = torch.where(known, ids[positions.clamp(max=seq_len - 1)], torch.full_like(positions, -100))
    loss_each = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=-100
    ).view(count, B - 1)
    w = weights[None, :] * known
    return (loss_each * w).sum() / w.sum()


def new_drafter(config_raw: dict, init_std: float) -> DFlashDrafter:
    """A drafter with normal(0, init_std) matrices (norms at one), in training mode."""
    drafter = build_drafter(parse_drafter_config(config_raw, "new drafter config"))
    for _, param in drafter.named_parameters():
        if param.dim() > 1:
            torch.nn.init.normal_(param, std=init_std)
    return drafter.train()


def fit_drafter(
    samples: list[Sample],
    head: dict,
    stored_layer_ids: list[int],
    config_raw: dict,
    out_dir: str | None,
    options: FitOptions,
    progress=None,
) -> tuple[DFlashDrafter, list[str]]:
    """Train a drafter on stored samples; returns it and the checkpoint dirs written
    (`out_dir/step_<N>`), if any."""
    torch.manual_seed(options.seed)
    rng = random.Random(options.seed)
    drafter = new_drafter(config_raw, options.init_std)
    head = {"embed_tokens": head["embed_tokens"].float(), "lm_head": head["lm_head"].float()}
    weights = position_weights(drafter.config.block_size)
    usable = [s for s in samples if s.response_len >= 2]
    if not usable:
        raise UserError("no sample has a response of 2+ tokens to train on")
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=options.lr, weight_decay=0.0, foreach=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / options.steps))
    )
    written = []
    for step in range(1, options.steps + 1):
        sample = rng.choice(usable)
        features = select_feature_columns(sample.features.float(), stored_layer_ids, drafter.config.target_layer_ids)
        loss = block_loss(drafter, sample, features, head, weights, options.anchors_per_step, rng)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if progress is not None:
            progress(step, float(loss.detach()))
        if out_dir is not None and ((options.save_every and step % options.save_every == 0) or step == options.steps):
            written.append(save_drafter(drafter, os.path.join(out_dir, f"step_{step}"), {"step": step}))
    drafter.eval()
    return drafter, written


def fit_from_shards(
    shards: str, out_dir: str, options: FitOptions, layer_ids: list[int] | None = None, progress=None
) -> list[str]:
    """`specreplay fit`: a new drafter config for the shards' target, fitted to every stored
    sample; returns the checkpoint directories written. layer_ids default: every stored layer
    (without the neighbours of `extract --neighbour-layers`). config.json records the shards'
    identity under `specreplay_fit.shards_identity`."""
    shardset = ShardSet(shards)
    settings = shardset.settings
    ids = list(layer_ids) if layer_ids else requested_layer_ids(settings)
    raw = new_drafter_config(
        settings["target"], num_layers=options.layers, block_size=options.block_size, layer_ids=ids
    )
    missing = sorted(set(raw["dflash_config"]["target_layer_ids"]) - set(settings["layer_ids"]))
    if missing:
        raise UserError(
            f"feature layers {missing} are not stored in {shards} (stored: {settings['layer_ids']}); "
            f"pass --layer-ids from the stored ones"
        )
    # The marker lets the report say a drafter is scored on the very samples it was fitted on.
    raw["specreplay_fit"] = {"shards_identity": shards_identity(shardset.manifest)}
    samples = list(shardset.samples(tensors=["features"]))
    head = {k: v.float() for k, v in shardset.target_head().items()}
    _, written = fit_drafter(samples, head, settings["layer_ids"], raw, out_dir, options, progress)
    return written
