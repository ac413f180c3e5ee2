"""The P-EAGLE family: speculators' config (layout.py) in the project's terms. EAGLE-3's decoder,
feature layers and switches (proposers/toolkit/eagle/config.py) with a block of [x_t, mask, ...]:
its drafts do not read one another, so they are independent given the block (DDTree applies) and
need no teacher forcing. K is the engine's (`score --steps`; speculators' `speculative_tokens`,
vLLM's num_speculative_tokens). The model and the inference rule: model.py.
"""

from __future__ import annotations

from proposers.peagle.layout import SpeculatorsPEagle
from proposers.peagle.model import PEagleDrafter
from proposers.registry import Family
from proposers.toolkit.config import DrafterConfig, DrafterConfigError
from proposers.toolkit.eagle.config import parse_speculators


def parse_drafter_config(
    checked: SpeculatorsPEagle, raw: dict, source: str = "config", target_layers: int | None = None
) -> DrafterConfig:
    """A P-EAGLE config (validated against its declared layout) in the project's terms."""
    config = parse_speculators(checked, raw, source, target_layers, "peagle", "P-EAGLE", checked.mask_token_id)
    if checked.mask_token_id >= config.vocab_size:
        raise DrafterConfigError(
            f"{source}: field 'mask_token_id' is {checked.mask_token_id}, outside the drafter's vocabulary "
            f"(transformer_layer_config.vocab_size {config.vocab_size})"
        )
    return config


FAMILY = Family("peagle", parse_drafter_config, PEagleDrafter, independent_drafts=True, chain_steps=True)
