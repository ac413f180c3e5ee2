"""The EAGLE-3 family: its two config.json layouts (layout.py) in the project's terms (the chain;
its own dynamic tree in tree.py; DDTree no).

* speculators (`speculators_model_type: "eagle3"`):
  the decoder in `transformer_layer_config` (Llama or Qwen3 layers; Qwen3 when `model_type` is
  absent, as speculators' validator builds it), `eagle_aux_hidden_state_layer_ids` counted before
  layer i (default [2, L // 2, L - 3]), the switches `norm_before_fc`, `fc_norm`,
  `norm_before_residual`, `norm_output` (the next step reads the post-norm hidden state), a
  reduced `draft_vocab_size`; k = `speculators_config.proposal_methods[0].speculative_tokens`.
* SpecForge (`LlamaForCausalLMEagle3`): the
  Llama decoder at the top level, one layer (`midlayer`), output-of-layer ids (default
  [1, L // 2 - 1, L - 4], the same layers), `fc_norm`; d2t/t2d always saved.

A block here is the chain at one anchor: `block_size` = k steps, step j reading the token at
t + j - 1 (the stored one: `teacher_forced_block`) and proposing t + j, so every slot drafts
(`drafts_from_anchor`). The model and the inference rule: model.py.
"""

from __future__ import annotations

from proposers.eagle3.layout import SpecForgeEagle3, SpeculatorsEagle3
from proposers.eagle3.model import Eagle3Drafter, decoder_config
from proposers.eagle3.tree import beam_candidates
from proposers.fields.decoder_rules import check_eagle_decoder
from proposers.fields.rules import check_specforge_eagle
from proposers.registry import Family
from proposers.toolkit.config import DrafterConfig, DrafterConfigError, decoder_shape, refuse_field
from proposers.toolkit.qwen3_decoder import draft_vocab

# Steps a chain drafts when the config does not say: speculators' default ttt_steps (SpecForge
# configs never say; sglang takes --speculative-num-steps)
DEFAULT_STEPS = 3


def parse_drafter_config(checked, raw: dict, source: str = "config", target_layers: int | None = None) -> DrafterConfig:
    """An EAGLE-3 config (validated against its declared layout) in the project's terms;
    `target_layers`, the target's layer count, resolves the layouts' default feature layers."""
    if isinstance(checked, SpeculatorsEagle3):
        return _speculators(checked, raw, source, target_layers)
    if isinstance(checked, SpecForgeEagle3):
        return _specforge(checked, raw, source, target_layers)
    raise DrafterConfigError(f"{source}: a {type(checked).__name__} config is not one of EAGLE-3's layouts")


def _speculators(checked: SpeculatorsEagle3, raw: dict, source: str, target_layers: int | None) -> DrafterConfig:
    decoder = raw["transformer_layer_config"]
    kind = decoder.get("model_type", "qwen3")
    if kind not in ("llama", "qwen3"):
        raise DrafterConfigError(
            f"{source}: field 'transformer_layer_config.model_type' is {kind!r}; specreplay scores EAGLE-3 drafters "
            f"with Llama or Qwen3 decoder layers ('llama', 'qwen3')"
        )
    stated = checked.eagle_aux_hidden_state_layer_ids
    return _config(
        decoder,
        kind,
        source,
        checked,
        target_layers,
        steps=checked.speculative_tokens or DEFAULT_STEPS,
        draft_vocab_size=checked.draft_vocab_size,
        stated=list(stated) if stated is not None else _before_ids(checked, target_layers, source),
        options=dict(
            norm_before_fc=checked.norm_before_fc,
            fc_norm=checked.fc_norm,
            norm_before_residual=checked.norm_before_residual,
            feed_post_norm=checked.norm_output,
            id_map=False,  # d2t/t2d only with a reduced vocabulary (speculators' DraftVocabMixin)
        ),
    )


def _before_ids(checked: SpeculatorsEagle3, target_layers: int, source: str) -> list[int]:
    """The default ids as speculators states them (before layer i), for messages."""
    return [i if i == target_layers else i + 1 for i in checked.feature_layers(source, target_layers)]


