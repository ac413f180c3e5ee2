"""DFlash2 drafters for the parity tests: the public references with random weights, saved with
their own save_pretrained (zlab_dflash2: `dflash.model.DFlash2DraftModel`; speculators_dflash2:
speculators' `DFlash2DraftModel`), and load_ours, which reads a saved directory into
proposers.dflash2.config's model by name."""

from __future__ import annotations

import json
import os

import torch

from tests.helpers.drafters import (
    REFERENCE_HIDDEN,
    REFERENCE_MASK,
    REFERENCE_TARGET,
    REFERENCE_VOCAB,
    _random_weights,
    drafter_config,
)
from tests.helpers.models import seeded

# Small enough for every-anchor parity in milliseconds; 4 groups of 8 channels, 5 candidates of 64.
SELECTOR_FIELDS = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 16, "selector_top_k": 5}
# The selector's weights are drawn wider than the rest so that its pair score is as large as the
# spread of the unary top candidates: it then overturns the unary argmax at many slots, and a
# model that ignored it (or used the wrong predecessor) would draft differently.
SELECTOR_STD = 0.8


def _wide_selector(model, seed: int):
    with seeded(seed + 1), torch.no_grad():
        for parameter in model.candidate_selector.parameters():
            parameter.normal_(0.0, SELECTOR_STD)


def zlab_config(*, dflash_extra: dict | None = None, **config) -> dict:
    """A z-lab DFlash2 config.json dict: drafter_config(**config) with REFERENCE_TARGET's shapes,
    4 query / 2 kv heads of 8, mask REFERENCE_MASK, architecture DFlash2DraftModel and the
    DFlash2 fields in dflash_config (SELECTOR_FIELDS, then `dflash_extra`)."""
    config.setdefault("target", REFERENCE_TARGET)
    config.setdefault("num_heads", 4)
    config.setdefault("intermediate_size", 64)
    config.setdefault("mask_token_id", REFERENCE_MASK)
    raw = drafter_config(dflash_extra={**SELECTOR_FIELDS, **(dflash_extra or {})}, **config)
    return {**raw, "architectures": ["DFlash2DraftModel"]}


def zlab_dflash2(save_dir=None, *, seed: int = 0, std: float = 0.2, **config):
    """z-lab's `DFlash2DraftModel` built from zlab_config(**config) with random weights; saved to
    `save_dir` with its own save_pretrained when given."""
    from dflash.model import DFlash2DraftModel
    from transformers import Qwen3Config

    raw = zlab_config(**config)
    hf = Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    hf.architectures = raw["architectures"]
    with seeded(seed):
        model = DFlash2DraftModel(hf)
    _random_weights(model, seed, std)
    _wide_selector(model, seed)
    if save_dir is not None:
        model.save_pretrained(str(save_dir))
    return model


def speculators_dflash2(
    save_dir=None,
    *,
    seed: int = 0,
    std: float = 0.2,
    layer_ids=(2, 4),
    block_size: int = 4,
    layer_types=("full_attention", "full_attention"),
    sliding_window: int | None = None,
    **fields,
):
    """speculators' `DFlash2DraftModel` (eager attention, so it runs on CPU) of REFERENCE_TARGET's
    shapes with before-layer `aux_hidden_state_layer_ids` = layer_ids; `fields` are
    DFlash2SpeculatorConfig's (sliding_window_non_causal, sample_from_anchor, ...). Its target
    weights (embed_tokens, lm_head, verifier_*) are random too, as load_verifier_weights would
    fill them from a target. Saved with its save_pretrained when `save_dir` is given."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash2.config import DFlash2SpeculatorConfig
    from speculators.models.dflash2.core import DFlash2DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    decoder = Qwen3Config(
        vocab_size=REFERENCE_VOCAB,
        hidden_size=REFERENCE_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        layer_types=list(layer_types),
        use_sliding_window=sliding_window is not None,
        sliding_window=sliding_window,
    )
    decoder._attn_implementation = "eager"  # flex attention needs a compiler; eager runs anywhere
    from_anchor = fields.get("sample_from_anchor", False)
    settings = SpeculatorsConfig(
        algorithm="dflash2",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block_size if from_anchor else block_size - 1)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
    )
    values = dict(draft_vocab_size=REFERENCE_VOCAB, mask_token_id=REFERENCE_MASK, **SELECTOR_FIELDS)
    config = DFlash2SpeculatorConfig(
        transformer_layer_config=decoder,
        block_size=block_size,
        aux_hidden_state_layer_ids=list(layer_ids),
        speculators_config=settings,
        **{**values, **fields},
    )
    with seeded(seed):
        model = DFlash2DraftModel(config)
    _random_weights(model, seed, std)
    _wide_selector(model, seed)
    with seeded(seed + 2), torch.no_grad():  # the target's head: unary logits with a spread like a real one's
        model.lm_head.weight.normal_(0.0, 1.0)
    if save_dir is not None:
        model.save_pretrained(str(save_dir))
    return model


def load_ours(path):
    """proposers.dflash2.config's model for the checkpoint directory `path` (config.json +
    model.safetensors): config through the declared layouts and dflash2.parse_drafter_config,
    weights by name, strictly (every tensor used, none missing)."""
    from safetensors.torch import load_file

    from proposers.dflash2.config import FAMILY
    from proposers.dflash2.model import canonical_names
    from proposers.layouts import read_drafter_format

    source = os.path.join(str(path), "config.json")
    with open(source) as f:
        raw = json.load(f)
    config = FAMILY.parse_config(read_drafter_format(raw, source), raw, source)
    model = FAMILY.model(config)
    model.load_state_dict(canonical_names(load_file(os.path.join(str(path), "model.safetensors"))), strict=True)
    return model.eval()
