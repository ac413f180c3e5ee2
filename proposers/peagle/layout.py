"""The P-EAGLE family's config layout, torch-free: speculators' (`speculators_model_type: "peagle"`,
models/peagle/config.py `PEagleSpeculatorConfig`): EAGLE-3's fields (proposers/toolkit/
speculators_layout.py `SpeculatorsEagle`) and `mask_token_id`, the token the drafts after the first
read (vLLM's parallel drafting reads it as `ptd_token_id` and refuses a drafter without one)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pipeline.common.schema import Count, SchemaError
from proposers.toolkit.speculators_layout import SpeculatorsEagle

LABEL = "P-EAGLE"


class SpeculatorsPEagle(SpeculatorsEagle):
    FAMILY: ClassVar[str] = "peagle"

    speculators_model_type: Literal["peagle"]
    mask_token_id: Count | None = None
    embed_requires_grad: bool = True  # training-only: P-EAGLE trains its own embedding

    def check_complete(self, source: str) -> None:
        super().check_complete(source)
        if self.mask_token_id is None:
            raise SchemaError(
                f"{source}: missing field 'mask_token_id'; a P-EAGLE drafter drafts its tokens after the first "
                f"from its mask token (vLLM refuses a drafter without one too)"
            )


LAYOUTS = (SpeculatorsPEagle,)