def _specforge(checked: SpecForgeEagle3, raw: dict, source: str, target_layers: int | None) -> DrafterConfig:
    options = checked.options
    if not options.use_aux_hidden_state:
        refuse_field(source, "eagle_config.use_aux_hidden_state", "false", "an EAGLE drafter without target aux layers")
    if checked.num_hidden_layers != 1:
        refuse_field(
            source, "num_hidden_layers", checked.num_hidden_layers, "SpecForge's EAGLE-3 has one layer (midlayer)"
        )
    if not checked.norm_output:
        refuse_field(
            source,
            "norm_output",
            "false",
            "SpecForge then trains lm_head on the un-normed hidden state, which sglang normalizes anyway",
        )
    return _config(
        raw,
        "llama",  # SpecForge's LlamaForCausalLMEagle3 is Llama layers whatever model_type says
        source,
        checked,
        target_layers,
        steps=checked.num_speculative_tokens or DEFAULT_STEPS,
        draft_vocab_size=checked.draft_vocab_size,
        stated=checked.stored_layer_ids(),
        options=dict(
            norm_before_fc=False,
            fc_norm=checked.fc_norm,
            norm_before_residual=False,
            feed_post_norm=False,  # SpecForge feeds the backbone's output back (algorithms/eagle3/model.py)
            id_map=True,  # LlamaForCausalLMEagle3 registers d2t and t2d whatever the vocabulary
        ),
    )


def _config(decoder: dict, kind: str, source: str, checked, target_layers, *, steps, draft_vocab_size, stated, options):
    """The DrafterConfig of an EAGLE-3 drafter whose decoder fields are `decoder` (`kind` layers)."""
    hf = decoder_config(decoder, kind, source)
    _check_decoder(decoder, hf, checked, source)
    check_eagle_decoder(decoder, hf, "" if checked.LAYOUT == "specforge" else "transformer_layer_config.", source)
    config = DrafterConfig(
        **decoder_shape(hf),
        block_size=steps,
        mask_token_id=None,
        target_layer_ids=checked.feature_layers(source, target_layers),
        num_target_layers=None,
        layer_types=["full_attention"] * hf.num_hidden_layers,
        sliding_window=None,
        is_causal=True,
        raw=decoder,  # what the model builds its transformers config from (eagle3_model.decoder_config)
        family="eagle3",
        layout=checked.LAYOUT,
        drafts_from_anchor=True,
        teacher_forced_block=True,
        block_conventions=False,
        family_options={"decoder": kind, **options},
        stated_layer_ids=stated,
        layer_convention=checked.CONVENTION,
    )
    config.draft_vocab_size = draft_vocab(draft_vocab_size, config.vocab_size, source)
    if checked.LAYOUT == "specforge":
        check_specforge_eagle(checked, len(config.target_layer_ids), source)
    return config


def _check_decoder(decoder: dict, hf, checked, source: str) -> None:
    """What the replay does not implement for EAGLE-3, refused by name rather than scored wrong."""
    types = decoder.get("layer_types") or []
    if "sliding_attention" in types:
        refuse_field(
            source, "layer_types", "sliding attention", "specreplay scores EAGLE-3 drafters with full attention"
        )
    if decoder.get("use_sliding_window") and decoder.get("sliding_window"):
        refuse_field(
            source,
            "sliding_window",
            f"{decoder['sliding_window']} with use_sliding_window true",
            "specreplay scores EAGLE-3 drafters with full attention",
        )
    if checked.target_hidden_size is not None and checked.target_hidden_size != hf.hidden_size:
        refuse_field(
            source,
            "target_hidden_size",
            checked.target_hidden_size,
            f"the drafter's width is {hf.hidden_size}; the target's embedding then does not fit its first layer",
        )


FAMILY = Family(
    "eagle3", parse_drafter_config, Eagle3Drafter, independent_drafts=False, tree=beam_candidates, chain_steps=True
)
