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
from proposers.eagle3.model import Eagle3Drafter
from proposers.registry import Family
from proposers.toolkit.config import DrafterConfig, DrafterConfigError, refuse_field
from proposers.toolkit.eagle.config import DEFAULT_STEPS, eagle_config, parse_speculators
from proposers.toolkit.eagle.tree import beam_candidates


def parse_drafter_config(checked, raw: dict, source: str = "config", target_layers: int | None = None) -> DrafterConfig:
    """An EAGLE-3 config (validated against its declared layout) in the project's terms;
    `target_layers`, the target's layer count, resolves the layouts' default feature layers."""
    if isinstance(checked, SpeculatorsEagle3):
        return parse_speculators(checked, raw, source, target_layers, "eagle3", "EAGLE-3")
    if isinstance(checked, SpecForgeEagle3):
        return _specforge(checked, raw, source, target_layers)
    raise DrafterConfigError(f"{source}: a {type(checked).__name__} config is not one of EAGLE-3's layouts")


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
    return eagle_config(
        raw,
        "llama",  # SpecForge's LlamaForCausalLMEagle3 is Llama layers whatever model_type says
        source,
        checked,
        target_layers,
        family="eagle3",
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


FAMILY = Family(
    "eagle3", parse_drafter_config, Eagle3Drafter, independent_drafts=False, tree=beam_candidates, chain_steps=True
)
