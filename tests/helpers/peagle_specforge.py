"""SpecForge's P-EAGLE for the tests, from its public code only (PyPI specforge 0.2.0, installed
--no-deps): its own `PEagleDraftModel` (specforge/modeling/draft/peagle.py) built from a LlamaConfig,
its weights set, saved by its own save_pretrained (`save`), and its own forward run over every
anchor of a sequence at once (`reference_logits`).

SpecForge's checkpoint names its tensors as speculators' P-EAGLE does (`layers.0.hidden_norm`, ...,
`mask_hidden`), so a fitted speculators drafter's weights load into it as they are (`from_weights`).
Its saved config.json states neither the mask token (SpecForge resolves one at training time) nor,
with the default capture, the feature ids: `save` adds both as a user serving it with vLLM must.
"""

from __future__ import annotations

import json

import torch

from tests.helpers.eagle3_reference import decoder_config

ARCHITECTURE = "PEagleDraftModel"


def new_model(*, vocab: int, hidden: int, layers: int = 1, norm_before_residual: bool = False):
    """SpecForge's PEagleDraftModel for the tiny widths (its Llama layers, the whole vocabulary)."""
    from specforge.modeling.draft.peagle import PEagleDraftModel

    config = decoder_config("llama", vocab=vocab, hidden=hidden, layers=layers)
    config.draft_vocab_size = vocab
    return PEagleDraftModel(config, norm_before_residual=norm_before_residual).eval()


def from_weights(model, state: dict):
    """`model` with every tensor it shares with `state` (a fitted speculators P-EAGLE's) copied in;
    each of its own learned weights must be there (t2d/d2t keep SpecForge's identity mapping)."""
    own = model.state_dict()
    learned = [name for name in own if name not in ("t2d", "d2t")]
    missing = [name for name in learned if name not in state]
    assert not missing, missing
    model.load_state_dict({**own, **{name: state[name] for name in learned}})
    return model


def save(model, out_dir: str, *, mask_token: int, aux_ids, steps: int) -> str:
    """Saved by SpecForge's own save_pretrained, then the mask token and before-layer feature ids
    added to its config.json (the keys vLLM reads them from), and `steps` drafts a step (this
    project's `num_speculative_tokens`; vLLM takes it from its serving flags)."""
    model.save_pretrained(out_dir)
    path = f"{out_dir}/config.json"
    config = json.loads(open(path).read())
    config["mask_token_id"] = mask_token
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    config["num_speculative_tokens"] = steps
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def _rows(T: int, anchors: list[int], depths: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor_pos, depth) of every row: depth 0 at rows 0..T-2 (row s reads x_{s+1}, g_s), then
    per anchor t (x_t the last committed token) its rollout of depths 1..k-1 from row t - 1, k =
    `depths` or fewer where it would run past the sequence."""
    ks = [min(depths, T - t) for t in anchors]
    anchor_pos = torch.cat([torch.arange(T - 1)] + [torch.full((k - 1,), t - 1) for t, k in zip(anchors, ks)])
    depth = torch.cat([torch.zeros(T - 1, dtype=torch.long)] + [torch.arange(1, k) for k in ks])
    return anchor_pos, depth


def _block_mask(anchor_pos: torch.Tensor, depth: torch.Tensor):
    """SpecForge's P-EAGLE attention (algorithms/peagle/model.py `create_peagle_mask_mod`, one
    document): a row sees the depth-0 rows of anchors up to its own and its own rollout's rows of
    lower or equal depth."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(_b, _h, q, kv):
        earlier_verified = (depth[kv] == 0) & (anchor_pos[q] >= anchor_pos[kv])
        own_rollout = (anchor_pos[q] == anchor_pos[kv]) & (depth[q] >= depth[kv])
        return earlier_verified | own_rollout

    rows = anchor_pos.numel()
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=rows, KV_LEN=rows, device="cpu")


@torch.no_grad()
def reference_logits(
    model, features: torch.Tensor, ids: torch.Tensor, anchors: list[int], depths: int, mask_token: int
) -> list:
    """Per anchor t of `anchors`, SpecForge's own forward's draft logits [k, V] there: one pass of
    its `forward` (fc, its layers under its flex attention, its norm) and `lm_head` over every row
    of `_rows`, at position anchor + depth, the depth-0 rows reading (x_{s+1}, features[s]) and the
    others (mask_token, mask_hidden) as its training forward builds them (OnlinePEagleModel)."""
    T = ids.numel()
    anchor_pos, depth = _rows(T, anchors, depths)
    masked = depth > 0
    tokens = torch.where(masked, torch.tensor(mask_token), ids[1:][anchor_pos])
    hidden = torch.where(masked[:, None], model.mask_hidden[0, 0], features[anchor_pos])
    out = model(
        hidden_states=hidden[None].to(model.fc.weight.dtype),
        inputs_embeds=model.embed_input_ids(tokens[None]),
        attention_mask=_block_mask(anchor_pos, depth),
        position_ids=(anchor_pos + depth)[None],
    )
    logits = model.lm_head(out)[0].float()
    rollouts = logits[T - 1 :].split([min(depths, T - t) - 1 for t in anchors])
    return [torch.cat([logits[t - 1 : t], rest]) for t, rest in zip(anchors, rollouts)]
