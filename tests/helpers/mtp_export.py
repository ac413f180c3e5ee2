"""speculators' own MTP export of a target's native head (speculators 0.9.0
`convert/mtp/converter.py` `MTPConverter.convert`: the `mtp.*` tensors renamed onto
`MTPDraftModel`, loaded into it, saved with its `save_pretrained`, reloaded by its
`from_pretrained` to validate), and that model's own MTP layer, to check a replayed export against.
The converter logs through loguru, which `make setup` installs beside speculators."""

from __future__ import annotations

import os
import shutil

import torch
from safetensors.torch import load_file, save_file


def converter():
    """speculators' MTPConverter class."""
    from speculators.convert.mtp.converter import MTPConverter

    return MTPConverter


def export(target_dir: str, out: str, steps: int) -> str:
    """The target's head converted by speculators with `steps` speculative tokens, validated by
    reloading it through MTPDraftModel.from_pretrained."""
    converter()().convert(target_dir, out, base_model=target_dir, num_speculative_steps=steps, validate=True)
    return str(out)


def native_as_exported(target_dir: str) -> dict[str, torch.Tensor]:
    """The target's `mtp.*` tensors under the names the converter gives them (its own remap)."""
    remap = converter()._remap_key
    state = load_file(os.path.join(target_dir, "model.safetensors"))
    return {remap(name): tensor for name, tensor in state.items() if name.startswith("mtp.")}


def swapped_copy(export_dir: str, out: str, first: str, second: str) -> str:
    """A copy of the export with the tensors `first` and `second` exchanged: a mis-mapped export."""
    shutil.copytree(export_dir, out)
    path = os.path.join(out, "model.safetensors")
    state = load_file(path)
    state[first], state[second] = state[second], state[first]
    save_file(state, path, metadata={"format": "pt"})
    return str(out)


def draft_model(export_dir: str):
    """speculators' MTPDraftModel of the export, its verifier's embedding and lm_head loaded."""
    from speculators.models.mtp import MTPDraftModel

    return MTPDraftModel.from_pretrained(export_dir).eval()


@torch.no_grad()
def layer_output(model, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """speculators' MTP layer over rows [1, n, H] at positions 0..n-1, causal: its h' (after
    final_layernorm), through the model's own rotary embedding."""
    n = embeds.shape[1]
    positions = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    rope = model.rotary_emb(hidden, positions)
    return model.mtp_layers[0](
        hidden_states=hidden,
        token_embeddings=embeds,
        attention_mask=mask,
        position_ids=positions,
        position_embeddings=rope,
    )
