"""The MTP drafter model: a target's native multi-token-prediction head (Qwen3-Next, Qwen3.5),
written for batched teacher-forced replay of its chain.

Weights, named as the target's checkpoint lays them out less the `mtp.` prefix: `fc` [H, 2H],
`pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `layers.0.*` (one full-attention decoder layer of
the target's own kind: q_proj [2 * heads * d, H] giving each head's query and its output gate,
k/v/o_proj, (1 + w) q/k norms over the head dim, partial rotary, and the target's MLP: dense, or
transformers' own sparse MoE block with its gated shared expert where the config makes the layer
MoE, its per-expert checkpoint tensors stacked onto the block's fused ones, experts.py says why) and
`norm`. No embedding or lm_head: the target's are used.

The rule (vLLM `qwen3_next_mtp.py` / `qwen3_5_mtp.py` `MultiTokenPredictor.forward`, driven by
`v1/spec_decode/eagle.py` as an EAGLE-style proposer):
  h' = norm(layer(fc([pre_fc_norm_embedding(embed(x)) ; pre_fc_norm_hidden(h)])))
  step 1 at anchor t: x = x_t, h = the target's final hidden state at t - 1, at position t - 1;
  step j > 1: x = draft j - 1, h = h' of step j - 1 (after `norm`: the proposer feeds the MTP
  model's single returned tensor back), at position t + j - 2; logits = lm_head(h').
The draft KV of verified position s is written from (x_{s+1}, target h_s): target features only.
vLLM feeds the target's hidden state AFTER its final norm (the target model's output); the
shards keep it before the norm (id L) with the norm's weight in the target head, so the post-norm
state is derived here (`project`). Conventions.prenorm_hidden reads it before the norm instead
(speculators' training data): diagnose's `mtp-prenorm` variant.

Offline the chain is the step-chain drafter's (proposers/toolkit/step_chain.py), which EAGLE-3's
is too: this module says how the head's inputs enter it (`project`: the features' norm,
`layer_input`, `feedback`) and its attention (gated, partial rotary).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformers import PretrainedConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5MLP, Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeRMSNorm,
    Qwen3_5MoeSparseMoeBlock,
    Qwen3_5MoeTextRotaryEmbedding,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextMLP,
    Qwen3NextRMSNorm,
    Qwen3NextRotaryEmbedding,
    Qwen3NextSparseMoeBlock,
)

from pipeline.common import timing
from proposers.checkpoints.files import CheckpointError
from proposers.mtp.experts import check_experts, fuse_experts
from proposers.toolkit.attention import attend
from proposers.toolkit.config import DrafterConfig, transformers_config
from proposers.toolkit.conventions import REFERENCE, Conventions
from proposers.toolkit.head import renamed
from proposers.toolkit.layers import DrafterAttention, apply_rope
from proposers.toolkit.step_chain import StepChainDrafter


class Parts(NamedTuple):
    """transformers' classes of one target kind the MTP layer is built from."""

    config: type
    mlp: type | None  # the dense MLP (None: the kind has none)
    norm: type  # RMSNorm with (1 + w) weights
    rotary: type
    moe: type | None  # the sparse MoE block with its shared expert (None: the kind has none)


PARTS = {
    "qwen3_next": Parts(
        Qwen3NextConfig, Qwen3NextMLP, Qwen3NextRMSNorm, Qwen3NextRotaryEmbedding, Qwen3NextSparseMoeBlock
    ),
    "qwen3_5_text": Parts(Qwen3_5TextConfig, Qwen3_5MLP, Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding, None),
    "qwen3_5_moe_text": Parts(
        Qwen3_5MoeTextConfig, None, Qwen3_5MoeRMSNorm, Qwen3_5MoeTextRotaryEmbedding, Qwen3_5MoeSparseMoeBlock
    ),
}


