"""The XPress family's config layouts, torch-free.

* speculators (`speculators_model_type: "xpress"`, models/xpress/config.py `XPressSpeculatorConfig`):
  DFlash's fields (proposers/toolkit/speculators_layout.py `SpeculatorsBlock`) and the refiner's,
  with the reference's defaults.
* vLLM's own (`"architectures": ["Qwen3XPressModel"]`, or `DFlashQwen3XPressModel` as its EAGLE
  config renames it: vllm/config/speculative.py:95-98, model_executor/models/registry.py:686-687):
  a z-lab DFlash config (proposers/toolkit/zlab_layout.py) with the refiner's `xpress_*` keys beside
  it, read with vLLM's defaults (model_executor/models/qwen3_xpress.py:255-264,
  v1/worker/gpu/spec_decode/xpress/speculator.py:30-40). vLLM's speculators converter has no XPress
  (transformers_utils/configs/speculators/algos.py): this is the layout it serves.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pipeline.common.schema import Count, Positive
from proposers.toolkit.speculators_layout import SpeculatorsBlock
from proposers.toolkit.zlab_layout import ZlabDFlash

LABEL = "XPress"
VLLM_ARCHITECTURES = ("Qwen3XPressModel", "DFlashQwen3XPressModel")


class SpeculatorsXPress(SpeculatorsBlock):
    FAMILY: ClassVar[str] = "xpress"

    speculators_model_type: Literal["xpress"]
    xpress_rank: Positive = 256  # the refiner's low-rank width r
    xpress_mlp_ratio: Positive = 2  # its SwiGLU's hidden width is r x this
    num_jacobi_passes: Count = 6  # refine passes K at inference


class VllmXPress(ZlabDFlash):
    LAYOUT: ClassVar[str] = "vllm"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = VLLM_ARCHITECTURES

    xpress_rank: Positive = 256  # the refiner's low-rank width r
    xpress_mlp_hidden: Positive = 512  # its SwiGLU's hidden width
    xpress_num_passes: Count = 6  # Jacobi passes K
    xpress_topc: Count | None = None  # each pass's argmax over the top-C base logits (absent: 512); 0: all
    xpress_block_size: Positive | None = None  # the mixer's block; vLLM's default: the drafts + 1
    xpress_compile_head: bool | None = None  # torch.compile of the refiner: bookkeeping

    @property
    def family(self) -> str:
        return "xpress"

    @property
    def evidence(self) -> str:
        found = next(a for a in self.architectures or () if a in VLLM_ARCHITECTURES)
        return f"architectures ['{found}']"


LAYOUTS = (SpeculatorsXPress, VllmXPress)
