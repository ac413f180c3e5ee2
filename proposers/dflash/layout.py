"""The DFlash family's config layouts, torch-free (stage 1 reads the feature layers through them):
z-lab's (proposers/toolkit/zlab_layout.py, shared with DFlash2) and speculators'
(`speculators_model_type: "dflash"`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from proposers.toolkit.speculators_layout import SpeculatorsBlock
from proposers.toolkit.zlab_layout import ZlabDFlash

LABEL = "DFlash"


class SpeculatorsDFlash(SpeculatorsBlock):
    FAMILY: ClassVar[str] = "dflash"

    speculators_model_type: Literal["dflash"]


LAYOUTS = (ZlabDFlash, SpeculatorsDFlash)
