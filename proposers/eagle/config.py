"""The EAGLE-1/2 family: the EAGLE repository's config (layout.py) in the project's terms (the chain;
sglang's dynamic tree, EAGLE-2's, in proposers/toolkit/eagle/tree.py; DDTree no: each step reads
the draft before it).

Llama decoder layers only (the repository's cnets.py, vLLM's and SGLang's llama_eagle.py); its
own Qwen2 and Mixtral variants are refused by `model_type`. A block is the chain at one anchor, as
for EAGLE-3: k steps (`score --steps`, else `num_speculative_tokens`, else 3), step j reading the
stored token at t + j - 1 and proposing t + j. The model and the rule: model.py.
"""

from __future__ import annotations

from proposers.eagle.layout import EagleRepo
from proposers.eagle.model import Eagle1Drafter
from proposers.registry import Family
from proposers.toolkit.config import DrafterConfig, DrafterConfigError, refuse_field
from proposers.toolkit.eagle.config import DEFAULT_STEPS, eagle_config
from proposers.toolkit.eagle.tree import beam_candidates


def parse_drafter_config(
    checked: EagleRepo, raw: dict, source: str = "config", target_layers: int | None = None
) -> DrafterConfig:
    """An EAGLE-1/2 config (validated against its declared layout) in the project's terms."""
    if not isinstance(checked, EagleRepo):
        raise DrafterConfigError(f"{source}: a {type(checked).__name__} config is not one of EAGLE-1/2's layouts")
    if checked.model_type not in (None, "llama"):
        refuse_field(
            source,
            "model_type",
            repr(checked.model_type),
            "vLLM and SGLang serve EAGLE-1/2 drafters of Llama layers (llama_eagle.py), as specreplay scores them; "
            "the EAGLE repository's Qwen2 and Mixtral variants bias or route their layers otherwise",
        )
    return eagle_config(
        raw,
        "llama",
        source,
        checked,
        target_layers,
        family="eagle",
        steps=checked.num_speculative_tokens or DEFAULT_STEPS,
        draft_vocab_size=None,
        stated=None,
        options=dict(norm_before_residual=False, fc_bias=checked.bias),
    )


FAMILY = Family(
    "eagle", parse_drafter_config, Eagle1Drafter, independent_drafts=False, tree=beam_candidates, chain_steps=True
)
