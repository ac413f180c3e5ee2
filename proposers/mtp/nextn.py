"""A DeepSeek-style NextN head (GLM-4.5's, transformers `glm4_moe`; DeepSeek-V3's, `deepseek_v3`,
its attention MLA: mla.py), written for batched teacher-forced replay of its chain.

Weights: the target checkpoint's `model.layers.{L}.*` (L = num_hidden_layers), renamed here
(`canonical_names`): `eh_proj` -> `fc` [H, 2H], `enorm` / `hnorm` -> `pre_fc_norm_embedding` /
`pre_fc_norm_hidden`, `shared_head.norm` -> `norm`, `shared_head.head` -> `lm_head` (absent: the
target's), `embed_tokens` (absent: the target's), and the rest -> `layers.0.*`: one decoder layer of
the target's own kind (q/k/v with `attention_bias`, optional q/k norms, partial rotary, and
transformers' own `Glm4MoeMoE`: sigmoid router with its score-correction bias, top-k, routed
experts and the shared experts; its per-expert checkpoint tensors stacked, experts.py). Norms
scale by w, not (1 + w).

The rule (vLLM `model_executor/models/glm4_moe_mtp.py:106-128`, run by `v1/spec_decode/`
`llm_base_proposer.py`; llama.cpp `src/models/glm4-moe.cpp:132-289`, run by
`common/speculative.cpp:1331-1730`):
  h' = layer(eh_proj([enorm(embed(x)) ; hnorm(h)])), logits = shared_head.head(shared_head.norm(h'))
  step 1 reads the target's final hidden state after its final norm (as the Qwen3.5 heads,
  model.TargetStateHead); steps 2.. read the previous draft and the previous step's state.
Where the engines differ (docs/drafter-families.md#nextn-heads):
  - what is fed back: vLLM the layer output h' BEFORE shared_head.norm (glm4_moe_mtp.py:127-128; a
    single returned tensor, llm_base_proposer.py:1001-1014), llama.cpp AFTER it (glm4-moe.cpp:267-269,
    `t_h_nextn`, read back at common/speculative.cpp:1652): `Conventions.nextn_feed_normed`, which
    `--walk-rule llama.cpp` sets;
  - position 0: vLLM zeroes the embedding of the slot there (glm4_moe_mtp.py:116); llama.cpp has no
    such slot of vLLM's kind: its lead slot (x_0, a zero row) at position 0 keeps its embedding
    (`Conventions.lead_slot`, common/speculative.cpp:1433, 1524-1526).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformers import DeepseekV3Config, Glm4MoeConfig, PretrainedConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3MoE,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE, Glm4MoeRMSNorm, Glm4MoeRotaryEmbedding

from proposers.mtp.experts import ExpertFields, check_experts, fuse_experts
from proposers.mtp.model import TargetStateHead, partial_rope
from proposers.toolkit.config import DrafterConfig, transformers_config
from proposers.toolkit.conventions import Conventions
from proposers.toolkit.head import renamed
from proposers.toolkit.layers import DrafterAttention
from proposers.toolkit.mla.attention import MlaAttention

# the head's own module names (the rest of model.layers.{L} is its decoder layer, layers.0)
OWN_NAMES = {
    "eh_proj.": "fc.",
    "enorm.": "pre_fc_norm_embedding.",
    "hnorm.": "pre_fc_norm_hidden.",
    "shared_head.norm.": "norm.",
    "shared_head.head.": "lm_head.",
    "embed_tokens.": "embed_tokens.",
}


def nextn_config(raw: dict, source: str = "config") -> PretrainedConfig:
    """transformers' config of the target's fields `raw` (its kind's: KINDS), a GLM-4.5 head_dim
    resolved as vLLM and llama.cpp resolve an absent one (hidden_size // num_attention_heads)."""
    kind = KINDS[raw["model_type"]]
    hf = transformers_config(kind.config, raw, source, drop=("model_type", "architectures", "auto_map"))
    if getattr(hf, "head_dim", None) is None:
        hf.head_dim = hf.hidden_size // hf.num_attention_heads
    return hf


def glm_fields(hf) -> ExpertFields:
    """GLM-4.5's expert names (`n_routed_experts`, `mlp.shared_experts`, n_shared_experts wide in experts)."""
    shared = hf.moe_intermediate_size * hf.n_shared_experts
    return ExpertFields(
        "n_routed_experts", hf.n_routed_experts, hf.moe_intermediate_size, "shared_experts", "n_shared_experts",
        hf.n_shared_experts, shared,
    )  # fmt: skip


class NextnAttention(DrafterAttention):
    """Glm4MoeAttention for the step chain: q/k/v biased as `attention_bias` says, o_proj never;
    q/k norms over the head dim when `use_qk_norm`; RoPE on the first rotary dims (partial)."""

    def __init__(self, config: DrafterConfig, hf: PretrainedConfig):
        super().__init__(config, qk_norm=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        if hf.use_qk_norm:
            self.q_norm = Glm4MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = Glm4MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def queries(self, x, cos, sin):
        q = self.q_proj(x).view(*x.shape[:-1], self.heads, self.head_dim)
        q = q if self.q_norm is None else self.q_norm(q)
        return partial_rope(q.transpose(-2, -3), cos, sin)

    def keys_values(self, x, cos, sin):
        shape = (*x.shape[:-1], self.kv_heads, self.head_dim)
        k = self.k_proj(x).view(shape)
        k = k if self.k_norm is None else self.k_norm(k)
        return partial_rope(k.transpose(-2, -3), cos, sin), self.v_proj(x).view(shape).transpose(-2, -3)


class Kind(NamedTuple):
    """transformers' classes of one target kind the NextN layer is built from, and vLLM's feedback."""

    config: type
    attention: type
    moe: type
    norm: type
    rotary: type
    # vLLM feeds back the layer output before shared_head.norm (GLM-4.5, glm4_moe_mtp.py:127-128),
    # or after it (DeepSeek-V3: deepseek_mtp.py:136-144 returns (h', shared_head(h')), the second fed back)
    feeds_pre_norm: bool


KINDS = {
    "glm4_moe": Kind(Glm4MoeConfig, NextnAttention, Glm4MoeMoE, Glm4MoeRMSNorm, Glm4MoeRotaryEmbedding, True),
    "deepseek_v3": Kind(
        DeepseekV3Config, MlaAttention, DeepseekV3MoE, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding, False
    ),
}


class NextnLayer(nn.Module):
    """The head's decoder layer (layers.0): Glm4MoeDecoderLayer's or DeepseekV3DecoderLayer's, its MLP
    transformers' own MoE block of that kind."""

    def __init__(self, config: DrafterConfig, hf: PretrainedConfig, kind: Kind):
        super().__init__()
        self.self_attn = kind.attention(config, hf)
        self.mlp = kind.moe(hf)
        self.input_layernorm = kind.norm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = kind.norm(config.hidden_size, eps=config.rms_norm_eps)

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = residual + attended
        x = self.post_attention_layernorm(h)
        return h + self.mlp(x.reshape(1, -1, x.shape[-1])).view_as(x)  # rows are independent


class NextnDrafter(TargetStateHead):
    optional_weights = ("embed_tokens.weight", "lm_head.weight")  # absent: the target's (llama.cpp's rule)

    @property
    def embedded_prefix(self) -> str:
        return f"model.layers.{self.config.num_target_layers}."

    @property
    def embedded_promise(self) -> str:
        return f"field 'num_nextn_predict_layers' is {self.config.raw.get('num_nextn_predict_layers', 1)}"

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        hf, kind = nextn_config(config.raw), KINDS[config.family_options["decoder"]]
        self.kind = kind
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = kind.norm(hidden, eps=eps)
        self.pre_fc_norm_hidden = kind.norm(hidden, eps=eps)
        self.layers = nn.ModuleList([NextnLayer(config, hf, kind)])
        self.norm = kind.norm(hidden, eps=eps)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.d2t = self.t2d = None
        self.rotary = kind.rotary(hf)  # buffers only, not in the state dict
        self.target_norm = None  # the target's final norm (attach_target_head)
        self.target_norm_class = kind.norm

    def canonical_names(self, state: dict) -> dict:
        return fuse_experts({_own_name(name): tensor for name, tensor in state.items()})

    def check_checkpoint(self, state: dict, source: str, config_file: str) -> None:
        """The layer's experts against the config (experts.check_experts), named as the file names them."""
        named = {_own_name(name): tensor for name, tensor in state.items()}
        hf = nextn_config(self.config.raw)
        check_experts(named, hf, f"{self.embedded_prefix}mlp.", source, config_file, glm_fields(hf))

    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        """vLLM's: GLM-4.5's layer output before shared_head.norm (glm4_moe_mtp.py:127-128),
        DeepSeek-V3's after it (deepseek_mtp.py:136-144)."""
        return h if self.kind.feeds_pre_norm else self.norm(h)

    def feedback_under(self, h: torch.Tensor, conventions: Conventions) -> torch.Tensor:
        """llama.cpp's (`nextn_feed_normed`): after shared_head.norm (glm4-moe.cpp:267-269)."""
        return self.norm(h) if conventions.nextn_feed_normed else self.feedback(h)

    def slot_embeds(self, embeds: torch.Tensor, positions: torch.Tensor, conventions: Conventions) -> torch.Tensor:
        """vLLM zeroes the embedding at position 0 (glm4_moe_mtp.py:116); llama.cpp's lead slot there
        keeps its own (graph_mtp masks nothing)."""
        if conventions.lead_slot:
            return embeds
        return torch.where((positions == 0)[:, None], torch.zeros_like(embeds), embeds)


def _own_name(name: str) -> str:
    """A tensor of model.layers.{L} (its prefix stripped) under this model's names."""
    return renamed(name, OWN_NAMES, "layers.0.")
