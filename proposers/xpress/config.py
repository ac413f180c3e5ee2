"""The XPress family (speculators `XPressDraftModel`): its config.json in the project's terms.

speculators' DFlash config (`transformer_layer_config`, `block_size`, `mask_token_id`,
`aux_hidden_state_layer_ids` counted before layer i: ours + 1, `sliding_window_non_causal`) plus the
refiner's `xpress_rank`, `xpress_mlp_ratio` and `num_jacobi_passes` (defaults 256, 2, 6). The model
and the inference rule are model.py's.

Refused, each by name: `sample_from_anchor` true and a reduced `draft_vocab_size` (speculators trains
both, but no engine serves XPress and this replay implements the released checkpoints' fill-in,
full-vocabulary drafter only); shards sampled at T > 0 (`check_sampling`: nothing, speculators'
code included, defines how an XPress drafter samples, its Jacobi passes refine argmax tokens).
"""

from __future__ import annotations

from pipeline.common.sampling import sampling_of
from proposers.fields.rules import check_speculators_block
from proposers.registry import Family
from proposers.toolkit.config import DrafterConfig, DrafterConfigError, refuse_field
from proposers.toolkit.qwen3_decoder import speculators_block
from proposers.xpress.layout import SpeculatorsXPress
from proposers.xpress.model import XPressDrafter

OPTIONS = ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes")


def parse_drafter_config(
    checked: SpeculatorsXPress, raw: dict, source: str = "config", target_layers: int | None = None
) -> DrafterConfig:
    """An XPress config (validated against its declared layout) in the project's terms."""
    if checked.sample_from_anchor:
        refuse_field(
            source,
            "sample_from_anchor",
            True,
            "every slot would draft from the anchor's own slot; specreplay implements XPress's fill-in layout "
            "(slot 0 the anchor, speculators' default and the released checkpoints') only",
        )
    config = speculators_block(
        checked,
        raw,
        source,
        "xpress",
        "XPress",  # speculators' XPress recipes are full-vocabulary
        whole_block=True,
        family_options={key: int(getattr(checked, key)) for key in OPTIONS},
    )
    check_speculators_block(checked, config, source)
    return config


def check_sampling(config: DrafterConfig, manifest: dict, uri: str, ckpt: str) -> None:
    """Greedy shards only: at T > 0 no rule exists for the drafter's q (see the module docstring)."""
    sampling = sampling_of(manifest.get("settings") or {})
    if not sampling.greedy:
        raise DrafterConfigError(
            f"{ckpt}: XPress drafters are scored on greedy shards only; {uri} holds responses sampled at "
            f"{sampling.describe()}, and no engine nor speculators defines how an XPress drafter samples its "
            f"drafts (its Jacobi passes refine argmax tokens). Extract with --temperature 0"
        )


FAMILY = Family("xpress", parse_drafter_config, XPressDrafter, independent_drafts=False, check_shards=check_sampling)
