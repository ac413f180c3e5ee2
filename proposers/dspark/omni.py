"""vLLM's Qwen3-Omni DSpark drafter (`Qwen3OmniDSparkModel`, omni_layout.py) in the project's terms:
the Qwen3 DSpark drafter (the block drafter's Qwen3 layers, model.py's heads) that vLLM builds for it
(`vllm/model_executor/models/registry.py:682` -> qwen3_dspark.py `Qwen3DSparkForCausalLM`), over the
Omni thinker's text layers, with what `_validate_qwen3_omni_dspark` refuses (vllm/config/
speculative.py:167-393) refused by name, one `error:` line each. The embedding and lm_head are the
checkpoint's when it has them, else the target's (qwen3_dspark.py:325-365: vLLM shares the target's).
"""

from __future__ import annotations

from proposers.dspark.layout import resolve_heads
from proposers.dspark.omni_layout import MASK_KEYS, VALIDATOR, Qwen3OmniDSpark
from proposers.fields.decoder_rules import refuse
from proposers.fields.rules import check_target_width
from proposers.toolkit.config import DrafterConfig, DrafterConfigError


def parse_omni(checked: Qwen3OmniDSpark, raw: dict, source: str, drafter_config, target_layers=None) -> DrafterConfig:
    """The DrafterConfig of a Qwen3-Omni DSpark config; `drafter_config` is config.py's builder
    (passed in: config.py imports this module); `target_layers` the target's layer count when known."""
    _check_served(checked, raw, source)
    heads = resolve_heads(
        checked.markov_rank,
        "vanilla",
        bool(checked.enable_confidence_head),
        bool(checked.enable_confidence_head) and bool(checked.confidence_head_with_markov),
        checked.confidence_threshold,
        "",
        "vLLM's Qwen3DSparkModel",
        source,
    )
    config = drafter_config(
        raw,
        source,
        heads,
        block_size=checked.block,
        mask_token_id=checked.mask,
        target_layer_ids=checked.feature_layers(source, target_layers),
        num_target_layers=checked.num_target_layers,
        layout="qwen3-omni",
        drafts_from_anchor=True,
    )
    check_target_width(checked.target_hidden_size, config, source)
    key, mask = checked.first_set(MASK_KEYS, "mask_token_id")
    if mask >= config.vocab_size:
        refuse(source, key, mask, f"{VALIDATOR} requires it below vocab_size {config.vocab_size}")
    if "sliding_attention" in config.layer_types:
        raise DrafterConfigError(
            f"{source}: field 'layer_types' has sliding_attention; vLLM's Qwen3-Omni DSpark drafters are "
            f"full-attention Qwen3 DSpark layers, and specreplay scores those only"
        )
    return config


def _check_served(checked: Qwen3OmniDSpark, raw: dict, source: str) -> None:
    """The fields `_validate_qwen3_omni_dspark` refuses (speculative.py:296-324, 340-353, 379-393)."""
    key, aux = checked.aux_features
    if aux is None:
        raise DrafterConfigError(f"{source}: missing field 'use_aux_hidden_state'; {VALIDATOR} requires it true")
    if aux is not True:
        refuse(source, key, aux, f"{VALIDATOR} requires it true")
    if not checked.markov_rank:
        refuse(source, "markov_rank", checked.markov_rank, f"{VALIDATOR} requires a Markov head (rank > 0)")
    if checked.markov_head_type != "vanilla":
        refuse(source, "markov_head_type", checked.markov_head_type, f"{VALIDATOR} requires 'vanilla'")
    if checked.sample_from_anchor is False:
        refuse(source, "sample_from_anchor", False, f"{VALIDATOR} requires it true (every slot drafts)")
    if checked.dspark_bonus_anchor:
        refuse(source, "dspark_bonus_anchor", True, f"{VALIDATOR} requires it false")
    if checked.draft_vocab_size is not None and checked.draft_vocab_size != checked.vocab_size:
        refuse(
            source,
            "draft_vocab_size",
            checked.draft_vocab_size,
            f"a reduced output vocabulary (d2t) is not read for this layout yet; give vocab_size {checked.vocab_size}",
        )
    stated = {"mrope_section": raw} | {f"{n}.mrope_section": raw.get(n) for n in ("rope_parameters", "rope_scaling")}
    for key, space in stated.items():
        if isinstance(space, dict) and space.get("mrope_section") is not None:
            refuse(source, key, space["mrope_section"], f"{VALIDATOR} requires the drafter's 1-D RoPE; drop it")
