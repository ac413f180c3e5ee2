"""Each layout's fields an engine honours that the replay does not implement, refused by name
unless neutral (docs/config-fields.md has every field's status and where each engine reads it).
Called by the families' config.py once the DrafterConfig is resolved, so a message can state what
the replay would have used."""

from __future__ import annotations

from proposers.fields.decoder_rules import refuse

BLOCK_SIZE_RULE = (
    "vLLM serves a block of {served} queries ({how}) while block_size is {block}; attention inside the block is "
    "bidirectional, so every draft depends on the block's length (speculators writes {expected})"
)


def check_speculative_tokens(checked, config, source: str) -> None:
    """speculators' block drafters: vLLM takes the block from speculative_tokens N (N + 1 queries,
    the anchor's first; N when every slot drafts), not from block_size."""
    tokens = checked.speculative_tokens
    if tokens is None:
        return
    served = tokens if config.drafts_from_anchor else tokens + 1
    if served != config.block_size:
        how = "every slot drafting" if config.drafts_from_anchor else "the anchor, then one per draft"
        expected = config.block_size if config.drafts_from_anchor else config.block_size - 1
        refuse(
            source,
            "speculators_config.proposal_methods[0].speculative_tokens",
            tokens,
            BLOCK_SIZE_RULE.format(served=served, how=how, block=config.block_size, expected=expected),
        )


def check_target_width(target_hidden_size, config, source: str) -> None:
    if target_hidden_size is not None and target_hidden_size != config.hidden_size:
        refuse(
            source,
            "target_hidden_size",
            target_hidden_size,
            f"vLLM sizes fc for a target of that width, the drafter's is hidden_size {config.hidden_size}; "
            f"specreplay scores drafters as wide as their target",
        )


def check_aux_features(value, field: str, source: str) -> None:
    if value is False:
        refuse(
            source,
            field,
            False,
            "vLLM then feeds the target's hidden state to the drafter without fc; specreplay projects the target "
            "features through fc",
        )


def check_zlab(checked, config, source: str) -> None:
    """z-lab's DFlash / DFlash2 fields (dflash_config first, then the top level)."""
    options = checked.dflash_config
    _zlab_other_drafters(checked, options, source)
    if options is not None:
        _zlab_attention(options, source)
    if checked.add_swa_attention_sink_bias:
        refuse(source, "add_swa_attention_sink_bias", True, SINKS)
    if options is not None and options.sample_from_anchor:  # at the top level no engine reads it for DFlash
        refuse(
            source,
            "dflash_config.sample_from_anchor",
            True,
            "vLLM refuses a DFlash drafter that drafts from the anchor's own slot, and no engine serves one",
        )
    check_aux_features(checked.value("use_aux_hidden_state"), checked.field_name("use_aux_hidden_state"), source)
    vocab = checked.draft_vocab_size
    if vocab is not None and vocab != config.vocab_size:
        refuse(
            source,
            "draft_vocab_size",
            vocab,
            f"vLLM builds a reduced lm_head and a d2t map for it; specreplay reads z-lab drafters over the "
            f"target's whole vocabulary ({config.vocab_size})",
        )
    check_target_width(checked.target_hidden_size, config, source)


SINKS = "vLLM and SGLang add a learned per-head sink to every softmax; specreplay has none"


def _zlab_other_drafters(checked, options, source: str) -> None:
    """Keys that make SGLang build another drafter than DFlash (Domino, a LiLiCorr head)."""
    projector = checked.value("projector_type")
    if projector is not None:
        refuse(
            source,
            checked.field_name("projector_type"),
            projector,
            "SGLang builds another drafter for it ('domino': its GRU head); specreplay would score it as DFlash",
        )
    lilicorr = sorted(k for k in (options.model_fields_set if options else ()) if k.startswith("lilicorr_"))
    if lilicorr and options.lilicorr_enabled is not False:
        refuse(
            source,
            f"dflash_config.{lilicorr[0]}",
            getattr(options, lilicorr[0]),
            "SGLang adds its LiLiCorr candidate-correction head; specreplay does not implement it",
        )


def _zlab_attention(options, source: str) -> None:
    """dflash_config's attention keys the replay does not implement (causal, attention_value_scale,
    use_swa and swa_window_size it does: proposers/toolkit/qwen3_decoder.py)."""
    if options.attention_sink_bias:
        refuse(source, "dflash_config.attention_sink_bias", True, SINKS)


def dspark_from_anchor(checked) -> bool:
    """SpecForge's and DeepSpec's `sample_from_anchor`: absent is true for every engine (and the
    trainers, which never write it); false, every engine serves the fill-in block [x_t, mask, ...]
    with slot 0 the anchor's, which the replay implements as speculators' DSpark."""
    return checked.sample_from_anchor is not False


def check_speculators_block(checked, config, source: str) -> None:
    """speculators' DFlash, DFlash2 and DSpark top-level fields."""
    check_speculative_tokens(checked, config, source)
    check_target_width(checked.target_hidden_size, config, source)
    check_aux_features(getattr(checked, "use_aux_hidden_state", None), "use_aux_hidden_state", source)


def check_specforge_eagle(checked, feature_layers: int, source: str) -> None:
    """SpecForge's EAGLE-3 keys an engine reads that SpecForge never trains."""
    options = checked.options
    nested = options.norm_before_fc is not None
    if options.norm_before_fc if nested else checked.norm_before_fc:
        refuse(
            source,
            "eagle_config.norm_before_fc" if nested else "norm_before_fc",
            True,
            "vLLM, SGLang and llama.cpp then normalize the concatenated target features before fc; SpecForge "
            "never trains that norm and specreplay's SpecForge EAGLE-3 has none",
        )
    if checked.use_aux_norm and not checked.fc_norm:
        refuse(
            source,
            "use_aux_norm",
            True,
            "SGLang reads it as fc_norm (a norm per target layer before fc), vLLM reads fc_norm only; set fc_norm",
        )
    if "norm_output" in checked.model_fields_set and checked.norm_output:
        refuse(
            source,
            "norm_output",
            True,
            "vLLM and SGLang then feed the post-norm hidden state back to the next step, SpecForge trained on (and "
            "specreplay scores) the pre-norm one; without the key every engine feeds the pre-norm state",
        )
    switches = (
        ("norm_before_residual", "vLLM and llama.cpp then take the normed hidden state as the first layer's residual; "
         "SpecForge never trains it"),
        ("tie_word_embeddings", "SGLang then uses the drafter's embed_tokens as lm_head and never reads lm_head.weight; "
         "specreplay reads lm_head"),
        ("bias", "SGLang then adds a bias to fc; specreplay's fc has none"),
    )  # fmt: skip
    for key, why in switches:
        if getattr(checked, key):
            refuse(source, key, True, why)
    count = checked.num_aux_hidden_states
    if count is not None and count != feature_layers:
        refuse(
            source,
            "num_aux_hidden_states",
            count,
            f"vLLM and SGLang size fc for that many target layers, the config names {feature_layers}",
        )
