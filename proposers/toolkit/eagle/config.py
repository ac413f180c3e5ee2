"""How a config of an EAGLE-style family (EAGLE-3, P-EAGLE, EAGLE-1/2) becomes the project's: the decoder
(Llama or Qwen3 layers), the feature layers, the norm switches and the step count, refusing by name
what the replay does not implement (docs/config-fields.md). Each family's config.py adds its own.

A block here is the chain at one anchor: `block_size` = k steps, step j reading the token at
t + j - 1 and proposing t + j, so every slot drafts (`drafts_from_anchor`).
"""

from __future__ import annotations

from proposers.fields.decoder_rules import check_eagle_decoder
from proposers.fields.rules import check_specforge_eagle
from proposers.toolkit.config import DrafterConfig, DrafterConfigError, decoder_shape, refuse_field
from proposers.toolkit.eagle.decoder import decoder_config
from proposers.toolkit.qwen3_decoder import draft_vocab
from proposers.toolkit.speculators_layout import SpeculatorsEagle

# Steps a chain drafts when the config does not say: speculators' default ttt_steps (SpecForge
# configs never say; sglang takes --speculative-num-steps)
DEFAULT_STEPS = 3


def parse_speculators(
    checked: SpeculatorsEagle,
    raw: dict,
    source: str,
    target_layers: int | None,
    family: str,
    label: str,
    mask_token_id: int | None = None,
) -> DrafterConfig:
    """A speculators config of an EAGLE-style family (`family`, named `label` in messages) in the
    project's terms: its decoder, feature layers, norm switches and step count; `mask_token_id`
    the token of a family whose later slots read a mask (P-EAGLE), None for a chain of its drafts."""
    decoder = raw["transformer_layer_config"]
    kind = decoder.get("model_type", "qwen3")
    if kind not in ("llama", "qwen3"):
        raise DrafterConfigError(
            f"{source}: field 'transformer_layer_config.model_type' is {kind!r}; specreplay scores {label} drafters "
            f"with Llama or Qwen3 decoder layers ('llama', 'qwen3')"
        )
    stated = checked.eagle_aux_hidden_state_layer_ids
    return eagle_config(
        decoder,
        kind,
        source,
        checked,
        target_layers,
        family=family,
        mask_token_id=mask_token_id,
        steps=checked.speculative_tokens or DEFAULT_STEPS,
        draft_vocab_size=checked.draft_vocab_size,
        stated=list(stated) if stated is not None else before_ids(checked, target_layers, source),
        options=dict(
            norm_before_fc=checked.norm_before_fc,
            fc_norm=checked.fc_norm,
            norm_before_residual=checked.norm_before_residual,
            feed_post_norm=checked.norm_output,
            id_map=False,  # d2t/t2d only with a reduced vocabulary (speculators' DraftVocabMixin)
        ),
    )


def before_ids(checked: SpeculatorsEagle, target_layers: int, source: str) -> list[int]:
    """The default ids as speculators states them (before layer i), for messages."""
    return [i if i == target_layers else i + 1 for i in checked.feature_layers(source, target_layers)]


def eagle_config(
    decoder: dict,
    kind: str,
    source: str,
    checked,
    target_layers,
    *,
    family,
    steps,
    draft_vocab_size,
    stated,
    options,
    mask_token_id=None,
):
    """The DrafterConfig of an EAGLE-style drafter of `family` whose decoder fields are `decoder`
    (`kind` layers): a block of [x_t, mask, ...] with `mask_token_id`, else the chain's stored
    tokens (teacher forced: each step reads the draft before it)."""
    hf = decoder_config(decoder, kind, source)
    check_decoder(decoder, hf, checked, source)
    check_eagle_decoder(decoder, hf, "transformer_layer_config." if checked.LAYOUT == "speculators" else "", source)
    config = DrafterConfig(
        **decoder_shape(hf),
        block_size=steps,
        mask_token_id=mask_token_id,
        target_layer_ids=checked.feature_layers(source, target_layers),
        num_target_layers=None,
        layer_types=["full_attention"] * hf.num_hidden_layers,
        sliding_window=None,
        is_causal=True,
        raw=decoder,  # what the model builds its transformers config from (decoder.decoder_config)
        family=family,
        layout=checked.LAYOUT,
        drafts_from_anchor=True,
        teacher_forced_block=mask_token_id is None,
        block_conventions=False,
        family_options={"decoder": kind, **options},
        stated_layer_ids=stated,
        layer_convention=checked.CONVENTION,
    )
    if draft_vocab_size is not None:  # a reduced vocabulary (EAGLE-1/2 drafts over the target's whole one)
        config.draft_vocab_size = draft_vocab(draft_vocab_size, config.vocab_size, source)
    if checked.LAYOUT == "specforge" and family == "eagle3":  # P-EAGLE's checks its own config.py
        check_specforge_eagle(checked, len(config.target_layer_ids), source)
    return config


def check_decoder(decoder: dict, hf, checked, source: str) -> None:
    """What the replay does not implement for EAGLE-style drafters, refused by name rather than
    scored wrong."""
    types = decoder.get("layer_types") or []
    if "sliding_attention" in types:
        refuse_field(
            source, "layer_types", "sliding attention", "specreplay scores EAGLE-style drafters with full attention"
        )
    if decoder.get("use_sliding_window") and decoder.get("sliding_window"):
        refuse_field(
            source,
            "sliding_window",
            f"{decoder['sliding_window']} with use_sliding_window true",
            "specreplay scores EAGLE-style drafters with full attention",
        )
    stated = getattr(checked, "target_hidden_size", None)  # EAGLE-1/2's layout has none
    if stated is not None and stated != hf.hidden_size:
        refuse_field(
            source,
            "target_hidden_size",
            stated,
            f"the drafter's width is {hf.hidden_size}; the target's embedding then does not fit its first layer",
        )
