"""The P-EAGLE family: its two config layouts (layout.py) in the project's terms. EAGLE-3's decoder,
feature layers and switches (proposers/toolkit/eagle/config.py) with a block of [x_t, mask, ...]:
its drafts do not read one another, so they are independent given the block (DDTree applies) and
need no teacher forcing. K is the engine's (`score --steps`; speculators' `speculative_tokens`,
vLLM's num_speculative_tokens). The model and the inference rule: model.py.

SpecForge's layout is read as vLLM reads it (layout.py): the top-level Llama decoder with any
number of layers, `norm_before_residual` as saved, d2t/t2d always present (PEagleDraftModel
registers both whatever the vocabulary).
"""

from __future__ import annotations

from proposers.peagle.layout import SpecForgePEagle, SpeculatorsPEagle
from proposers.peagle.model import PEagleDrafter
from proposers.registry import Family
from proposers.toolkit.config import DrafterConfig, DrafterConfigError, refuse_field
from proposers.toolkit.eagle.config import DEFAULT_STEPS, eagle_config, parse_speculators


def parse_drafter_config(checked, raw: dict, source: str = "config", target_layers: int | None = None) -> DrafterConfig:
    """A P-EAGLE config (validated against its declared layout) in the project's terms."""
    if isinstance(checked, SpeculatorsPEagle):
        if checked.fc_norm:
            refuse_field(source, "fc_norm", "true", "vLLM's speculators converter does not carry it for P-EAGLE "
                         "(transformers_utils/configs/speculators/algos.py:53-85) and serves the drafter "
                         "without those norms")  # fmt: skip
        mask = checked.mask_token_id
        config = parse_speculators(checked, raw, source, target_layers, "peagle", "P-EAGLE", mask)
    elif isinstance(checked, SpecForgePEagle):
        mask = checked.mask_token
        config = _specforge(checked, raw, source, target_layers)
    else:
        raise DrafterConfigError(f"{source}: a {type(checked).__name__} config is not one of P-EAGLE's layouts")
    if mask >= config.vocab_size:
        raise DrafterConfigError(
            f"{source}: field 'mask_token_id' is {mask}, outside the drafter's vocabulary (vocab_size "
            f"{config.vocab_size})"
        )
    return config


def _specforge(checked: SpecForgePEagle, raw: dict, source: str, target_layers: int | None) -> DrafterConfig:
    _refuse_unbuilt(checked, source)
    config = eagle_config(
        raw,
        "llama",  # SpecForge's PEagleDraftModel is Llama layers whatever model_type says
        source,
        checked,
        target_layers,
        family="peagle",
        mask_token_id=checked.mask_token,
        steps=checked.num_speculative_tokens or DEFAULT_STEPS,
        draft_vocab_size=checked.draft_vocab_size,
        stated=checked.stored_layer_ids(),
        options=dict(
            norm_before_fc=False,
            fc_norm=False,
            norm_before_residual=checked.norm_before_residual,
            feed_post_norm=False,  # no step reads a draft's state: the mask slots read mask_hidden
            id_map=True,  # PEagleDraftModel registers d2t and t2d whatever the vocabulary
        ),
    )
    count = checked.num_aux_hidden_states
    if count is not None and count != len(config.target_layer_ids):
        refuse_field(
            source, "num_aux_hidden_states", count, f"vLLM sizes fc for that many target layers, the config names "
            f"{len(config.target_layer_ids)}"
        )  # fmt: skip
    return config


def _refuse_unbuilt(checked: SpecForgePEagle, source: str) -> None:
    """vLLM's EAGLE-3 switches SpecForge's PEagleDraftModel never builds: their weights would be missing."""
    options = checked.options
    if not options.use_aux_hidden_state:
        refuse_field(source, "eagle_config.use_aux_hidden_state", "false", "a P-EAGLE drafter reads target features")
    nested = options.norm_before_fc is not None
    if options.norm_before_fc if nested else checked.norm_before_fc:
        field = "eagle_config.norm_before_fc" if nested else "norm_before_fc"
        refuse_field(source, field, "true", "vLLM then normalizes the target features before fc, a norm SpecForge's "
                     "PEagleDraftModel has no weight for")  # fmt: skip
    if checked.fc_norm:
        refuse_field(source, "fc_norm", "true", "vLLM then normalizes each target layer before fc, a norm SpecForge's "
                     "PEagleDraftModel has no weight for")  # fmt: skip


FAMILY = Family("peagle", parse_drafter_config, PEagleDrafter, independent_drafts=True, chain_steps=True)
