"""The DSpark family: its three config.json layouts in the project's terms.

* speculators (`speculators_model_type: "dspark"`):
  decoder nested in `transformer_layer_config`, before-layer `aux_hidden_state_layer_ids`,
  `sample_from_anchor` (default true), a reduced `draft_vocab_size` possible;
* SpecForge (`dflash_config.projector_type: "dspark"`) and DeepSpec (`Qwen3DSparkModel`)
  (layout.py): output-of-layer ids, every slot drafts (unless the file says
  `sample_from_anchor: false`, which every engine serves as the fill-in block).
* DeepSpec's Gemma 4 (`Gemma4DSparkModel`, gemma4.py) and DeepSeek-V4's (`DeepseekV4DSparkModel`,
  dsv4.py): their own decoders (proposers/toolkit/gemma4/, proposers/toolkit/dsv4/).
* Kimi K3's (`K3DSparkModel`, k3.py): dense MLA layers (proposers/toolkit/mla/attention.py).
* vLLM's Qwen3-Omni (`Qwen3OmniDSparkModel`, omni.py): DeepSpec's Qwen3 decoder and heads under
  vLLM's checkpoint contract.

The backbone is the block drafter's (proposers/toolkit/block_drafter.py), the heads are model.py's; the head settings go to
`DrafterConfig.family_options` (the fields of `DSparkHeads`). DeepSpec is the inference
reference (docs/drafter-families.md#dspark): `block_size` queries [x_t, mask, ...] at t.., slot k
proposing t + k + 1, bidirectional attention in full-attention layers.
"""

from __future__ import annotations

from dataclasses import asdict

from proposers.dspark import gemma4
from proposers.dspark.dsv4 import DSV4DSparkDrafter, parse_dsv4
from proposers.dspark.dsv4_layout import DeepseekV4DSpark
from proposers.dspark.gemma4 import parse_gemma4
from proposers.dspark.gemma4_layout import DeepSpecGemma4DSpark
from proposers.dspark.k3 import K3DSparkDrafter, parse_k3
from proposers.dspark.k3_layout import K3DSpark
from proposers.dspark.layout import DeepSpecDSpark, DSparkHeads, SpecForgeDSpark, SpeculatorsDSpark, resolve_heads
from proposers.dspark.omni import parse_omni
from proposers.dspark.omni_layout import Qwen3OmniDSpark
from proposers.fields.rules import check_speculators_block, check_target_width, dspark_from_anchor
from proposers.registry import Family
from proposers.toolkit.config import DrafterConfig, DrafterConfigError
from proposers.toolkit.qwen3_decoder import checked_decoder_fields, draft_vocab, speculators_decoder, stated_layers


def parse_drafter_config(checked, raw: dict, source: str = "config", target_layers: int | None = None) -> DrafterConfig:
    """A DSpark config (validated against its declared layout) in the project's terms."""
    if isinstance(checked, SpeculatorsDSpark):
        return _speculators(checked, raw, source)
    if isinstance(checked, SpecForgeDSpark):
        return _specforge(checked, raw, source)
    if isinstance(checked, DeepSpecDSpark):
        return _deepspec(checked, raw, source)
    if isinstance(checked, DeepSpecGemma4DSpark):
        return parse_gemma4(checked, raw, source)
    if isinstance(checked, DeepseekV4DSpark):
        return parse_dsv4(checked, raw, source)
    if isinstance(checked, K3DSpark):
        return parse_k3(checked, raw, source, target_layers)
    if isinstance(checked, Qwen3OmniDSpark):
        return parse_omni(checked, raw, source, _drafter_config, target_layers)
    raise DrafterConfigError(f"{source}: a {type(checked).__name__} config is not one of DSpark's layouts")


def _drafter_config(decoder: dict, source: str, heads: DSparkHeads, where: str = "", **fields) -> DrafterConfig:
    """The DrafterConfig of a DSpark drafter whose Qwen3 decoder fields are `decoder` (`where` in
    the file): the shapes as transformers' Qwen3Config resolves them (its defaults fill what the
    file leaves out), `is_causal` as the file says (every engine applies it to every layer)."""
    if heads.markov_head_type == "rnn" and not fields["drafts_from_anchor"]:
        raise DrafterConfigError(
            f"{source}: field 'markov_head_type' is 'rnn' with 'sample_from_anchor' false: the recurrent state "
            f"then starts at the anchor slot, which drafts nothing, and no inference implementation defines "
            f"that case; specreplay scores rnn heads with sample_from_anchor true only"
        )
    return DrafterConfig(
        **checked_decoder_fields(decoder, source, where, own_model_type=not where),
        is_causal=decoder.get("is_causal"),
        raw=decoder,  # what the backbone builds its Qwen3Config from (qwen3_decoder.decoder_hf_config)
        family="dspark",
        family_options=asdict(heads),
        **fields,
    )


