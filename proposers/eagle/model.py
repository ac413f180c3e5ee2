"""The EAGLE-1/2 drafter model, written for batched teacher-forced replay of its chain.

Weights, named as the EAGLE repository saves them (cnets.py `Model`, pytorch_model.bin) and vLLM
and SGLang load them: `fc` [H, 2H] (with `fc.bias` when the config's `bias`, true when absent),
`layers.{i}` Llama decoder layers of which the first has no `input_layernorm`, `embed_tokens` (the
repository's frozen copy of the target's; the target's is used when it is absent, as vLLM does).
No final norm and no lm_head: the target's lm_head reads the last layer's output as it is.

The rule (the repository's `Model.forward`; vLLM `EagleLlamaForCausalLM`, SGLang
`LlamaForCausalLMEagle`, both models/llama_eagle.py, driven by their EAGLE proposers):
  z = fc([embed(x) ; h]); layer 0 reads z un-normed with z as its residual; h' = the last layer's
  output; logits = lm_head(h').
Slot s of the draft KV is written from (x_{s+1}, the target's post-norm last hidden state at s)
at position s. Step 1 at anchor t is slot t - 1 itself; step j > 1 reads (d_{j-1}, h' of step
j - 1) at position t + j - 2. Offline the chain is the step-chain drafter's
(proposers/toolkit/step_chain.py), which EAGLE-3's and the MTP heads' are too.
"""

from __future__ import annotations

import torch
from torch import nn

from proposers.toolkit.config import DrafterConfig
from proposers.toolkit.conventions import REFERENCE, Conventions
from proposers.toolkit.eagle.decoder import DECODERS, EagleLayer, decoder_config
from proposers.toolkit.step_chain import StepChainDrafter


class Eagle1Drafter(StepChainDrafter):
    optional_weights = ("embed_tokens.weight",)

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        hf = decoder_config(config.raw, "llama")
        hf.head_dim = config.head_dim
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.family_options["fc_bias"])
        # Llama layers; the first reads fc's output as it is (the repository skips its input norm)
        self.layers = nn.ModuleList(EagleLayer(config, hf, first=False) for _ in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = None
        self.norm = nn.Identity()  # none: the target's lm_head reads the last layer's output
        self.rotary = DECODERS["llama"][2](hf)  # buffers only, not in the state dict
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.lm_head = self.d2t = self.t2d = None  # the target's lm_head

    def project(self, features: torch.Tensor, conventions: Conventions = REFERENCE) -> torch.Tensor:
        """The target's post-norm last hidden state [..., H], read as stored (id L - 1)."""
        return features

    def layer_input(self, layer: nn.Module, h: torch.Tensor, embeds: torch.Tensor | None):
        """(what the layer's q/k/v read, its residual): the first layer fc([embedding ; h]) for both."""
        if layer is not self.layers[0]:
            return layer.attention_input(h, None)
        z = self.fc(torch.cat([embeds, h], dim=-1))
        return z, z

    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        """The next step reads this step's output as it is (there is no norm to apply)."""
        return h
