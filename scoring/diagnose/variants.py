"""The named variants `specreplay diagnose` replays: one convention changed at a time.

Each variant is a `Conventions` (proposers/toolkit/conventions.py) or a compute dtype, when it applies to
a drafter, and the sentence a user acts on when it beats the checkpoint's own configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from proposers.toolkit.config import DrafterConfig
from proposers.toolkit.conventions import Conventions
from scoring.results import CONFIGURED_VARIANT as CONFIGURED


@dataclass(frozen=True)
class Variant:
    name: str
    change: str  # what is replayed differently, as the verdict says it: "tau 2.87 with <change>"
    finding: str  # what it means when this variant scores better: the action to take
    conventions: Conventions = field(default_factory=Conventions)
    dtype: torch.dtype | None = None  # compute dtype instead of the run's (bf16); None = the run's
    convention: bool = True  # False: a numerics probe, never a verdict's cause
    rope_base: float | None = None  # the drafter's RoPE built with this base, whatever its config says


CONVENTION_VARIANT = "layers-convention"
EAGLE_REPOSITORY_ROPE_BASE = 10000.0  # cnets.py's LlamaRotaryEmbedding default, rope_theta never read


def _variants() -> list[Variant]:  # 113 lines: a table, one entry per variant
    fix = "fix the training code or the evaluation, not the weights"
    return [
        Variant(CONFIGURED, "the checkpoint's config, the reference conventions", ""),
        Variant(
            "positions+1",
            "block position ids starting at t + 1",
            f"the checkpoint was trained with block position ids one higher than the reference uses — {fix}",
            Conventions(block_position_offset=1),
        ),
        Variant(
            "positions-1",
            "block position ids starting at t - 1",
            f"the checkpoint was trained with block position ids one lower than the reference uses — {fix}",
            Conventions(block_position_offset=-1),
        ),
        Variant(
            "context+1",
            "the context covering positions 0..t (the anchor's own feature too)",
            "the checkpoint was trained seeing the anchor's own target feature, which an online step does not "
            f"have yet (context one position too long) — {fix}",
            Conventions(context_offset=1),
        ),
        Variant(
            "context-1",
            "the context covering positions 0..t-2",
            f"the checkpoint was trained with the context one position shorter than the reference's — {fix}",
            Conventions(context_offset=-1),
        ),
        Variant(
            CONVENTION_VARIANT,
            "the feature layer ids read in the other convention (output of layer i vs the residual entering it)",
            "the checkpoint's feature layer ids are counted in the other convention from the one its config "
            "layout declares (z-lab and SpecForge count the output of layer i, speculators and vLLM the residual "
            "entering layer i, one higher): it was exported with the other layout's ids — fix the ids in its "
            "config.json, not the weights",
        ),  # its layer offset depends on the checkpoint's layout: for_checkpoint
        Variant(
            "layers-1",
            "every feature layer id one lower (hidden_states[i] instead of [i + 1])",
            "the checkpoint was trained on features one layer lower (hidden_states[i] instead of hidden_states[i + 1]) "
            f"— {fix}, or set target_layer_ids one lower in its config",
            Conventions(layer_offset=-1),
        ),
        Variant(
            "layers+1",
            "every feature layer id one higher (hidden_states[i + 2])",
            f"the checkpoint was trained on features one layer higher — {fix}, or set target_layer_ids one higher "
            "in its config",
            Conventions(layer_offset=1),
        ),
        Variant(
            "no-window",
            "the sliding-attention layers' window dropped",
            "the checkpoint was trained without the sliding window its config declares (a backend that ignores "
            "sliding_window, such as the SDPA path on CPU) — fix the training attention or drop the window from "
            "the config",
            Conventions(window="none"),
        ),
        Variant(
            "window-everywhere",
            "the config's sliding window on every layer",
            "the checkpoint was trained with the sliding window on every layer — fix layer_types in the config "
            "or the training attention",
            Conventions(window="everywhere"),
        ),
        Variant(
            "causal-block",
            "the block attending causally inside itself",
            "the checkpoint was trained with a causal mask inside the block, where the reference drafter is "
            "bidirectional (a flex_attention / SDPA mask mismatch) — fix the training mask, or set is_causal in "
            "the config if causal is intended",
            Conventions(causal_block=True),
        ),
        Variant(
            "scales",
            "input_embedding_scale, output_multiplier and softcapping at 1 (none)",
            "the checkpoint was trained without the embedding/output scales its config declares — fix the config "
            "or the training code",
            Conventions(neutral_scales=True),
        ),
        Variant(
            "mtp-prenorm",
            "the MTP head reading the target's final hidden state before its final norm",
            "the MTP head was trained on the target's final hidden state before the final norm (speculators' "
            "training data), while vLLM serves it the state after the norm — train it on the post-norm state, "
            "or serve it the pre-norm one",
            Conventions(prenorm_hidden=True),
        ),
        Variant(
            "xpress-slot0",
            "XPress's refiner reading the other token before its anchor slot (x_{t-1} vs the anchor x_t)",
            "the XPress refiner was trained reading the other token before the anchor's slot than the engine "
            "serving it reads: speculators trains on x_{t-1}, vLLM serves it the anchor x_t — serve it as trained, "
            "or score the layout it is served in",
            Conventions(xpress_other_slot0=True),
        ),
        Variant(
            "nextn-feed-normed",
            "a NextN head's step output fed back after its shared_head.norm",
            "the NextN head was trained feeding each step's normed output to the next, as llama.cpp serves it "
            "(--walk-rule llama.cpp replays that), while vLLM feeds back the output before shared_head.norm",
            Conventions(nextn_feed_normed=True),
        ),
        Variant(
            "mimo-chain-heads",
            "MiMo's MTP heads chained as llama.cpp runs them: step k on head k, states fed on before the norms",
            "the MiMo MTP heads were trained chained, step k on head k fed pre-norm states, as llama.cpp serves "
            "them (--walk-rule llama.cpp replays that), while vLLM serves head 0 alone at every step",
            Conventions(chain_heads=True),
        ),
        Variant(
            "nextn-first-head",
            "a stack of NextN heads run as vLLM's V1 model runner runs it: head 0 at every step",
            "the stack of NextN heads scores as vLLM's V1 model runner serves it (head 0's chain at every step), "
            "not as its default V2 runner does (step j on head j): serve it with VLLM_USE_V2_MODEL_RUNNER=0, or "
            "the heads were not trained as a stack",
            Conventions(first_head_only=True),
        ),
        Variant(
            "rope-10000",
            "the drafter's RoPE with base 10000 whatever its rope_theta",
            "the checkpoint was trained with RoPE base 10000 (the EAGLE repository's cnets.py builds no other) while "
            "its config states another rope_theta, which vLLM and SGLang read — set rope_theta to 10000 in its "
            "config.json",
            rope_base=EAGLE_REPOSITORY_ROPE_BASE,
        ),
        Variant(
            "bf16",
            "the drafter computed in bf16",
            "acceptance changes with the compute precision: the checkpoint is numerically sensitive (not a "
            "convention mismatch)",
            dtype=torch.bfloat16,
            convention=False,
        ),
    ]


VARIANTS = {v.name: v for v in _variants()}


def for_checkpoint(variant: Variant, config: DrafterConfig) -> Variant:
    """`variant` as replayed for a drafter of `config`: `layers-convention` reads a before-layer
    (speculators) id i as the output of layer i, one layer deeper than the project's i - 1, and
    an output-of-layer (z-lab) id i as the residual entering layer i, one shallower."""
    if variant.name != CONVENTION_VARIANT:
        return variant
    return replace(variant, conventions=Conventions(layer_offset=1 if config.layer_convention == "before" else -1))


def same_replay(variant: Variant, other: Variant) -> bool:
    """Two variants that replay identically (layers-convention is layers-1 or layers+1 made
    concrete for one checkpoint): only one of them needs measuring."""
    return (variant.conventions, variant.dtype, variant.rope_base) == (other.conventions, other.dtype, other.rope_base)


def not_applicable(variant: Variant, config: DrafterConfig) -> str | None:
    """Why `variant` changes nothing for a drafter of `config` (None when it applies)."""
    has_window = config.sliding_window is not None
    sliding = "sliding_attention" in config.layer_types
    shifts = variant.conventions.block_position_offset or variant.conventions.context_offset
    if shifts and not config.block_conventions:
        return "the family drafts step by step from its own context rows: no block to shift"
    if variant.name == "no-window" and not sliding:
        return "no sliding-attention layer"
    if variant.name == "window-everywhere" and (
        not has_window or not (set(config.layer_types) - {"sliding_attention"})
    ):
        return "no sliding window to spread" if not has_window else "every layer already has the window"
    if variant.name == "causal-block" and all(config.layer_is_causal(i) for i in range(config.num_hidden_layers)):
        return "every layer is already causal"
    if variant.conventions.prenorm_hidden and not config.reads_final_norm:
        return "only MTP heads read the target's final hidden state"
    if variant.conventions.xpress_other_slot0 and config.family != "xpress":
        return "only XPress has a refiner"
    if variant.conventions.nextn_feed_normed and not config.family_options.get("feeds_pre_norm"):
        return "only a GLM-4.5 NextN head's engines disagree on the state fed back"
    if variant.conventions.chain_heads and config.layout != "mimo":
        return "only MiMo-V2-Flash's MTP heads are chained"
    if variant.conventions.first_head_only and not (
        config.layout == "nextn" and config.family_options.get("heads", 1) > 1
    ):
        return "only a stack of NextN heads runs a head a step"
    if variant.name == "scales" and not config.has_scales:
        return "the config sets no scale"
    return None


def rope_base(drafter) -> float | None:
    """The base of the drafter's own rotary embedding (transformers' module keeps its config), None
    when it has none."""
    rotary = getattr(drafter, "rotary", None)
    parameters = getattr(getattr(rotary, "config", None), "rope_parameters", None) or {}
    return parameters.get("rope_theta")


def with_rope_base(drafter, base: float):
    """A copy of the drafter whose rotary embedding is rebuilt with RoPE base `base` (the variant's
    replay; the weights are shared, RoPE has none)."""
    import copy

    changed = copy.copy(drafter)  # a shallow module copy: the same parameters, its own attribute table
    changed._modules = dict(drafter._modules)
    config = copy.deepcopy(drafter.rotary.config)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": base}
    changed.rotary = type(drafter.rotary)(config).to(drafter.rotary.inv_freq.device)
    return changed


def missing_layers(variant: Variant, config: DrafterConfig, stored: list[int]) -> list[int]:
    """Feature layer ids `variant` reads that the shards do not store."""
    wanted = [i + variant.conventions.layer_offset for i in config.target_layer_ids]
    return [i for i in wanted if i not in stored]


def parse_variants(text: str | None) -> list[str]:
    """'--variants positions+1,bf16' -> [as-configured, positions+1, bf16]; None = every variant."""
    if not text:
        return list(VARIANTS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        from pipeline.common.errors import UserError

        raise UserError(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    return [CONFIGURED] + [n for n in names if n != CONFIGURED]
