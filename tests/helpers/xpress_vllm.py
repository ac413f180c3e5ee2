"""vLLM's XPress for the tests, rule by rule from vLLM 0.33.0's source (nothing of it runs on CPU:
its refiner passes are Triton kernels): its checkpoint layout (`vllm_layout`) and its greedy
refiner (`refine`), never specreplay's code.

The layout (vllm/config/speculative.py:95-98, model_executor/models/qwen3_xpress.py:240-358): a
z-lab DFlash checkpoint (tests/helpers/family_fits.py `zlab_layout`) whose architecture is
`Qwen3XPressModel`, the refiner's keys `xpress_rank`, `xpress_mlp_hidden`, `xpress_num_passes`,
`xpress_topc` in its config.json, and the refiner's tensors under vLLM's checkpoint names
(`HYBRID_KEY_MAP`: `xpress_head.w1`, `mix.L` raw, `mlp.gate_proj`, ..., `w2`).

The refiner (qwen3_xpress.py `XPressRefinerHead`; the speculator's call,
v1/worker/gpu/spec_decode/xpress/speculator.py:79-95):
- the mixer folded from the raw one, L * tril + I (`fold_from_raw_`, 86-94);
- the hidden cache [down_h(h) ; down_g(mean of h over the block)], once per step (`hidden_cache`, 96-100);
- blk[0] = the anchor, blk[1:] = argmax of the base logits (125-141); each slot b reads blk[b - 1],
  slot 0 the anchor id standing in for its predecessor (`tok_am1 = anchor_ids`, speculator.py:88-91;
  kernels.py `_xpress_latent_kernel`);
- a pass: lat = w1(prev), x = in_proj([hcache ; lat]), x = mix_L x per channel, x + SwiGLU MLP(x)
  (`_refine_latent`, 102-110); blk[1:] = argmax of base + w2(x) at slots 1.., over the base logits'
  top-C tokens when C > 0 (142-189), else the whole vocabulary (191-207).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from tests.helpers.family_fits import zlab_layout

ARCHITECTURE = "Qwen3XPressModel"
# speculators' refiner names -> vLLM's checkpoint names (qwen3_xpress.py HYBRID_KEY_MAP's keys)
TO_VLLM = {
    "token_embed.": "w1.",
    "mix_l": "mix.L",
    "mlp_gate.": "mlp.gate_proj.",
    "mlp_up.": "mlp.up_proj.",
    "mlp_down.": "mlp.down_proj.",
    "readout.": "w2.",
}


def _vllm_name(name: str) -> str:
    if not name.startswith("refiner_head."):
        return name
    rest = name[len("refiner_head.") :]
    own = next((k for k in TO_VLLM if rest.startswith(k)), None)
    return "xpress_head." + (TO_VLLM[own] + rest[len(own) :] if own else rest)


def vllm_layout(speculators_dir: str, out_dir, num_target_layers: int, *, topc: int | None) -> str:
    """The speculators XPress checkpoint in vLLM's layout: z-lab's config and backbone tensors, the
    refiner's keys and tensors under vLLM's names; `xpress_topc` = `topc`, or absent (None)."""
    zlab_layout(speculators_dir, out_dir, num_target_layers)
    spec = json.loads(open(os.path.join(speculators_dir, "config.json")).read())
    path = os.path.join(out_dir, "config.json")
    config = json.loads(open(path).read())
    config.update(
        architectures=[ARCHITECTURE],
        xpress_rank=spec["xpress_rank"],
        xpress_mlp_hidden=spec["xpress_rank"] * spec["xpress_mlp_ratio"],
        xpress_num_passes=spec["num_jacobi_passes"],
        xpress_block_size=spec["block_size"],  # absent, vLLM's mixer is 16 slots
    )
    if topc is not None:
        config["xpress_topc"] = topc
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    weights = os.path.join(out_dir, "model.safetensors")
    save_file({_vllm_name(name): t for name, t in load_file(weights).items()}, weights)
    return str(out_dir)


def refiner(ckpt: str) -> dict:
    """vLLM's refiner weights as its loader leaves them: its tensors by their checkpoint names
    (`xpress_head.` dropped), the mixer folded (`fold_from_raw_`)."""
    prefix = "xpress_head."
    tensors = load_file(f"{ckpt}/model.safetensors")
    head = {k[len(prefix) :]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
    raw = head.pop("mix.L")
    block = raw.shape[-1]
    head["mix_L"] = raw * torch.tril(torch.ones(block, block)) + torch.eye(block)
    return head


def _latent(head: dict, prev: torch.Tensor, hcache: torch.Tensor) -> torch.Tensor:
    """[B, r]: qwen3_xpress.py `_refine_latent` for one block."""
    x = F.linear(torch.cat([hcache, F.embedding(prev, head["w1.weight"])], dim=-1), head["in_proj.weight"])
    x = torch.bmm(head["mix_L"], x.T[:, :, None])[:, :, 0].T  # per channel c: x[:, c] <- mix_L[c] @ x[:, c]
    gate = F.silu(F.linear(x, head["mlp.gate_proj.weight"])) * F.linear(x, head["mlp.up_proj.weight"])
    return x + F.linear(gate, head["mlp.down_proj.weight"])


@torch.no_grad()
def refine(
    head: dict, hidden: torch.Tensor, base: torch.Tensor, anchor: int, passes: int, topc: int | None
) -> list[int]:
    """The B - 1 drafts of one block (hidden [B, H], base logits [B, V]) by vLLM's greedy refiner."""
    hcache = torch.cat(
        [F.linear(hidden, head["down_h.weight"]), F.linear(hidden.mean(0).expand_as(hidden), head["down_g.weight"])],
        dim=-1,
    )
    blk = torch.cat([torch.tensor([anchor]), base[1:].argmax(-1)])
    topc = 512 if topc is None else topc  # absent: qwen3_xpress.py:263's default
    c = min(topc, base.shape[-1])  # jacobi_refine_greedy's min(self.topc, v)
    candidates = base[1:].topk(c, dim=-1).indices if topc else None
    for _ in range(passes):
        prev = torch.cat([torch.tensor([anchor]), blk[:-1]])  # slot 0: the anchor stands in for x_{t-1}
        logits = base[1:] + F.linear(_latent(head, prev, hcache)[1:], head["w2.weight"])
        if candidates is None:
            blk[1:] = logits.argmax(-1)
        else:
            blk[1:] = candidates.gather(-1, logits.gather(-1, candidates).argmax(-1, keepdim=True))[:, 0]
    return blk[1:].tolist()
