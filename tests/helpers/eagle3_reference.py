"""EAGLE-3 reference drafters for the tests: the public reference's own classes, never specreplay's.

`speculators_eagle3` builds speculators' `Eagle3DraftModel` (PyPI speculators 0.9.0, eager attention
so it runs on CPU) for a target of the given widths, its weights random or left as initialised;
`save` writes it with its own save_pretrained. `ttt_logits` runs its own training-time-test forward
(models/eagle3/core.py `forward`: step 0 causal over every position, later steps teacher-forced
with the diagonal mask extension) and returns every step's draft logits. `write_specforge` writes
the same weights in SpecForge's layout (`LlamaForCausalLMEagle3`: `midlayer.*`, a LlamaConfig with
`draft_vocab_size` and `eagle_config`, output-of-layer ids; d2t/t2d always, as its model registers
them; no embedding, as SpecForge's trainer saves it).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.models import seeded


def decoder_config(kind: str, *, vocab: int, hidden: int, layers: int = 1, heads=4, kv_heads=2, head_dim=16, mlp=128):
    """The drafter's decoder config (transformers' Llama or Qwen3), eager attention."""
    from transformers import LlamaConfig, Qwen3Config

    fields = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        rope_theta=10000.0,
    )
    config = (LlamaConfig if kind == "llama" else Qwen3Config)(**fields)
    config._attn_implementation = "eager"  # speculators' CPU path: float masks, eager attention
    return config


def speculators_eagle3(
    *,
    vocab: int,
    hidden: int,
    aux_ids: tuple[int, ...],
    steps: int = 3,
    kind: str = "llama",
    layers: int = 1,
    draft_vocab: torch.Tensor | None = None,
    switches: dict | None = None,
    std: float | None = 0.2,
    seed: int = 0,
    shapes: dict | None = None,
):
    """speculators' Eagle3DraftModel: `aux_ids` before-layer ids, `steps` speculative tokens,
    `draft_vocab` the sorted target ids of a reduced vocabulary (None: the whole vocabulary),
    `switches` its norm flags; every weight (norms too, so one in the wrong slot shows) drawn
    N(0, std), or speculators' own init when std is None (then the caller fills the target-owned
    embedding and lm_head); `shapes` the decoder's heads, kv_heads, head_dim, mlp when not the tiny defaults."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    config = Eagle3SpeculatorConfig(
        transformer_layer_config=decoder_config(kind, vocab=vocab, hidden=hidden, layers=layers, **(shapes or {})),
        draft_vocab_size=vocab if draft_vocab is None else draft_vocab.numel(),
        eagle_aux_hidden_state_layer_ids=list(aux_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
        **(switches or {}),
    )
    with seeded(seed), torch.no_grad():
        model = Eagle3DraftModel(config)
        if draft_vocab is not None:  # as speculators' vocab mapping: d2t = target id - draft id
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[draft_vocab] = True
            model.load_vocab_mappings(t2d, draft_vocab - torch.arange(draft_vocab.numel()))
        if std is not None:
            for parameter in model.parameters():
                parameter.normal_(0.0, std)
    return model.eval()


def save(model, save_dir) -> str:
    model.save_pretrained(str(save_dir))
    return str(save_dir)


@torch.no_grad()
def ttt_logits(model, features: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    """The draft logits [T - 1, Vd] of every TTT step of speculators' own forward over one sequence
    (features [T, n*H] in aux-id order, ids [T]), fed as its data pipeline shifts them
    (`shift_batch`: index i holds x_{i+1} and g_i): row i of step s drafts the token at i + s + 2,
    i.e. this project's draft s + 1 at anchor t = i + 1. Rows whose teacher-forced inputs ran past
    the sequence (i + s > T - 2) hold padding and are not comparable."""
    captured = []
    hook = model.lm_head.register_forward_hook(lambda _m, _args, out: captured.append(out[0].float()))
    try:
        model(
            hidden_states=features[:-1][None],
            input_ids=ids[1:][None],
            document_ids=torch.zeros(1, ids.numel() - 1, dtype=torch.long),
            ttt_steps=model.config.speculators_config.proposal_methods[0].speculative_tokens,
        )
    finally:
        hook.remove()
    return captured


def write_specforge(speculators_dir: str, out_dir, num_target_layers: int) -> str:
    """The speculators checkpoint's weights in SpecForge's layout: `layers.0.*` as `midlayer.*`,
    d2t/t2d added for a full vocabulary (identity, all selected), no embedding; the LlamaConfig of
    the decoder at the top level with `draft_vocab_size`, the aux ids as output-of-layer ids
    (speculators' before-layer id s is the output of layer s - 1) and the step count."""
    with open(os.path.join(speculators_dir, "config.json")) as f:
        spec = json.load(f)
    state = load_file(os.path.join(speculators_dir, "model.safetensors"))
    state = {("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    state.pop("embed_tokens.weight")
    decoder = spec["transformer_layer_config"]
    if "d2t" not in state:
        state["d2t"] = torch.zeros(spec["draft_vocab_size"], dtype=torch.long)
        state["t2d"] = torch.ones(decoder["vocab_size"], dtype=torch.bool)
    ids = [s if s == num_target_layers else s - 1 for s in spec["eagle_aux_hidden_state_layer_ids"]]
    raw = {
        **decoder,
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "draft_vocab_size": spec["draft_vocab_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "num_speculative_tokens": spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"))
    return str(out_dir)
