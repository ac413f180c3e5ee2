"""Drafters for the tests: drafter_config (the one config source), random_drafter (ours, random
weights), reference_drafter (the public dflash model, random weights, saved in z-lab format),
fitted_drafters (ours, fitted to extracted shards, saved)."""

from __future__ import annotations

import torch

from tests.helpers.models import TINY_TARGET, seeded


def drafter_config(
    target: dict | None = None,
    *,
    layers: int = 2,
    block_size: int = 4,
    layer_ids=(1, 3),
    num_heads: int | None = None,
    intermediate_size: int | None = None,
    mask_token_id=None,
    dflash_extra: dict | None = None,
    **fields,
) -> dict:
    """A z-lab config.json dict from scoring.fit.new_drafter_config (what `specreplay fit` writes)
    for a drafter of `target` (default TINY_TARGET).

    `layer_ids=None` leaves dflash_config.target_layer_ids out, so loaders derive them from
    num_target_layers. `dflash_extra` goes into dflash_config (input_embedding_scale, ...); other
    fields go at the top level (layer_types, sliding_window, is_causal, ...); a sliding_window
    also sets use_sliding_window, without which Qwen3Config drops the window on load."""
    from scoring.fit import new_drafter_config

    raw = new_drafter_config(
        target or TINY_TARGET,
        num_layers=layers,
        block_size=block_size,
        layer_ids=list(layer_ids) if layer_ids is not None else None,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        mask_token_id=mask_token_id,
    )
    if layer_ids is None:
        del raw["dflash_config"]["target_layer_ids"]
    raw["dflash_config"].update(dflash_extra or {})
    raw.update(fields)
    if fields.get("sliding_window") is not None:
        raw["use_sliding_window"] = True
    return raw


def _random_weights(model, seed: int, std: float):
    """Every parameter (norms included, so a weight loaded into the wrong slot shows) drawn from
    N(0, std), seeded without touching the global RNG; eval mode."""
    with seeded(seed), torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, std)
    return model.eval()


def random_drafter(*, seed: int = 0, std: float = 0.2, **config):
    """Our proposers.dflash.config.DFlashDrafter with drafter_config(**config) and random weights."""
    from proposers.detect import parse_drafter_config
    from proposers.dflash.model import DFlashDrafter

    with seeded(seed):
        drafter = DFlashDrafter(parse_drafter_config(drafter_config(**config), "test drafter"))
    return _random_weights(drafter, seed, std)


# The public reference drafters' dimensions (tests/scoring/drafters/: test_dflash_model.py,
# test_checkpoint.py): small enough that a parity check over every anchor takes milliseconds; MASK
# inside VOCAB but not its last id.
REFERENCE_HIDDEN, REFERENCE_VOCAB, REFERENCE_MASK = 32, 64, 60
REFERENCE_TARGET = {"hidden_size": REFERENCE_HIDDEN, "num_layers": 6, "vocab_size": REFERENCE_VOCAB}


def reference_drafter(save_dir=None, *, seed: int = 0, std: float = 0.2, **config):
    """The public reference `dflash.model.DFlashDraftModel` built from drafter_config(**config)
    (default: REFERENCE_TARGET, 4 query / 2 kv heads of 8, mask REFERENCE_MASK) with random
    weights; saved to `save_dir` in z-lab format (its own save_pretrained) when given. dflash is
    required: tests/conftest.py stops the suite at its start when it is missing."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    config.setdefault("target", REFERENCE_TARGET)
    config.setdefault("num_heads", 4)
    config.setdefault("intermediate_size", 64)
    config.setdefault("mask_token_id", REFERENCE_MASK)
    raw = drafter_config(**config)
    hf = Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    hf.architectures = raw["architectures"]
    with seeded(seed):
        model = DFlashDraftModel(hf)
    _random_weights(model, seed, std)
    if save_dir is not None:
        model.save_pretrained(str(save_dir))
    return model


def fitted_drafters(
    shards: str,
    out_dir,
    *,
    block_size: int = 4,
    layer_ids=None,
    layer_types=None,
    sliding_window: int | None = None,
    **options,
) -> list[str]:
    """Fit a new drafter (scoring.fit, as `specreplay fit`) to every sample of the shards; returns
    the checkpoint directories written, out_dir/step_<N> (every `save_every` steps and the last).
    One decoder layer unless layer_types says more; `options` are FitOptions fields."""
    from pipeline.shards import ShardSet
    from scoring.config import FitOptions
    from scoring.fit import fit_drafter, new_drafter_config

    shardset = ShardSet(shards)
    settings = shardset.settings
    raw = new_drafter_config(
        settings["target"],
        num_layers=len(layer_types or [None]),
        block_size=block_size,
        layer_ids=layer_ids,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    samples = list(shardset.samples(tensors=["features"]))
    _, written = fit_drafter(
        samples, shardset.target_head(), settings["layer_ids"], raw, str(out_dir), FitOptions(**options)
    )
    return written