def hf_config(raw: dict, kind: str, source: str = "config") -> PretrainedConfig:
    """transformers' config of the target's decoder of `kind` from its fields `raw` (a text config)."""
    return transformers_config(PARTS[kind].config, raw, source, drop=("model_type", "architectures", "auto_map"))


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of x [..., heads, T, d], the rest as they are
    (partial_rotary_factor)."""
    rotary = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)


class GatedAttention(DrafterAttention):
    """Qwen3-Next / Qwen3.5 full attention: q_proj gives per head [query ; gate] (2d), the output
    is multiplied by sigmoid(gate) before o_proj; (1 + w) q/k norms; partial rotary.

    `queries` returns [..., heads, T, 2d], the roped query with its gate behind it, so the chain
    code (step_chain.py) carries one tensor per step; `attend_to` splits them again."""

    def __init__(self, config: DrafterConfig, norm: type):
        super().__init__(config)
        width = self.heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, 2 * width, bias=config.attention_bias)
        self.q_norm = norm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = norm(self.head_dim, eps=config.rms_norm_eps)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., T, H] -> [..., heads, T, 2d]: roped, normed queries, then their gates."""
        q, gate = self.q_proj(x).view(*x.shape[:-1], self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = partial_rope(self.q_norm(q).transpose(-2, -3), cos, sin)
        return torch.cat([q, gate.transpose(-2, -3)], dim=-1)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., T, H] -> roped, normed keys and values [..., kv_heads, T, d]."""
        shape = (*x.shape[:-1], self.kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(-2, -3)
        return partial_rope(k, cos, sin), self.v_proj(x).view(shape).transpose(-2, -3)

    def attend_to(self, q, k, v, ctx_k, ctx_v, mask) -> torch.Tensor:
        """Queries with gates q [A, heads, b, 2d] to [context ; block keys] -> [A, b, H]."""
        A, _, b, _ = q.shape
        q, gate = q.split(self.head_dim, dim=-1)
        with timing.stage("attention"):
            out = attend(q.contiguous(), k, v, ctx_k, ctx_v, mask, self.head_dim**-0.5)  # [A, heads, b, d]
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.transpose(1, 2).reshape(A, b, -1))


class MtpLayer(nn.Module):
    """The MTP decoder layer (`layers.0`); its input is the drafter's fc output (MtpDrafter.layer_input)."""

    def __init__(self, config: DrafterConfig, hf: PretrainedConfig, parts: Parts):
        super().__init__()
        self.self_attn = GatedAttention(config, parts.norm)
        # the target's own MLP class: its sparse MoE block when the config makes the layer MoE
        moe = config.family_options.get("moe", False)
        self.mlp = parts.moe(hf) if moe else parts.mlp(hf, intermediate_size=hf.intermediate_size)
        self.input_layernorm = parts.norm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = parts.norm(config.hidden_size, eps=config.rms_norm_eps)

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = residual + attended
        x = self.post_attention_layernorm(h)
        # transformers' MoE block takes [batch, seq, H]: every row as one sequence (rows are independent)
        return h + self.mlp(x.reshape(1, -1, x.shape[-1])).view_as(x)


# speculators' MTP layer's own modules -> the native names (the rest of mtp_layers.0 is layers.0)
SPECULATORS_NAMES = {
    "input_proj.": "fc.",
    "final_layernorm.": "norm.",
    "hidden_layernorm.": "pre_fc_norm_hidden.",
    "token_layernorm.": "pre_fc_norm_embedding.",
}


def _native_names(state: dict) -> dict:
    return {_native_name(name): tensor for name, tensor in state.items()}


def _native_name(name: str) -> str:
    prefix = "mtp_layers.0."
    if not name.startswith(prefix):
        return name
    return renamed(name[len(prefix) :], SPECULATORS_NAMES, "layers.0.")


def check_heads_held(held: list[int], promised: list[int], where: str, said: str, source: str, config_file: str):
    """A stack of MTP heads in the target's checkpoint: every head the config promises present (a
    missing one would score the others' rule). `held`/`promised`: the head indices as the tensor
    names spell them; `where`: the tensors' names; `said`: the field's value as the config states it."""
    if held != promised:
        shown = ", ".join(map(str, held)) or "none"
        raise CheckpointError(
            f"{source}: {where} holds heads {shown}, but the config's field 'num_nextn_predict_layers' is {said}; "
            f"set it to the heads the checkpoint holds in {config_file}"
        )


