"""The XPress family's config layout, torch-free: speculators' (`speculators_model_type: "xpress"`,
models/xpress/config.py `XPressSpeculatorConfig`): DFlash's fields (proposers/toolkit/
speculators_layout.py `SpeculatorsBlock`) and the refiner's, with the reference's defaults."""

from __future__ import annotations

from typing import ClassVar, Literal

from pipeline.common.schema import Count, Positive
from proposers.toolkit.speculators_layout import SpeculatorsBlock

LABEL = "XPress"


class SpeculatorsXPress(SpeculatorsBlock):
    FAMILY: ClassVar[str] = "xpress"

    speculators_model_type: Literal["xpress"]
    xpress_rank: Positive = 256  # the refiner's low-rank width r
    xpress_mlp_ratio: Positive = 2  # its SwiGLU's hidden width is r x this
    num_jacobi_passes: Count = 6  # refine passes K at inference


LAYOUTS = (SpeculatorsXPress,)
