"""What a drafter family gives the rest of the project, in the project's own terms.

A family is one module of this folder (dflash.py: z-lab DFlash v1) that turns its checkpoint's
config.json into a `DrafterConfig` (feature layer ids in this project's convention,
docs/layer-numbering.md; block size, mask token, widths) and builds the model the replay
drives. detect.py picks the family from a config; checkpoint.py loads weights into the
family's model; the replay (scoring/replay/) calls only the `DraftModel` methods below.
Adding a family means adding its module, listing it in detect.py, and its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from huggingface_hub.errors import StrictDataclassError

from pipeline.common.errors import UserError
from pipeline.common.sampling import Sampling
from scoring.drafters.conventions import REFERENCE, Conventions


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
    raw: dict = field(default_factory=dict, repr=False)
    family: str = "dflash"  # detect.py's key of the family that parsed it
    layout: str = "z-lab"  # whose config.json layout it was read from (messages, run.json)
    # speculators: sliding-window layers are bidirectional inside the block when true
    sliding_non_causal: bool = False
    # every block query drafts (DSpark, `sample_from_anchor`): slot k of [x_t, mask, ...] proposes
    # t + k + 1, B drafts a block; else slot 0 is the anchor and B - 1 drafts
    drafts_from_anchor: bool = False
    # every block slot after the anchor's holds the stored token there, not the mask token: each slot's
    # input is the draft before it, teacher-forced along the stored response (EAGLE-3's chain)
    teacher_forced_block: bool = False
    # the block position and context offsets of Conventions apply (diagnose); False for a family whose
    # steps read its own context rows, with no block to shift (EAGLE-3)
    block_conventions: bool = True
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
        position (drafts from the anchor: one query fewer for the same last draft)."""
        return (remaining - int(self.drafts_from_anchor)).clamp(min=0, max=self.block_size)

    @property
    def first_draft_slot(self) -> int:
        """The block query whose hidden state gives draft 1 (0: the anchor's own slot drafts)."""
        return 0 if self.drafts_from_anchor else 1

    def depth(self, block_len: int) -> int:
        """Drafts a block of `block_len` queries proposes."""
        return max(0, block_len - self.first_draft_slot)

    def layer_window(self, index: int) -> int | None:
        return self.sliding_window if self.layer_types[index] == "sliding_attention" else None

    def layer_mask_kind(self, index: int, conventions: Conventions = REFERENCE) -> tuple[bool, int | None]:
        """(causal inside the block, sliding window or None) of layer `index` under `conventions`."""
        window = {"configured": self.layer_window(index), "none": None, "everywhere": self.sliding_window}
        return self.layer_is_causal(index) or conventions.causal_block, window[conventions.window]

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
        intermediate_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        rms_norm_eps=float(hf.rms_norm_eps),
        attention_bias=bool(hf.attention_bias),
    )


@dataclass
class Drafts:
    """What a family proposes at a chunk of anchors, teacher-forced along the stored response:
    draft j (1-based) at anchor t proposes the token at t + j, given that drafts 1..j-1 were the
    stored tokens (the only case in which draft j is ever verified)."""

    logits: torch.Tensor  # [a, D, V] scores of the draft distribution over the target vocabulary (-inf: never proposed)
    tokens: torch.Tensor | None = None  # [a, D] greedy drafts when the family's tie rule is not argmax over logits
    limit: torch.Tensor | None = None  # [a] drafts actually proposed (a confidence head's cut); None: all D


class DraftModel(Protocol):
    """What the replay asks of a drafter model (scoring/replay/anchors.py)."""

    config: DrafterConfig

    def context_kv(
        self,
        features: torch.Tensor,
        dtype=None,
        chunk_rows: int | None = None,
        *,
        tokens=None,
        embed=None,
        attention="dense",
        conventions=REFERENCE,
    ) -> list:
        """Per drafter layer, the keys and values of every context position, from target features.
        `tokens` [T] (the sample's ids), `embed` [V, H] (the target's embedding) and `attention`
        (the backend) are for a family whose context rows read the next token and attend to each
        other (EAGLE-3: eagle3_model.py, which also appends each position's last hidden state);
        `conventions` for one whose context reads the features under a convention (MTP: whether
        the target's final hidden state is read after its final norm)."""

    def __call__(self, block_embeds, anchors, context, attention, ctx_starts, conventions) -> torch.Tensor:
        """Hidden states [A, b, H] of the blocks starting at `anchors`."""

    def logits(self, hidden: torch.Tensor, lm_head: torch.Tensor, conventions: Conventions) -> torch.Tensor:
        """Draft logits [..., V] over the target's vocabulary."""

    def draft_logprob(self, logits: torch.Tensor, tokens: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """log q_j(tokens): the probability the drafter proposes `tokens` when sampling (T > 0)."""

    def drafts(self, hidden, lm_head, previous, conventions) -> Drafts:
        """The drafts of a chunk from the hidden states [a, D, H] at its draft slots; `previous`
        [a, D] is the stored token before each draft's target (the predecessor of draft j is
        the token at t + j - 1), which families with a sequential head condition on."""


@dataclass(frozen=True)
class Family:
    """One drafter family: its name in messages, how its config parses, how its model is built."""

    name: str  # e.g. "z-lab DFlash v1"
    parse_config: Callable[[Any, dict, str], DrafterConfig]  # (validated layout, raw config, source)
    build: Callable[[DrafterConfig], torch.nn.Module]
    # DDTree scores prefixes by per-position marginals: exact only for drafts that are independent
    # given the block (DFlash); a selector or Markov head makes each draft depend on the last
    trees: bool = True
    # sglang's dynamic tree (scoring/replay/eagle_tree.py): every branch drafted by its own step (EAGLE-3)
    eagle_trees: bool = False
    # parse_config takes a 4th argument, the target's layer count (None when unknown): a layout
    # whose default feature layers depend on it (EAGLE-3)
    reads_target_layers: bool = False
