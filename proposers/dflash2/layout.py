"""The DFlash2 family's config layouts, torch-free: z-lab's (proposers/toolkit/zlab_layout.py: a
`DFlash2DraftModel` architecture or DFlash2's keys in `dflash_config`) and speculators'
(`speculators_model_type: "dflash2"`, the DFlash2 fields at the top level with the reference's
defaults, `sliding_window_non_causal` true by default)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pipeline.common.schema import Number, Positive
from proposers.toolkit.speculators_layout import SpeculatorsBlock
from proposers.toolkit.zlab_layout import ZlabDFlash

LABEL = "DFlash2"


class SpeculatorsDFlash2(SpeculatorsBlock):
    FAMILY: ClassVar[str] = "dflash2"

    speculators_model_type: Literal["dflash2"]
    sliding_window_non_causal: bool = True
    conv_kernel_size: Positive = 2
    conv_group_size: Positive = 16
    selector_rank: Positive = 256
    selector_top_k: Positive = 16
    input_embedding_scale: Number | None = None
    output_multiplier: Number | None = None
    final_logit_softcapping: Number | None = None


LAYOUTS = (ZlabDFlash, SpeculatorsDFlash2)
