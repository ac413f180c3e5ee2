"""An MTP layer's mixture-of-experts MLP as the checkpoint names it, mapped onto transformers'
own sparse MoE block (Qwen3.5-MoE's `Qwen3_5MoeSparseMoeBlock`, Qwen3-Next's
`Qwen3NextSparseMoeBlock`: softmax top-k router, routed experts, a shared expert behind a sigmoid
gate), which the MTP layer is built from so that its arithmetic is the reference's.

Why a mapping: transformers 5 keeps the experts of a block fused, `experts.gate_up_proj`
[E, 2I, H] (each expert's gate rows, then its up rows) and `experts.down_proj` [E, H, I], and
fuses them on load (its weight conversion); checkpoints (and transformers' own save_pretrained)
name them one expert at a time, `mlp.experts.{i}.{gate,up,down}_proj.weight`. `fuse_experts`
stacks those in expert order; a checkpoint already holding the fused tensors keeps them.
`check_experts` first says, in one line naming the config field, where the checkpoint's experts
disagree with the config (their count, their widths), which a stacked shape would only hint at.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from proposers.checkpoints.files import CheckpointError

PREFIX = "layers.0.mlp."
EXPERT = re.compile(r"^layers\.0\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
FUSED = ("experts.gate_up_proj", "experts.down_proj")


def _per_expert(state: dict) -> dict[tuple[int, str], torch.Tensor]:
    """{(expert, projection): tensor} of the per-expert names in `state`."""
    found = {}
    for name, tensor in state.items():
        match = EXPERT.match(name)
        if match:
            found[(int(match.group(1)), match.group(2))] = tensor
    return found


def fuse_experts(state: dict) -> dict:
    """`state` with the per-expert tensors of layers.0's MLP stacked into transformers' fused ones."""
    experts = _per_expert(state)
    if not experts:
        return state
    out = {name: tensor for name, tensor in state.items() if not EXPERT.match(name)}
    count = 1 + max(index for index, _ in experts)
    gate_up = [torch.cat([experts[(i, "gate_proj")], experts[(i, "up_proj")]], dim=0) for i in range(count)]
    out[PREFIX + FUSED[0]] = torch.stack(gate_up)
    out[PREFIX + FUSED[1]] = torch.stack([experts[(i, "down_proj")] for i in range(count)])
    return out


class ExpertFields(NamedTuple):
    """How a config names an MoE layer's experts: the routed count (its field and value), each
    expert's width, the shared expert's module and width, and the field that sets that width."""

    count_field: str
    count: int
    width: int
    shared: str  # the shared expert's module under the MLP
    shared_field: str
    shared_said: object  # that field's value
    shared_width: int


def qwen_fields(hf) -> ExpertFields:
    """Qwen3-Next's and Qwen3.5-MoE's names (`num_experts`, `mlp.shared_expert`)."""
    shared = hf.shared_expert_intermediate_size
    return ExpertFields(
        "num_experts", hf.num_experts, hf.moe_intermediate_size, "shared_expert", "shared_expert_intermediate_size",
        shared, shared,
    )  # fmt: skip


def check_experts(
    state: dict, hf, name: str, source: str, config_file: str, fields: ExpertFields | None = None
) -> None:
    """The checkpoint's experts against the config `hf` (transformers' resolved decoder config),
    named as `fields` says (Qwen's by default): every expert 0..count-1 present with all three
    projections, each [width, H] (down_proj [H, width]), the shared expert shared_width wide.
    `name` spells the layer's MLP as the file does (`mtp.layers.0.mlp.`)."""
    fields = fields or qwen_fields(hf)
    parts = _per_expert(state)  # (expert, projection) -> tensor, the per-expert names
    experts = {index for index, _ in parts}
    stacked = state.get(PREFIX + FUSED[0])
    fused = None if stacked is None else int(stacked.shape[0])
    count, width, hidden = fields.count, fields.width, hf.hidden_size
    fix = f"use the config.json saved with this checkpoint ({config_file})"
    if fused is not None and fused != count:
        _refuse(source, f"{name}{FUSED[0]} holds {fused} experts", fields.count_field, count, fix)
    if fused is None and experts != set(range(count)):
        held = f"experts {_span(experts)}" if experts else "no expert tensors"
        _refuse(source, f"{name}experts.* holds {held}", fields.count_field, count, fix)
    missing = sorted({(i, p) for i in experts for p in ("gate_proj", "up_proj", "down_proj")} - set(parts))
    if missing:
        index, projection = missing[0]
        said = f"{name}experts.{index}.{projection}.weight is missing ({len(missing)} expert tensors in all)"
        raise CheckpointError(
            f"{source}: {said}, of the {count} experts the config's field '{fields.count_field}' says; "
            "the checkpoint is incomplete: save it again"
        )
    for (index, projection), tensor in sorted(parts.items()):
        shape = [hidden, width] if projection == "down_proj" else [width, hidden]
        if list(tensor.shape) != shape:
            said = f"{name}experts.{index}.{projection}.weight is {list(tensor.shape)}, not {shape}"
            _refuse(source, said, "moe_intermediate_size", width, fix)
    shared = state.get(f"{PREFIX}{fields.shared}.gate_proj.weight")
    if shared is not None and shared.shape[0] != fields.shared_width:
        said = f"{name}{fields.shared}.gate_proj.weight has {shared.shape[0]} rows"
        _refuse(source, said, fields.shared_field, fields.shared_said, fix)


def _span(indices: set[int]) -> str:
    ordered = sorted(indices)
    runs = ordered == list(range(ordered[0], ordered[-1] + 1))
    return f"{ordered[0]}..{ordered[-1]} ({len(ordered)})" if runs else ", ".join(map(str, ordered))


def _refuse(source: str, said: str, field: str, value, fix: str) -> None:
    raise CheckpointError(f"{source}: {said}, but the config's field '{field}' is {value}; {fix}")
