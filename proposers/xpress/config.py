"""The XPress family: its config layouts (layout.py) in the project's terms.

speculators' (`XPressDraftModel`): its DFlash config (`transformer_layer_config`, `block_size`,
`mask_token_id`, `aux_hidden_state_layer_ids` counted before layer i: ours + 1,
`sliding_window_non_causal`) plus the refiner's `xpress_rank`, `xpress_mlp_ratio` and
`num_jacobi_passes` (defaults 256, 2, 6); its refiner's slot 0 reads x_{t-1}, every pass over the
whole vocabulary. vLLM's (`Qwen3XPressModel`): a z-lab DFlash config plus `xpress_rank`,
`xpress_mlp_hidden`, `xpress_num_passes`, `xpress_topc` (defaults 256, 512, 6, 512); its slot 0
reads the anchor, each pass's argmax over the base logits' top-C tokens. The model and the
inference rule are model.py's.

Refused, each by name: `sample_from_anchor` true and a reduced `draft_vocab_size` (speculators trains
both, vLLM refuses both: qwen3_xpress.py:296-302, xpress/speculator.py:30-36); an `xpress_block_size`
other than the DFlash block; shards sampled at T > 0 (`check_sampling`: vLLM's XPress drafts
greedily, `jacobi_refine_greedy`, and nothing defines an XPress drafter's q).
"""

from __future__ import annotations

from pipeline.common.sampling import sampling_of
from proposers.fields.rules import check_speculators_block, check_zlab
from proposers.registry import Family
from proposers.toolkit.config import DrafterConfig, DrafterConfigError, refuse_field
from proposers.toolkit.qwen3_decoder import speculators_block, zlab_block_fields
from proposers.xpress.layout import SpeculatorsXPress, VllmXPress
from proposers.xpress.model import XPressDrafter

VLLM_MIXER = 16  # the refiner's mixer when xpress_block_size is absent (num_speculative_steps 15 + 1)
DEFAULT_TOPC = 512  # vLLM's when the config states none (qwen3_xpress.py:263), at most the vocabulary
SERVED = "vLLM refuses it for XPress (its refiner is trained and served in the fill-in layout)"


def parse_drafter_config(checked, raw: dict, source: str = "config", target_layers: int | None = None) -> DrafterConfig:
    """An XPress config (validated against its declared layout) in the project's terms."""
    if isinstance(checked, VllmXPress):
        return _vllm(checked, raw, source)
    if not isinstance(checked, SpeculatorsXPress):
        raise DrafterConfigError(f"{source}: a {type(checked).__name__} config is not one of XPress's layouts")
    if checked.sample_from_anchor:
        refuse_field(source, "sample_from_anchor", True, f"every slot would draft from the anchor's own slot; {SERVED}")
    options = {
        "xpress_rank": checked.xpress_rank,
        "xpress_mlp_hidden": checked.xpress_rank * checked.xpress_mlp_ratio,
        "num_jacobi_passes": checked.num_jacobi_passes,
        "top_c": 0,  # speculators' passes score the whole vocabulary
        "slot0_reads": "before",  # x_{t-1}, as its training reads it
    }
    config = speculators_block(checked, raw, source, "xpress", "XPress", whole_block=True, family_options=options)
    check_speculators_block(checked, config, source)
    return config


def _vllm(checked: VllmXPress, raw: dict, source: str) -> DrafterConfig:
    if checked.sample_from_anchor:
        refuse_field(source, "sample_from_anchor", True, SERVED)
    options = {
        "xpress_rank": checked.xpress_rank,
        "xpress_mlp_hidden": checked.xpress_mlp_hidden,
        "num_jacobi_passes": checked.xpress_num_passes,
        "top_c": DEFAULT_TOPC if checked.xpress_topc is None else checked.xpress_topc,
        "slot0_reads": "anchor",  # the anchor stands in for its predecessor (speculator.py:86-91)
    }
    fields = zlab_block_fields(checked, raw, source)
    config = DrafterConfig(**fields, family="xpress", layout="vllm", whole_block=True, family_options=options)
    check_zlab(checked, config, source)
    block = checked.xpress_block_size or VLLM_MIXER  # absent: vLLM's mixer is 16 slots (qwen3_xpress.py:258-259)
    if block != config.block_size:
        refuse_field(source, "xpress_block_size", checked.xpress_block_size, f"vLLM sizes the refiner's mixer "
                     f"{block} slots and cannot serve it with a block of {config.block_size}; set it to block_size")  # fmt: skip
    if checked.xpress_topc is not None and checked.xpress_topc > config.vocab_size:
        refuse_field(source, "xpress_topc", checked.xpress_topc, f"vLLM refuses a top-C above the vocabulary "
                     f"({config.vocab_size}): vllm/config/speculative.py:1623-1638")  # fmt: skip
    return config


def check_sampling(config: DrafterConfig, manifest: dict, uri: str, ckpt: str) -> None:
    """Greedy shards only: at T > 0 no rule exists for the drafter's q (see the module docstring)."""
    sampling = sampling_of(manifest.get("settings") or {})
    if not sampling.greedy:
        raise DrafterConfigError(
            f"{ckpt}: XPress drafters are scored on greedy shards only; {uri} holds responses sampled at "
            f"{sampling.describe()}, and neither vLLM (its XPress drafts greedily) nor speculators defines how an "
            f"XPress drafter samples its drafts (its Jacobi passes refine argmax tokens). Extract with --temperature 0"
        )


FAMILY = Family("xpress", parse_drafter_config, XPressDrafter, independent_drafts=False, check_shards=check_sampling)
