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

A stack of N > 1 heads (`num_nextn_predict_layers`, `model.layers.{L..L+N-1}.*`; docs/drafter-
families.md#stacks-of-nextn-heads): vLLM's default model runner (V2, config/vllm.py:731-767) runs it
with its multi-module speculator whenever min(N, steps) > 1 (config/speculative.py:2188-2194,
v1/worker/gpu/spec_decode/__init__.py:65-70): step j runs head j (`spec_step_idx % N`,
deepseek_mtp.py:217,231) over the whole draft window, its inputs shifted left by one more token and
the previous head's outputs as states, each head with its own KV cache: DeepSeek-V3's sequential MTP
modules (`context_kv`). Its V1 runner passes no spec_step_idx (llm_base_proposer.py:731-753): head 0
at every step (`Conventions.first_head_only`). More steps than heads reuse head j % N over a KV
cache its other steps wrote: refused (scoring/score/steps.py). SGLang loads one head only
(deepseek_common/deepseek_weight_loader.py:567, glm4_moe.py:1080) and llama.cpp's MTP graphs build
one (src/models/glm4-moe.cpp:135, deepseek2.cpp:173).
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

from pipeline.common import timing
from proposers.mtp.experts import ExpertFields, check_experts, fuse_experts
from proposers.mtp.model import TargetStateHead, check_heads_held, partial_rope
from proposers.toolkit.config import DrafterConfig, transformers_config
from proposers.toolkit.conventions import REFERENCE, Conventions
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


class NextnStage(nn.Module):
    """A later head of a stack (`model.layers.{L + i}.*`, i >= 1), its modules named as head 0's."""

    def __init__(self, config: DrafterConfig, hf: PretrainedConfig, kind: Kind):
        super().__init__()
        # vLLM's predictor embeds with one table (glm4_moe_mtp.py:153-156, every head's embed_tokens
        # loaded onto it, 419-442): a later head's own is read, and head 0's (or the target's) used
        add_head_modules(self, config, hf, kind)


def add_head_modules(module: nn.Module, config: DrafterConfig, hf: PretrainedConfig, kind: Kind) -> None:
    """One head's modules on `module`, named as the checkpoint's `model.layers.{L + i}.*`: fc (eh_proj)
    over the two normed halves, its decoder layer, its output norm, and its optional own embedding
    and lm_head (absent: the target's)."""
    hidden, eps = config.hidden_size, config.rms_norm_eps
    module.fc = nn.Linear(2 * hidden, hidden, bias=False)
    module.pre_fc_norm_embedding = kind.norm(hidden, eps=eps)
    module.pre_fc_norm_hidden = kind.norm(hidden, eps=eps)
    module.layers = nn.ModuleList([NextnLayer(config, hf, kind)])
    module.norm = kind.norm(hidden, eps=eps)
    module.embed_tokens = nn.Embedding(config.vocab_size, hidden)
    module.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)


