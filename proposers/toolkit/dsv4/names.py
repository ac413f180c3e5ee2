"""DeepSeek's checkpoint names of a DeepSeek-V4 block under `mtp.{i}.*` (the names vLLM's load_weights
and llama.cpp's converter read: conversion/deepseek.py:810-878) -> transformers' module names
(DeepseekV4DecoderLayer's; conversion_mapping.py "deepseek_v4"), shared by every family whose blocks
are DeepSeek-V4's (DSpark's stages, the MTP head)."""

from __future__ import annotations

import torch

BLOCK = {
    "attn.wq_a.": "self_attn.q_a_proj.", "attn.q_norm.": "self_attn.q_a_norm.", "attn.wq_b.": "self_attn.q_b_proj.",
    "attn.wkv.": "self_attn.kv_proj.", "attn.kv_norm.": "self_attn.kv_norm.", "attn.wo_a.": "self_attn.o_a_proj.",
    "attn.wo_b.": "self_attn.o_b_proj.", "attn.attn_sink": "self_attn.sinks", "attn_norm.": "input_layernorm.",
    "ffn_norm.": "post_attention_layernorm.", "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale", "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale", "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias", "ffn.shared_experts.w1.": "mlp.shared_experts.gate_proj.",
    "ffn.shared_experts.w3.": "mlp.shared_experts.up_proj.", "ffn.shared_experts.w2.": "mlp.shared_experts.down_proj.",
}  # fmt: skip


def renamed(rest: str, table: dict) -> str | None:
    """`rest` with its prefix in `table` replaced; None when no prefix of the table starts it."""
    own = next((prefix for prefix in table if rest.startswith(prefix)), None)
    return None if own is None else table[own] + rest[len(own) :]


def mtp_tensors(state: dict, root: dict):
    """Yield (stage, its name under this model's names or None for a routed expert's, tensor) of the
    `mtp.{i}.*` tensors, the vision-only `ffn.gate.bias_vl` dropped (conversion/deepseek.py:1010-1015);
    names in `root` go to the model's root, the rest to `layers.{i}.` under BLOCK's names."""
    for name, tensor in state.items():
        parts = name.split(".", 2)
        if len(parts) < 3 or parts[0] != "mtp" or not parts[1].isdecimal() or parts[2].endswith("gate.bias_vl"):
            continue
        stage, rest = parts[1], parts[2]
        if rest.startswith("ffn.experts."):
            yield stage, rest, tensor
            continue
        own = renamed(rest, root)
        yield stage, own if own is not None else f"layers.{stage}." + (renamed(rest, BLOCK) or rest), tensor


def dsv4_state(state: dict, root: dict) -> dict:
    """The `mtp.{i}.*` tensors under this model's names (mtp_tensors), each stage's routed experts
    stacked as transformers' DeepseekV4Experts holds them (gate_up = [w1 ; w3])."""
    out, experts = {}, {}
    for stage, name, tensor in mtp_tensors(state, root):
        if name.startswith("ffn.experts."):
            _, _, expert, which, _ = name.split(".")
            experts.setdefault(stage, {}).setdefault(which, {})[int(expert)] = tensor
            continue
        out[name] = tensor
    for stage, by in experts.items():
        rows = range(len(by.get("w2", {})))
        out[f"layers.{stage}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by["w1"][e], by["w3"][e]]) for e in rows]
        )
        out[f"layers.{stage}.mlp.experts.down_proj"] = torch.stack([by["w2"][e] for e in rows])
    return out