class TargetStateHead(StepChainDrafter):
    """What every MTP head does with the target's state (Qwen3.5's `mtp.*`, GLM-4.5's NextN layers,
    nextn.py): step 1 reads the target's final hidden state after its final norm (vLLM and llama.cpp
    both feed the target model's normed output), and `fc` reads [norm_e(embed(x)) ; norm_h(h)],
    embedding first. A subclass builds fc, the two norms, its layer, `norm` and `rotary`, and names
    the target's final norm class (`target_norm_class`)."""

    target_norm_class: type

    def attach_target_head(self, target) -> None:
        """The target's final norm, from its weight in the target head (absent: the shards lack it,
        and only the pre-norm convention can be replayed; compatibility.py refuses that for score)."""
        weight = target.final_norm
        if weight is None:
            self.target_norm = None
            return
        norm = self.target_norm_class(self.config.hidden_size, eps=self.config.rms_norm_eps)
        norm.weight = nn.Parameter(weight.to(self.fc.weight), requires_grad=False)
        self.target_norm = norm

    def project(self, features: torch.Tensor, conventions: Conventions = REFERENCE) -> torch.Tensor:
        """The hidden state step 1 reads [..., H] from the stored one before the target's final norm:
        after the norm (vLLM's rule), or as stored under `prenorm_hidden`."""
        if conventions.prenorm_hidden:
            return features
        if self.target_norm is None:
            raise ValueError("MTP: the target's final norm weight is not attached (attach_target_head)")
        return self.target_norm(features)

    def layer_input(self, layer: nn.Module, h: torch.Tensor, embeds: torch.Tensor | None):
        """(what the layer's q/k/v read, its residual): z = fc([norm_e(embed) ; norm_h(h)]), embedding first."""
        z = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(h)], dim=-1))
        return layer.input_layernorm(z), z


class MtpDrafter(TargetStateHead):
    # speculators' MTPDraftModel reloads these from the verifier on load (load_verifier_weights,
    # `_keys_to_ignore_on_load_missing`); its converter's export still saves `verifier_lm_head.weight`
    # as the NaN it was initialised to (speculators 0.9.0 leaves it out of `_keys_to_ignore_on_save`)
    reloaded_weights = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "t2d", "d2t")

    @property
    def embedded_prefix(self) -> str | None:
        """A native head's tensors are the target checkpoint's `mtp.*`; speculators' export is its own."""
        return "mtp." if self.config.layout == "native" else None

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        parts, hidden, eps = PARTS[config.family_options["decoder"]], config.hidden_size, config.rms_norm_eps
        hf = hf_config(config.raw, config.family_options["decoder"])
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = parts.norm(hidden, eps=eps)
        self.pre_fc_norm_hidden = parts.norm(hidden, eps=eps)
        self.layers = nn.ModuleList([MtpLayer(config, hf, parts)])
        self.norm = parts.norm(hidden, eps=eps)
        self.rotary = parts.rotary(hf)  # buffers only, not in the state dict
        self.embed_tokens = None  # the target's embedding and lm_head
        self.lm_head = self.d2t = self.t2d = None
        self.target_norm = None  # the target's final norm (attach_target_head), not the head's weight
        self.target_norm_class = parts.norm

    def canonical_names(self, state: dict) -> dict:
        """speculators' export (convert/mtp/converter.py) names the native tensors its own way; an
        MoE layer's per-expert tensors are stacked as transformers' block holds them (experts.py)."""
        named = _native_names(state)
        return fuse_experts(named) if self.config.family_options.get("moe") else named

    def check_checkpoint(self, state: dict, source: str, config_file: str) -> None:
        """An MoE layer's experts against the config, in the file's own names (experts.check_experts)."""
        if not self.config.family_options.get("moe"):
            return
        named = _native_names(state)
        hf = hf_config(self.config.raw, self.config.family_options["decoder"])
        prefix = self.embedded_prefix or ("mtp_" if any(k.startswith("mtp_layers.") for k in state) else "")
        check_experts(named, hf, f"{prefix}layers.0.mlp.", source, config_file)

    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        """vLLM's proposer feeds back the MTP model's single returned tensor, after `norm`."""
        return self.norm(h)