class NextnDrafter(TargetStateHead):
    """Head 0 as the step chain (its modules at the top); a stack's later heads in `later`."""

    @property
    def optional_weights(self) -> tuple[str, ...]:  # absent: the target's (llama.cpp's rule)
        own = ("embed_tokens.weight", "lm_head.weight")
        return own + tuple(f"later.{i}.{name}" for i in range(len(self.later)) for name in own)

    @property
    def embedded_prefix(self) -> str | tuple[str, ...]:
        first = self.config.num_target_layers
        if not self.later:
            return f"model.layers.{first}."
        return tuple(f"model.layers.{first + i}." for i in range(self.heads))

    @property
    def embedded_promise(self) -> str:
        return f"field 'num_nextn_predict_layers' is {self.config.raw.get('num_nextn_predict_layers', 1)}"

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        hf, kind = nextn_config(config.raw), KINDS[config.family_options["decoder"]]
        self.kind = kind
        self.heads = config.family_options.get("heads", 1)
        add_head_modules(self, config, hf, kind)
        self.later = nn.ModuleList([NextnStage(config, hf, kind) for _ in range(self.heads - 1)])
        self.rowwise_drafts = not self.later  # a stack's steps read their own heads' lm_heads (logits)
        self.d2t = self.t2d = None
        self.rotary = kind.rotary(hf)  # buffers only, not in the state dict
        self.target_norm = None  # the target's final norm (attach_target_head)
        self.target_norm_class = kind.norm

    @property
    def stages(self) -> list[nn.Module]:
        """The heads in order: this model (head 0), then the later ones."""
        return [self, *self.later]

    def drop_weights(self, names) -> None:
        """A later head's absent embed_tokens / lm_head: the target's (as head 0's)."""
        for name in names:
            if not name.startswith("later."):
                super().drop_weights([name])
                continue
            if name not in self.optional_weights:
                raise ValueError(f"{name} is not an optional weight of this drafter")
            _, index, module, _ = name.split(".")
            setattr(self.later[int(index)], module, None)

    def _by_head(self, state: dict) -> list[dict]:
        """The read tensors per head, as each head's own names (a stack's keep `{L + i}.` in front)."""
        if not self.later:
            return [state]
        heads = [{} for _ in range(self.heads)]
        for name, tensor in state.items():
            index, _, rest = name.partition(".")
            heads[int(index) - self.config.num_target_layers][rest] = tensor
        return heads

    def canonical_names(self, state: dict) -> dict:
        out = {}
        for i, part in enumerate(self._by_head(state)):
            named = fuse_experts({_own_name(name): tensor for name, tensor in part.items()})
            out.update({(f"later.{i - 1}." if i else "") + name: tensor for name, tensor in named.items()})
        return out

    def check_checkpoint(self, state: dict, source: str, config_file: str) -> None:
        """Every head the config promises present (model.check_heads_held), then each head's experts
        against the config (experts.check_experts), named as the file names them."""
        first, hf = self.config.num_target_layers, nextn_config(self.config.raw)
        if self.later:
            held = sorted({int(name.split(".")[0]) for name in state})
            where = f"model.layers.{first}..{first + self.heads - 1}.*"
            promised = list(range(first, first + self.heads))
            check_heads_held(held, promised, where, str(self.heads), source, config_file)
        for i, part in enumerate(self._by_head(state)):
            named = {_own_name(name): tensor for name, tensor in part.items()}
            check_experts(named, hf, f"model.layers.{first + i}.mlp.", source, config_file, glm_fields(hf))

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

    def layer_input(self, layer: nn.Module, h: torch.Tensor, embeds: torch.Tensor | None):
        """TargetStateHead's, with the eh_proj and norms of the head whose layer `layer` is."""
        stage = next(s for s in self.stages if s.layers[0] is layer)
        if stage is self:
            return super().layer_input(layer, h, embeds)
        z = stage.fc(torch.cat([stage.pre_fc_norm_embedding(embeds), stage.pre_fc_norm_hidden(h)], dim=-1))
        return layer.input_layernorm(z), z

    # -- a stack under vLLM's default model runner: step j on head j over every slot --------------

    def multi_module(self, conventions: Conventions) -> bool:
        """A stack under vLLM's V2 runner (the reference); head 0's chain under its V1 runner
        (`first_head_only`) and llama.cpp's rule (whose graph builds one head: refused in steps.py)."""
        return bool(self.later) and not (conventions.first_head_only or conventions.lead_slot)

    def context_kv(
        self, features, dtype=None, chunk_rows=None, *, tokens=None, embed=None, attention="dense",
        conventions: Conventions = REFERENCE,
    ) -> list[tuple]:  # fmt: skip
        """Under the multi-module rule, per head j < min(N, steps) its output o_j [1, T, H] at every
        slot: slot s reads (embed(x_{s+1+j}), o_{j-1}[s] as fed on; head 0 the target's state) at
        position s, causal over head j's own slots (its own KV cache). vLLM's draft window
        (multi_module_mtp/speculator.py:426-478) runs head j over its slots with the inputs shifted
        left by j (update_draft_inputs, 467-475, 1002-1031) and the previous head's outputs (455), and
        re-prefills the slots a rejection left stale (514-517, 582-595): teacher-forced, every slot reads the stored tokens."""
        if not self.multi_module(conventions):
            return super().context_kv(
                features, dtype, chunk_rows, tokens=tokens, embed=embed, attention=attention, conventions=conventions
            )
        features, _, table, device, dtype = self.slot_inputs(features, tokens, embed, dtype, conventions)
        total, rows, ids = features.shape[0], chunk_rows or features.shape[0], tokens.to(device)
        outputs, fed = [], None
        with timing.stage("drafter context", tokens=total):
            for j, stage in enumerate(self.stages[: min(self.heads, self.config.block_size)]):
                nxt = torch.cat([ids[1 + j :], ids[-1:].expand(1 + j)])[:total]  # past the sample: never verified
                shape = (self.config.num_key_value_heads, total, self.config.head_dim)
                keys, values = (torch.empty(shape, dtype=dtype, device=device) for _ in range(2))
                out = torch.empty(total, self.config.hidden_size, dtype=dtype, device=device)
                for start in range(0, total, rows):
                    end = min(total, start + rows)
                    part = features[start:end].to(device=device, dtype=dtype)
                    state = self.project(part, conventions) if fed is None else fed[start:end]
                    embeds = nn.functional.embedding(nxt[start:end], table).to(dtype)
                    out[start:end] = self._context_rows(
                        stage.layers[0], state, embeds, keys, values, start, attention, conventions
                    )
                outputs.append((out[None],))
                fed = out if self.kind.feeds_pre_norm else stage.norm(out)  # _run_model's second output (317-323, 455)
        return outputs

    def forward(
        self, block_embeds, anchors, context, attention="dense", ctx_starts=None, conventions: Conventions = REFERENCE
    ) -> torch.Tensor:
        """Under the multi-module rule step j at anchor t is head j's output at slot t - 1, normed by
        its shared_head.norm (compute_logits, deepseek_mtp.py:228-237); else head 0's chain."""
        if not self.multi_module(conventions):
            return super().forward(block_embeds, anchors, context, attention, ctx_starts, conventions)
        steps = block_embeds.shape[1]
        if steps > len(context):
            raise ValueError(f"{steps} steps on a stack of {self.heads} NextN heads (scoring/score/steps.py refuses)")
        rows = anchors - 1 + (torch.zeros_like(anchors) if ctx_starts is None else ctx_starts)
        return torch.stack([s.norm(context[j][0][0, rows]) for j, s in enumerate(self.stages[:steps])], dim=1)

    def logits(self, hidden: torch.Tensor, lm_head: torch.Tensor, conventions: Conventions = REFERENCE):
        """Step j's logits from head j's shared_head.head (absent: the target's lm_head), as vLLM's
        compute_logits picks the head by spec_step_idx (deepseek_mtp.py:228-237)."""
        if not self.multi_module(conventions):
            return super().logits(hidden, lm_head, conventions)
        heads = [lm_head if s.lm_head is None else s.lm_head.weight for s in self.stages[: hidden.shape[-2]]]
        parts = [self.head_logits(hidden[..., j : j + 1, :], w, conventions) for j, w in enumerate(heads)]
        return torch.cat(parts, dim=-2)


def _own_name(name: str) -> str:
    """A tensor of model.layers.{L} (its prefix stripped) under this model's names."""
    return renamed(name, OWN_NAMES, "layers.0.")
