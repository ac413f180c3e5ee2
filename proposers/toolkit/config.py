"""A neural drafter's config in the project's terms, shared by every family that has one.

Each family's config.py turns its checkpoint's config.json (validated against the family's
layout.py) into a `DrafterConfig`: feature layer ids in this project's convention
(docs/layer-numbering.md), block size, mask token, widths. The toolkit's models and the neural
proposer (proposers/toolkit/neural.py) read it; nothing outside proposers/ needs to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from huggingface_hub.errors import StrictDataclassError

from pipeline.common.errors import UserError
from proposers.toolkit.conventions import REFERENCE, Conventions


class DrafterConfigError(UserError):
    """A drafter config this implementation cannot score exactly."""


@dataclass
class DrafterConfig:
    """What the replay needs to know about a drafter (parsed from its config.json)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    block_size: int
    mask_token_id: int | None  # None: the family's block holds no mask token (teacher_forced_block)
    target_layer_ids: list[int]
    num_target_layers: int | None
    layer_types: list[str]
    sliding_window: int | None
    is_causal: bool | None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    attention_bias: bool = False
    # every attention value (context and block) multiplied by it (z-lab dflash_config.attention_value_scale)
    attention_value_scale: float = 1.0
    raw: dict = field(default_factory=dict, repr=False)
    family: str = "dflash"  # detect.py's key of the family that parsed it
    layout: str = "z-lab"  # whose config.json layout it was read from (messages, run.json)
    # speculators: sliding-window layers are bidirectional inside the block when true
    sliding_non_causal: bool = False
    # z-lab `dflash_config.use_swa` over layer_types without a sliding layer: every layer windowed,
    # each keeping layer_types' causality (vLLM's and llama.cpp's reading)
    window_every_layer: bool = False
    # every block query drafts (DSpark, `sample_from_anchor`): slot k of [x_t, mask, ...] proposes
    # t + k + 1, B drafts a block; else slot 0 is the anchor and B - 1 drafts
    drafts_from_anchor: bool = False
    # every block slot after the anchor's holds the stored token there, not the mask token: each slot's
    # input is the draft before it, teacher-forced along the stored response (EAGLE-3's chain)
    teacher_forced_block: bool = False
    # the block always has block_size queries, near the budget too, and the drafts read every slot's
    # hidden state, the anchor's included, with the token before the anchor (XPress: its refiner mixes
    # a fixed B x B block and summarizes it by the mean of all B slots, so a shorter block is another
    # network)
    whole_block: bool = False
    # the block position and context offsets of Conventions apply (diagnose); False for a family whose
    # steps read its own context rows, with no block to shift (EAGLE-3)
    block_conventions: bool = True
    # the drafter reads the target's final hidden state after its final norm, made from the stored
    # pre-norm one (id L) with the norm's weight (MTP heads): the shards must hold that weight
    reads_final_norm: bool = False
    # a reduced draft vocabulary (speculators `draft_vocab_size`): its own lm_head rows and d2t
    draft_vocab_size: int | None = None
    family_options: dict = field(default_factory=dict)  # the family's own fields (DFlash2 selector, DSpark heads)
    # the feature layer ids as the checkpoint states them, in its layout's convention ("output" of
    # layer i, this project's; "before" layer i, speculators'): compatibility checks them against the target
    stated_layer_ids: list[int] | None = None
    layer_convention: str = "output"

    def layer_is_causal(self, index: int) -> bool:
        """As the reference: sliding layers are causal (unless speculators' sliding_window_non_causal)
        unless `is_causal` overrides all layers."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[index] == "sliding_attention" and not self.sliding_non_causal

    @property
    def max_drafts(self) -> int:
        """Draft tokens one full block proposes."""
        return self.depth(self.block_size)

    def block_len(self, remaining: torch.Tensor) -> torch.Tensor:
        """Block queries at anchors with `remaining` positions left in the budget: as
        `dflash_generate` truncates its block, a block never drafts past the budget's last
        position (drafts from the anchor: one query fewer for the same last draft); a `whole_block`
        family's block is never cut (its drafts past the budget are never verified)."""
        if self.whole_block:
            return torch.full_like(remaining, self.block_size)
        return (remaining - int(self.drafts_from_anchor)).clamp(min=0, max=self.block_size)

    @property
    def first_draft_slot(self) -> int:
        """The block query whose hidden state gives draft 1 (0: the anchor's own slot drafts)."""
        return 0 if self.drafts_from_anchor else 1

    def depth(self, block_len: int) -> int:
        """Drafts a block of `block_len` queries proposes."""
        return max(0, block_len - self.first_draft_slot)

    def layer_window(self, index: int) -> int | None:
        windowed = self.window_every_layer or self.layer_types[index] == "sliding_attention"
        return self.sliding_window if windowed else None

    def layer_mask_kind(self, index: int, conventions: Conventions = REFERENCE) -> tuple[bool, int | None, bool]:
        """(causal inside the block, sliding window or None, whether the window also hides later
        block keys of a bidirectional layer) of layer `index` under `conventions`."""
        window = {"configured": self.layer_window(index), "none": None, "everywhere": self.sliding_window}
        if conventions.llama_block:
            causal = bool(self.is_causal) or conventions.causal_block
            return causal, window[conventions.window], causal
        return self.layer_is_causal(index) or conventions.causal_block, window[conventions.window], True

    def scales(self, conventions: Conventions = REFERENCE) -> tuple[float, float, float | None]:
        """(input_embedding_scale, output_multiplier, final_logit_softcapping) under `conventions`."""
        if conventions.neutral_scales:
            return 1.0, 1.0, None
        return self.input_embedding_scale, self.output_multiplier, self.final_logit_softcapping

    @property
    def has_scales(self) -> bool:
        """Whether any scale differs from its neutral value (the `scales` diagnose variant)."""
        return self.scales() != (1.0, 1.0, None)


def refuse_field(source: str, field: str, value, why: str) -> None:
    """A config field whose value the replay does not implement, refused by name rather than scored wrong."""
    raise DrafterConfigError(f"{source}: field '{field}' is {value}: {why}; refusing rather than scoring it wrong")


def transformers_config(config_class: type, fields: dict, source: str, drop: tuple[str, ...] = ()):
    """transformers' `config_class` built from a config.json's `fields` (less `drop`), as the
    reference builds it, its defaults filling the rest; a field it refuses (a type or value its
    schema does not declare) is one DrafterConfigError line naming the file."""
    try:
        return config_class(**{k: v for k, v in fields.items() if k not in drop})
    except (TypeError, ValueError, StrictDataclassError) as error:
        said = " ".join(str(error).split())
        raise DrafterConfigError(f"{source}: transformers' {config_class.__name__} refuses it: {said}") from None


def decoder_shape(hf) -> dict:
    """The DrafterConfig shape fields of a transformers decoder config, as it resolves them (its
    defaults included: head_dim, num_key_value_heads)."""
    return dict(
        hidden_size=hf.hidden_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim,
        intermediate_size=getattr(hf, "intermediate_size", None),  # an all-MoE decoder has none
        vocab_size=hf.vocab_size,
        rms_norm_eps=float(hf.rms_norm_eps),
        attention_bias=bool(hf.attention_bias),
    )
