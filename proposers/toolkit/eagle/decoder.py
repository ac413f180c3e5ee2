"""The decoder EAGLE-style drafters are built on (EAGLE-3, P-EAGLE), for batched teacher-forced
replay of their steps (proposers/toolkit/step_chain.py).

Weights, named as speculators saves them (models/eagle3/core.py; SpecForge's `midlayer.*` is
`layers.0.*`, `canonical_names`): `fc` [H, n*H] (optional `input_norm` [n*H] before it,
`norm_before_fc`, or one norm per aux layer `fc_norm.{i}`), `layers.0` a decoder layer whose
q/k/v read [input_layernorm(embedding) ; hidden_norm(hidden)] (2H), `layers.{i > 0}` plain decoder
layers, `norm`, `lm_head` [Vo, H] (always its own), `d2t`/`t2d` (a reduced vocabulary; SpecForge
always), `embed_tokens` (the drafter's copy; the target's own is used when it is absent).
Llama layers (SpecForge, speculators `model_type: "llama"`) or Qwen3 layers (q/k norms).

Slot s of the draft KV is written from (embed(x_{s+1}), fc(g_s)) at position s, target features g
only; step 1 at anchor t is slot t - 1 itself. What a later step reads is the family's
(`feedback`): EAGLE-3 its previous step's hidden state and draft, P-EAGLE a learned mask.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, PretrainedConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from proposers.toolkit.config import DrafterConfig, transformers_config
from proposers.toolkit.conventions import REFERENCE, Conventions
from proposers.toolkit.layers import DrafterAttention
from proposers.toolkit.step_chain import StepChainDrafter

DECODERS = {
    "llama": (LlamaConfig, LlamaMLP, LlamaRotaryEmbedding),
    "qwen3": (Qwen3Config, Qwen3MLP, Qwen3RotaryEmbedding),
}
# the fields of a config.json that are not the decoder's (passed to transformers' config class otherwise)
NOT_DECODER = ("architectures", "auto_map", "eagle_config", "draft_vocab_size", "fc_norm", "norm_output")


def decoder_config(raw: dict, kind: str, source: str = "config") -> PretrainedConfig:
    """transformers' config of the decoder (`kind` llama or qwen3) as the reference builds it from
    the file's fields, its defaults filling the rest (head_dim, RoPE, the MLP activation)."""
    return transformers_config(DECODERS[kind][0], raw, source, drop=(*NOT_DECODER, "model_type"))


class EagleLayer(nn.Module):
    """One decoder layer; the first reads [embedding ; hidden], its residual the hidden alone."""

    def __init__(self, config: DrafterConfig, hf: PretrainedConfig, first: bool):
        super().__init__()
        options, hidden = config.family_options, config.hidden_size
        self.first, self.norm_before_residual = first, options["norm_before_residual"]
        qk_norm = options["decoder"] == "qwen3"
        self.self_attn = DrafterAttention(config, in_features=2 * hidden if first else hidden, qk_norm=qk_norm)
        self.mlp = DECODERS[options["decoder"]][1](hf)
        self.input_layernorm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        if first:
            self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)

    def attention_input(self, h: torch.Tensor, embeds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(what q/k/v read [..., in], the residual [..., H]) of hidden h [..., H] (and, first
        layer, the token embeddings [..., H])."""
        if not self.first:
            return self.input_layernorm(h), h
        normed = self.hidden_norm(h)
        residual = normed if self.norm_before_residual else h
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = residual + attended
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleDrafter(StepChainDrafter):
    """The decoder every EAGLE-style family builds: `fc` over the aux features, decoder layers whose
    first reads [embedding ; hidden], `norm`, `lm_head` (its own, maybe a reduced vocabulary), its
    own copy of the embedding or the target's. A family adds `feedback`: what a step after the
    first reads as its hidden input."""

    optional_weights = ("embed_tokens.weight",)

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        options, hidden, width = config.family_options, config.hidden_size, len(config.target_layer_ids)
        hf = decoder_config(config.raw, options["decoder"])
        hf.head_dim = config.head_dim
        eps = config.rms_norm_eps
        self.input_norm = Qwen3RMSNorm(width * hidden, eps=eps) if options["norm_before_fc"] else None
        self.fc_norm = (
            nn.ModuleList(Qwen3RMSNorm(hidden, eps=eps) for _ in range(width)) if options["fc_norm"] else None
        )
        self.fc = nn.Linear(width * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(EagleLayer(config, hf, i == 0) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=eps)
        self.rotary = DECODERS[options["decoder"]][2](hf)  # buffers only, not in the state dict
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size or config.vocab_size, bias=False)
        if config.draft_vocab_size is not None or options["id_map"]:
            self.add_id_map(config)
        else:
            self.d2t = self.t2d = None

    # -- names and the embedding: the checkpoint's copy of the target's, else the target's ----

    @staticmethod
    def canonical_names(state: dict) -> dict:
        """SpecForge's single `midlayer.*` is speculators' and vLLM's `layers.0.*`."""
        prefix = "midlayer."
        return {"layers.0." + n[len(prefix) :] if n.startswith(prefix) else n: t for n, t in state.items()}

    # -- how its inputs enter the chain ------------------------------------------------------

    def project(self, features: torch.Tensor, conventions: Conventions = REFERENCE) -> torch.Tensor:
        """fc of the aux features [..., n*H] -> [..., H], after the configured norms."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(features)

    def layer_input(self, layer: nn.Module, h: torch.Tensor, embeds: torch.Tensor | None):
        """(what `layer`'s q/k/v read, its residual): the first layer reads [embedding ; hidden]."""
        return layer.attention_input(h, embeds)
