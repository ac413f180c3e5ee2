"""MiMo-V2-Flash's MTP heads: `model.mtp.layers.{0..n-1}.*` of the target's checkpoint (three in
the released ones), each a NextN layer of its own, written for batched teacher-forced replay.

One head (vLLM 0.33 `model_executor/models/mimo_v2_mtp.py:61-142`, `MiMoV2MTPLayer`):
  z = eh_proj([enorm(embed(x)) ; hnorm(h)])  (128-132, embedding first)
  u = z + attn(input_layernorm(z)); h' = u + mlp(pre_mlp_layernorm(u))  (134-140)
  logits = lm_head(final_layernorm(h'))  (142; compute_logits 214-220 applies lm_head alone)
Its attention is the target's sliding-window kind (78-107): `swa_*` heads and widths, values scaled
by attention_value_scale, a learned per-head sink logit (`attention_sink_bias`) beside the keys in
every softmax, partial RoPE at swa_rope_theta, window `sliding_window_size`; the MLP is dense.
q/k/v are `q_proj`/`k_proj`/`v_proj` (Flash) or one fused `qkv_proj` [Q;K;V] (MiMo-V2.5, and what
llama.cpp's MTP graph asserts, src/models/mimo2.cpp:285): split here (`canonical_names`).

Where the engines' loops differ (docs/drafter-families.md#mimo-v2-flash-mtp-heads):
  - vLLM (the default): only head 0 is built (`_MIMO_V2_FLASH_NUM_MTP_LAYERS = 1`, 52-54; 177; config/speculative.py:831-845)
    and reused at every step (`spec_step_idx % 1`, 209-210); the step output AFTER final_layernorm is
    fed back (the single returned tensor, 142; v1/spec_decode/llm_base_proposer.py:599-602,753-760),
    and step 1 reads the target's state after its final norm (mimo_v2.py:848).
  - llama.cpp (`--walk-rule llama.cpp`, `Conventions.chain_heads`): step k runs head k
    (common/speculative.cpp:1621-1630 `llama_set_nextn_layer_offset(ctx_dft, i)`), n_max capped at the
    head count (1421-1425); each head keeps its own KV of the verified context (process() decodes the
    batch under every head, 1533-1552) and re-decodes the drafted prefix at each step with the states
    the earlier heads returned (1686-1697); what is fed on is the state BEFORE final_layernorm
    (`t_h_nextn`, src/models/mimo2.cpp:389-390), and step 1 reads the target's state before its final
    norm too (mimo2.cpp:244-253).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import MiMoV2FlashConfig
from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import (
    MiMoV2FlashMLP,
    MiMoV2FlashRMSNorm,
    MiMoV2FlashRotaryEmbedding,
)

from pipeline.common import timing
from proposers.mtp.model import TargetStateHead, check_heads_held, partial_rope
from proposers.toolkit.attention import MASK_BUILDERS, attend, with_block_keys
from proposers.toolkit.config import DrafterConfig
from proposers.toolkit.conventions import REFERENCE, Conventions

SWA = "sliding_attention"


def head_config(raw: dict) -> MiMoV2FlashConfig:
    """transformers' config of one head's layer: the `swa_*` shapes as its own, every layer kind the
    sliding one (its rotary at swa_rope_theta), the MLP dense."""
    theta = raw.get("swa_rope_theta", raw.get("rope_theta", 10000.0))
    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": raw.get("partial_rotary_factor", 1.0)}
    return MiMoV2FlashConfig(
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=1,
        num_attention_heads=raw["swa_num_attention_heads"],
        num_key_value_heads=raw["swa_num_key_value_heads"],
        head_dim=raw["swa_head_dim"],
        v_head_dim=raw.get("swa_v_head_dim") or raw["swa_head_dim"],
        rms_norm_eps=raw.get("layernorm_epsilon", 1e-5),
        layer_types=[SWA],
        mlp_layer_types=["dense"],
        rope_parameters={SWA: rope},
        vocab_size=raw.get("vocab_size", 152576),
    )


class SwaRotary(nn.Module):
    """transformers' MiMo rotary embedding at its sliding-window parameters (DraftHead.rope's call)."""

    def __init__(self, hf: MiMoV2FlashConfig):
        super().__init__()
        self.inner = MiMoV2FlashRotaryEmbedding(hf)
        self.config = hf

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        return self.inner(x, positions, SWA)


class MimoAttention(nn.Module):
    """MiMoV2FlashAttention's arithmetic for the step chain. Keys and values are kept per query head
    (kv heads repeated) with one more dim, so that the sink is one more key: a query's extra dim is 1,
    a real key's 0, the sink key's sink / scale, the sink value 0 (the softmax's extra column,
    transformers' eager_attention_forward). Values are zero-padded to the key width, cut after."""

    def __init__(self, hf: MiMoV2FlashConfig, sinks: bool, bias: bool):
        super().__init__()
        hidden, self.heads, self.kv_heads = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads
        self.head_dim, self.v_dim, self.v_scale = hf.head_dim, hf.v_head_dim, hf.attention_value_scale or 1.0
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.v_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.v_dim, hidden, bias=False)
        self.attention_sink_bias = nn.Parameter(torch.zeros(self.heads)) if sinks else None
        self.scale = self.head_dim**-0.5

    def queries(self, x, cos, sin) -> torch.Tensor:
        """x [..., T, H] -> [..., heads, T, d + 1]."""
        q = partial_rope(self.q_proj(x).view(*x.shape[:-1], self.heads, self.head_dim).transpose(-2, -3), cos, sin)
        return torch.cat([q, torch.ones_like(q[..., :1])], dim=-1)

    def keys_values(self, x, cos, sin):
        """x [..., T, H] -> keys and values [..., heads, T, d + 1]."""
        k = self.k_proj(x).view(*x.shape[:-1], self.kv_heads, self.head_dim).transpose(-2, -3)
        v = self.v_proj(x).view(*x.shape[:-1], self.kv_heads, self.v_dim).transpose(-2, -3) * self.v_scale
        k = partial_rope(k, cos, sin).repeat_interleave(self.heads // self.kv_heads, dim=-3)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=-3)
        k = torch.cat([k, torch.zeros_like(k[..., :1])], dim=-1)
        return k, nn.functional.pad(v, (0, self.head_dim + 1 - self.v_dim))

    def sink(self, rows: int, like: torch.Tensor):
        """The sink as a key and a value [rows, heads, 1, d + 1] (none: a key no query sees much of)."""
        k = like.new_zeros(rows, self.heads, 1, self.head_dim + 1)
        if self.attention_sink_bias is None:
            k[..., -1] = float("-inf")
        else:
            k[..., -1] = (self.attention_sink_bias / self.scale).to(like)[None, :, None]
        return k, torch.zeros_like(k)

    def attend_to(self, q, k, v, ctx_k, ctx_v, mask) -> torch.Tensor:
        """q [A, heads, 1, d + 1] to [context ; block keys (the sink first)] -> [A, 1, H]."""
        A = q.shape[0]
        with timing.stage("attention"):
            out = attend(q, k, v, ctx_k, ctx_v, mask, self.scale)[..., : self.v_dim]
        return self.o_proj(out.transpose(1, 2).reshape(A, 1, -1))


class MimoHead(nn.Module):
    """One MTP head, its modules named as the checkpoint's `model.mtp.layers.{i}.*`."""

    def __init__(self, raw: dict, hf: MiMoV2FlashConfig):
        super().__init__()
        hidden, eps = hf.hidden_size, hf.rms_norm_eps
        self.enorm = MiMoV2FlashRMSNorm(hidden, eps)
        self.hnorm = MiMoV2FlashRMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm = MiMoV2FlashRMSNorm(hidden, eps)
        sinks = bool(raw.get("add_swa_attention_sink_bias", False))
        self.self_attn = MimoAttention(hf, sinks, bool(raw.get("attention_bias", False)))
        self.pre_mlp_layernorm = MiMoV2FlashRMSNorm(hidden, eps)
        self.mlp = MiMoV2FlashMLP(hf, intermediate_size=hf.intermediate_size)
        self.final_layernorm = MiMoV2FlashRMSNorm(hidden, eps)

    def combine(self, h: torch.Tensor, embeds: torch.Tensor):
        """(what q/k/v read, the residual) of state h and token embeddings: mimo_v2_mtp.py:128-136."""
        z = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(h)], dim=-1))
        return self.input_layernorm(z), z

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        u = residual + attended
        return u + self.mlp(self.pre_mlp_layernorm(u))