def _speculators(checked: SpeculatorsDSpark, raw: dict, source: str) -> DrafterConfig:
    heads = resolve_heads(
        checked.markov_rank,
        checked.markov_head_type,
        checked.enable_confidence_head,
        checked.enable_confidence_head and checked.confidence_head_with_markov,
        _threshold(checked.confidence_threshold, source),
        "",
        "speculators' DSparkDraftModel",
        source,
    )
    config = _drafter_config(
        speculators_decoder(raw, source, "DSpark"),
        source,
        heads,
        "transformer_layer_config.",
        block_size=checked.block_size,
        mask_token_id=checked.mask_token_id,
        target_layer_ids=checked.feature_layers(source),
        num_target_layers=None,
        layout="speculators",
        sliding_non_causal=checked.sliding_window_non_causal,
        drafts_from_anchor=checked.sample_from_anchor,
        **stated_layers(checked),
    )
    config.draft_vocab_size = draft_vocab(checked.draft_vocab_size, config.vocab_size, source)
    check_speculators_block(checked, config, source)
    return config


def _specforge(checked: SpecForgeDSpark, raw: dict, source: str) -> DrafterConfig:
    options = checked.dflash_config
    config = _drafter_config(
        raw,
        source,
        checked.heads(source),
        block_size=checked.block_size,
        mask_token_id=options.mask_token_id,
        target_layer_ids=checked.feature_layers(source),
        num_target_layers=checked.num_target_layers,
        layout="specforge",
        # as its training (and DeepSpec) unless the file says false; its in-repo spec_generate is a slot off
        drafts_from_anchor=dspark_from_anchor(checked),
    )
    _check_attention_mode(options.attention_mode, config, source)
    check_target_width(checked.target_hidden_size, config, source)
    return config


def _check_attention_mode(mode: str, config: DrafterConfig, source: str) -> None:
    """SpecForge's DSparkDraftModel refuses head counts its `attention_mode` does not allow (dspark.py:290-313)."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % kv:
        problem = f"num_key_value_heads {kv} does not divide num_attention_heads {heads}"
    elif mode == "gqa" and kv >= heads:
        problem = f"dflash_config.attention_mode 'gqa' (the default) needs fewer key/value heads ({kv}) than query heads ({heads}); set attention_mode 'mha'"
    elif mode == "mha" and kv != heads:
        problem = f"dflash_config.attention_mode 'mha' needs num_key_value_heads ({kv}) equal to num_attention_heads ({heads})"
    else:
        return
    raise DrafterConfigError(f"{source}: {problem}, as SpecForge's DSparkDraftModel requires")


def _deepspec(checked: DeepSpecDSpark, raw: dict, source: str) -> DrafterConfig:
    config = _drafter_config(
        raw,
        source,
        checked.heads(source),
        block_size=checked.block_size,
        mask_token_id=checked.mask_token_id,
        target_layer_ids=checked.feature_layers(source),
        num_target_layers=checked.num_target_layers,
        layout="deepspec",
        drafts_from_anchor=dspark_from_anchor(checked),
    )
    if "sliding_attention" in config.layer_types:
        raise DrafterConfigError(
            f"{source}: field 'layer_types' has sliding_attention; DeepSpec builds every DSpark layer as "
            f"full_attention and its evaluator attends without a mask, so the window would be ignored there"
        )
    return config


def _threshold(value, source: str) -> float:
    """This project's `confidence_threshold` field (DeepSpec's evaluator flag of that name): in [0, 1]."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise DrafterConfigError(f"{source}: field 'confidence_threshold' is {value!r}; expected a number in [0, 1]")
    return float(value)


def set_confidence_threshold(config: DrafterConfig, threshold: float, source: str) -> None:
    """`score --confidence-threshold P` (llama-server's --spec-draft-p-min P) over the checkpoint's
    `confidence_threshold`; refused above 0 for a drafter without a confidence head, as llama-server
    refuses it (common/speculative.cpp:999-1006)."""
    if threshold > 0.0 and not config.family_options["confidence_head"]:
        raise DrafterConfigError(
            f"--confidence-threshold {threshold}: {source} has no confidence head (llama-server refuses "
            "--spec-draft-p-min above 0 for it); drop the option"
        )
    config.family_options["confidence_threshold"] = float(threshold)


def build(config: DrafterConfig):
    """The DSpark drafter of `config`: on DeepSeek-V4 stages, K3's MLA layers, Gemma 4 layers or Qwen 3's."""
    if config.family_options.get("decoder") == "dsv4":
        return DSV4DSparkDrafter(config)
    if config.family_options.get("decoder") == "k3":
        return K3DSparkDrafter(config)
    return gemma4.build(config)


FAMILY = Family(
    "dspark",
    parse_drafter_config,
    build,
    independent_drafts=False,
    set_confidence_threshold=set_confidence_threshold,
)