class MimoDrafter(TargetStateHead):
    """The heads as a step chain: under vLLM's rule head 0 at every step, under llama.cpp's
    (`chain_heads`) head k at step k (module docstring)."""

    embedded_prefix = "model.mtp."

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        hf = head_config(config.raw)
        self.heads = config.family_options["heads"]
        self.window = config.family_options.get("window")
        self.layers = nn.ModuleList([MimoHead(config.raw, hf) for _ in range(self.heads)])
        self.rotary = SwaRotary(hf)  # buffers only, not in the state dict
        self.embed_tokens = None  # the target's embedding and lm_head
        self.lm_head = self.d2t = self.t2d = None
        self.target_norm = None  # the target's final norm (attach_target_head)
        self.target_norm_class = MiMoV2FlashRMSNorm

    @property
    def embedded_promise(self) -> str:
        return f"MiMo-V2-Flash's config promises {self.heads} MTP heads"

    @property
    def fc(self) -> nn.Linear:
        return self.layers[0].eh_proj  # the device and dtype the context pass and attach_target_head take

    def canonical_names(self, state: dict) -> dict:
        """A fused `qkv_proj` [Q;K;V] split into q/k/v_proj (mimo_v2_mtp.py:13-16: Pro/V2.5 vs Flash)."""
        out = {}
        for name, tensor in state.items():
            if ".self_attn.qkv_proj." not in name:
                out[name] = tensor
                continue
            attn = self.layers[0].self_attn
            widths = [attn.heads * attn.head_dim, attn.kv_heads * attn.head_dim, attn.kv_heads * attn.v_dim]
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split(widths)):
                out[name.replace("qkv_proj", part)] = piece
        return out

    def check_checkpoint(self, state: dict, source: str, config_file: str) -> None:
        """Every head the config promises present (a missing one would score the others' rule)."""
        held = sorted({int(name.split(".")[1]) for name in state if name.startswith("layers.")})
        said = f"{self.heads} (absent: 3, llama.cpp's conversion/mimo.py:22-24)"
        check_heads_held(held, list(range(self.heads)), "model.mtp.layers.*", said, source, config_file)

    def head_at(self, step: int, conventions: Conventions) -> int:
        """The head drafting step `step` (0-based): llama.cpp's step k, vLLM's head 0 always."""
        if not conventions.chain_heads:
            return 0
        if step >= self.heads:
            raise ValueError(f"llama.cpp drafts at most {self.heads} steps with {self.heads} chained heads")
        return step

    def project(self, features: torch.Tensor, conventions: Conventions = REFERENCE) -> torch.Tensor:
        """Step 1's state: after the target's final norm (vLLM), before it (llama.cpp's `t_h_nextn`)."""
        if conventions.chain_heads:
            return features
        return super().project(features, conventions)

    def fed_on(self, h: torch.Tensor, head: int, conventions: Conventions) -> torch.Tensor:
        """What the next step reads of head `head`'s output: llama.cpp's pre-norm state, vLLM's after
        final_layernorm."""
        return h if conventions.chain_heads else self.layers[head].final_layernorm(h)

    # -- the context pass: every verified slot under each head the rule runs ------------------

    def context_kv(
        self, features, dtype=None, chunk_rows=None, *, tokens=None, embed=None, attention="dense",
        conventions: Conventions = REFERENCE,
    ) -> list[tuple]:  # fmt: skip
        """Per head the rule runs (k, v) [heads, T, d + 1] of slots 0..T-1 (slot s = (embed(x_{s+1}),
        state s) at position s; llama.cpp's lead slot as step_chain.context_kv), then (h [1, T, H],):
        head 0's output at every slot, before final_layernorm (step 1 at every anchor)."""
        features, nxt, table, device, dtype = self.slot_inputs(features, tokens, embed, dtype, conventions)
        total, rows = features.shape[0], chunk_rows or features.shape[0]
        heads = self.heads if conventions.chain_heads else 1
        kv, first = [], None
        with timing.stage("drafter context", tokens=total):
            for index in range(heads):
                shape = (self.layers[0].self_attn.heads, total, self.layers[0].self_attn.head_dim + 1)
                keys, values = (
                    torch.empty(shape, dtype=dtype, device=device),
                    torch.empty(shape, dtype=dtype, device=device),
                )
                out = torch.empty(total, self.config.hidden_size, dtype=dtype, device=device)
                for start in range(0, total, rows):
                    end = min(total, start + rows)
                    state = self.project(features[start:end].to(device=device, dtype=dtype), conventions)
                    embeds = nn.functional.embedding(nxt[start:end], table).to(dtype)
                    out[start:end] = self._context_rows(index, state, embeds, keys, values, start, attention)
                kv.append((keys, values))
                first = out if first is None else first
        return kv + [(first[None],)]

    def _context_rows(self, index: int, state, embeds, keys, values, start: int, attention: str):
        """Head `index`'s output [c, H] at slots start..; writes their keys and values."""
        head, end = self.layers[index], start + state.shape[0]
        positions = torch.arange(start, end, device=state.device)
        x, residual = head.combine(state, embeds)
        cos, sin = self.rope(x, positions)
        k, v = head.self_attn.keys_values(x, cos, sin)  # [heads, c, d + 1]
        keys[:, start:end], values[:, start:end] = k, v
        q = head.self_attn.queries(x, cos, sin)
        mask = with_block_keys(MASK_BUILDERS[_backend(attention)](positions, 1, end, False, self.window), 2)
        sink_k, sink_v = head.self_attn.sink(end - start, q)
        block = [torch.cat([sink, own.transpose(0, 1)[:, :, None]], dim=2) for sink, own in ((sink_k, k), (sink_v, v))]
        attended = head.self_attn.attend_to(q.transpose(0, 1)[:, :, None], *block, keys[:, :end], values[:, :end], mask)
        return head.finish(attended[:, 0], residual)

    # -- the chain: steps 2.. of a chunk of anchors -------------------------------------------

    def _steps(self, block_embeds, anchors, context, attention, ctx_starts, conventions) -> torch.Tensor:
        """Post-norm states [A, b, H]. Step j (0-based) runs head_at(j) over the drafted rows 1..j
        (row r: token r, the state step r - 1 fed on, position t - 1 + r), seeing the context before
        the anchor: a head reused (vLLM) keeps the keys of the rows it ran (its own KV) and runs row j
        alone; a new head (llama.cpp) writes its own for the whole drafted prefix, as
        common/speculative.cpp:1686-1697 re-decodes it."""
        *layer_kv, _ = context
        states = [self.first_hidden(anchors, context, ctx_starts)]  # pre-norm outputs, step by step
        hidden, heads = [self.layers[0].final_layernorm(states[0])], [0]
        starts = torch.zeros_like(anchors) if ctx_starts is None else ctx_starts
        ctx_len, backend = layer_kv[0][0].shape[-2], _backend(attention)
        bases = [self._base(anchors, starts, ctx_len, backend, r) for r in range(1, block_embeds.shape[1])]
        held = {}  # head index -> (its block keys, the sink first; the rows they hold)
        for j in range(1, block_embeds.shape[1]):
            index = self.head_at(j, conventions)
            head, (ctx_k, ctx_v) = self.layers[index], layer_kv[index if conventions.chain_heads else 0]
            keys, done = held.get(index, ([head.self_attn.sink(anchors.shape[0], block_embeds)], 0))
            for r in range(done + 1, j + 1):
                state = self.fed_on(states[r - 1], heads[r - 1], conventions)[:, None]
                out, keys = self._row(
                    head, state, block_embeds[:, r : r + 1], anchors + r - 1, bases[r - 1], ctx_k, ctx_v, keys
                )
            held[index] = keys, j
            states.append(out)
            heads.append(index)
            hidden.append(head.final_layernorm(out))
        return torch.stack(hidden, dim=1)

    def _base(self, anchors, starts, ctx_len: int, backend: str, r: int):
        """The context a drafted row r sees: slots before the anchor, within the window of its own
        position t - 1 + r (q - p < w there is t - p < w - (r - 1) at the anchor)."""
        window = None if self.window is None else self.window - (r - 1)
        with timing.stage("masks"):
            return MASK_BUILDERS[backend](anchors, 1, ctx_len, False, window, starts)

    def _row(self, head: MimoHead, state, embeds, positions, base, ctx_k, ctx_v, keys):
        """One drafted row for every anchor: state, embeds [A, 1, H] at positions [A]; `keys` the
        block keys so far (the sink first). Returns (its output [A, H], keys with its own)."""
        x, residual = head.combine(state, embeds)
        cos, sin = self.rope(x, positions[:, None])
        k, v = head.self_attn.keys_values(x, cos, sin)  # [A, heads, 1, d + 1]
        keys = [(torch.cat([keys[0][0], k], 2), torch.cat([keys[0][1], v], 2))]
        q = head.self_attn.queries(x, cos, sin)
        k, v = keys[0]
        out = head.finish(head.self_attn.attend_to(q, k, v, ctx_k, ctx_v, with_block_keys(base, k.shape[2])), residual)
        return out[:, 0], keys


def _backend(attention: str) -> str:
    """A chain step has one query per anchor: the blockwise path serves it where flex would (step_chain.py)."""
    return "blockwise" if attention == "flex" else attention
