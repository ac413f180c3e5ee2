"""DeepSeek-V4's own MTP head (`num_nextn_predict_layers` 1, weights `mtp.0.*` in the target's
checkpoint), written for batched teacher-forced replay of its chain.

One head (vLLM 0.33 `vllm/models/deepseek_v4/nvidia/mtp.py`, `DeepSeekV4MultiTokenPredictorLayer`,
98-210; llama.cpp `src/models/deepseek4.cpp:1362-1500`, `graph_mtp`):
  - it reads the target's last layer output as its `hc_mult` hyper-connection streams [hc, H], before
    the target's hc_head and final norm (vLLM's `_mtp_hidden_buffer`, nvidia/model.py:1036-1038;
    llama.cpp's `t_h_nextn` = the streams, deepseek4.cpp:1334-1341): this project's id L, stored as
    the flat streams [hc * H] for a hyper-connection target (pipeline/extract/capture.py);
  - z = h_proj(hnorm(streams)) + e_proj(enorm(embed(x))), the embedding added to every stream, hnorm per
    stream (mtp.py:162-185; fused_mtp_input_rmsnorm.py:87-119); llama.cpp runs eh_proj over
    [enorm(e) ; hnorm(h)] per stream with eh_proj = [e_proj | h_proj] (conversion/deepseek.py:788-797,
    deepseek4.cpp:1406-1418): the same sum;
  - one DeepSeek-V4 block on the streams (mtp_block, mtp.py:139-144, 198-204; deepseek4.cpp:1420-1476):
    sliding-window attention, never compressed (vLLM's attention.py:236-242 gives a layer past the
    target's ratio 1; llama.cpp marks it SWA, deepseek4.cpp:72-74), sinks, the MoE with its shared expert;
  - logits lm_head(norm(hc_head(streams'))) with the head's own hc_head and `norm` (shared_head.norm)
    and the target's lm_head (compute_logits, mtp.py:274-300; deepseek4.cpp:1483-1497: the MTP GGUF's
    root hc_head is the head's, conversion/deepseek.py:600-606);
  - the next step reads the output streams before hc_head, in both engines (mtp.py:207-210;
    `t_h_nextn`, deepseek4.cpp:1477-1481).

The engines differ only where they differ for every NextN head (docs/drafter-families.md#nextn-heads):
vLLM zeroes the embedding of the slot at position 0 (fused_mtp_input_rmsnorm.py:88-96), llama.cpp has a
lead slot there instead (`Conventions.lead_slot`, `--walk-rule llama.cpp`). With its one head llama.cpp
grows the head's own KV step by step as vLLM does (common/speculative.cpp:1421, chain_heads off).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

from pipeline.common import timing
from pipeline.common.errors import UserError
from proposers.checkpoints.files import CheckpointError
from proposers.mtp.model import TargetStateHead
from proposers.toolkit.attention import MASK_BUILDERS, with_block_keys
from proposers.toolkit.config import DrafterConfig
from proposers.toolkit.conventions import REFERENCE, Conventions
from proposers.toolkit.dsv4.chain import ChainLayer
from proposers.toolkit.dsv4.decoder import HyperHead, MainRotary, dsv4_config
from proposers.toolkit.dsv4.names import dsv4_state

# the head's own checkpoint names (DeepSeek's, read by vLLM's load_weights, mtp.py:359-557, and llama.cpp's
# converter, conversion/deepseek.py:583-618) -> this model's; the rest of mtp.0 is its block, layers.0
ROOT = {
    "e_proj.": "e_proj.", "h_proj.": "h_proj.", "enorm.": "enorm.", "hnorm.": "hnorm.", "norm.": "norm.",
    "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale",
}  # fmt: skip


class DSV4MtpDrafter(TargetStateHead):
    """The head as a step chain: one DeepSeek-V4 block reused at every step, its keys kept row by row."""

    embedded_prefix = "mtp."
    embedded_promise = "field 'num_nextn_predict_layers' is 1"

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        hf = dsv4_config(config.raw, 1)
        hidden, eps = hf.hidden_size, hf.rms_norm_eps
        self.hc = hf.hc_mult
        self.window = hf.sliding_window
        self.enorm, self.hnorm, self.norm = (DeepseekV4RMSNorm(hidden, eps) for _ in range(3))
        self.e_proj = nn.Linear(hidden, hidden, bias=False)
        self.h_proj = nn.Linear(hidden, hidden, bias=False)
        self.layers = nn.ModuleList([ChainLayer(hf)])
        self.hc_head = HyperHead(hf)
        self.rotary = MainRotary(hf)  # buffers only, not in the state dict
        self.embed_tokens = None  # the target's embedding and lm_head (DeepSeek's MTPBlock shares them)
        self.lm_head = self.d2t = self.t2d = None
        self.target_norm = None

    @property
    def fc(self) -> nn.Linear:
        return self.e_proj  # the device and dtype the context pass takes

    def canonical_names(self, state: dict) -> dict:
        return dsv4_state({f"mtp.{name}": tensor for name, tensor in state.items()}, ROOT)

    def check_checkpoint(self, state: dict, source: str, config_file: str) -> None:
        """Quantized tensors (DeepSeek's FP8 block scales, MXFP4 experts) refused by their first scale;
        a second head refused: the config says one (field num_nextn_predict_layers)."""
        scale = next((name for name in state if name.endswith(".scale")), None)
        if scale is not None:
            raise CheckpointError(
                f"{source}: tensor 'mtp.{scale}' is a quantization scale; specreplay reads DeepSeek-V4's MTP head in "
                "bf16 or fp32 only; dequantize the checkpoint first (FP8 block scales, MXFP4 experts)"
            )
        other = sorted({name.split(".")[0] for name in state} - {"0"})
        if other:
            raise CheckpointError(
                f"{source}: mtp.{other[0]}.* is a second MTP head, but {config_file} says "
                "'num_nextn_predict_layers' 1; set it to the heads the checkpoint holds (specreplay scores one)"
            )

    def attach_target_head(self, target) -> None:
        """Nothing of the target's final norm: the head reads the streams before it."""

    def project(self, features: torch.Tensor, conventions: Conventions = REFERENCE) -> torch.Tensor:
        """The stored id L [..., hc * H] as its streams [..., hc, H]."""
        return features.unflatten(-1, (self.hc, -1))

    def combine(self, streams: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """z [B, S, hc, H] = h_proj(hnorm(streams)) + e_proj(enorm(embeds)) into every stream (mtp.py:183-185)."""
        return self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(embeds)).unsqueeze(-2)

    def logit_state(self, streams: torch.Tensor) -> torch.Tensor:
        """What lm_head reads of output streams [B, S, hc, H]: norm(hc_head(.)) (compute_logits, mtp.py:283-299)."""
        return self.norm(self.hc_head(streams))

    def slot_embeds(self, embeds: torch.Tensor, positions: torch.Tensor, conventions: Conventions) -> torch.Tensor:
        """vLLM zeroes the embedding at position 0 (fused_mtp_input_rmsnorm.py:88-96); llama.cpp's lead slot
        there keeps its own (graph_mtp masks nothing, deepseek4.cpp:1393-1412)."""
        if conventions.lead_slot:
            return embeds
        return torch.where((positions == 0)[:, None], torch.zeros_like(embeds), embeds)

    # -- the context pass: every verified slot ---------------------------------------------------

    def context_kv(
        self, features, dtype=None, chunk_rows=None, *, tokens=None, embed=None, attention="dense",
        conventions: Conventions = REFERENCE,
    ) -> list[tuple]:  # fmt: skip
        """[(k, v) [1, T, d + heads] of slots 0..T-1 (slot s = (embed(x_{s+1}), streams s) at position s;
        llama.cpp's lead slot as step_chain.context_kv), (the head's output streams, flat [1, T, hc * H],)]."""
        if features.shape[-1] != self.hc * self.config.hidden_size:  # id L stored as the streams' mean
            raise UserError(
                f"the shards' id {self.config.num_target_layers} is {features.shape[-1]} wide, not the target's "
                f"{self.hc} streams ({self.hc * self.config.hidden_size}) DeepSeek-V4's MTP head reads; extract it "
                "again with this specreplay, which stores id L of a hyper-connection target as its streams"
            )
        features, nxt, table, device, dtype = self.slot_inputs(features, tokens, embed, dtype, conventions)
        total, rows = features.shape[0], chunk_rows or features.shape[0]
        attn = self.layers[0].self_attn
        shape = (1, total, attn.head_dim + attn.num_heads)
        keys, values = torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
        out = torch.empty(total, self.hc, self.config.hidden_size, dtype=dtype, device=device)
        with timing.stage("drafter context", tokens=total):
            for start in range(0, total, rows):
                end = min(total, start + rows)
                streams = self.project(features[start:end].to(device=device, dtype=dtype), conventions)
                positions = torch.arange(start, end, device=device)
                embeds = self.slot_embeds(
                    nn.functional.embedding(nxt[start:end], table).to(dtype), positions, conventions
                )
                out[start:end] = self._context_rows(streams, embeds, positions, keys, values, attention)
        return [(keys, values), (out.flatten(1)[None],)]  # 3-D, as every context entry (neural.finite_context)

    def _context_rows(self, streams, embeds, positions, keys, values, attention: str) -> torch.Tensor:
        """The head's output streams [c, hc, H] at `positions`; writes their keys and values."""
        layer, (start, end) = self.layers[0], (int(positions[0]), int(positions[-1]) + 1)
        x, residual = layer.enter(self.combine(streams[None], embeds[None]))  # [1, c, H]
        cos, sin = self.rope(x, positions[None])
        k, v = layer.self_attn.keys_values(x, cos, sin)  # [1, 1, c, d + heads]
        keys[:, start:end], values[:, start:end] = k[0], v[0]
        q = layer.self_attn.queries(x, cos, sin)[0].transpose(0, 1)[:, :, None]  # [c, heads, 1, d + heads]
        mask = with_block_keys(MASK_BUILDERS[_backend(attention)](positions, 1, end, False, self.window), 2)
        sink_k, sink_v = layer.self_attn.sink(end - start, q)
        own = k[0, 0][:, None, None]  # [c, 1, 1, d + heads]
        rows = cos[0][:, None], sin[0][:, None]
        attended = layer.self_attn.attend_to(
            q, torch.cat([sink_k, own], 2), torch.cat([sink_v, own], 2), keys[:, :end], values[:, :end], mask, *rows
        )  # [c, 1, H]
        return layer.finish(attended[None, :, 0], residual)[0]

    # -- the chain: steps 2.. of a chunk of anchors ---------------------------------------------

    def _steps(self, block_embeds, anchors, context, attention, ctx_starts, conventions) -> torch.Tensor:
        """States lm_head reads [A, b, H]. Row r (1..) reads (token r, the streams row r - 1 gave) at
        position t - 1 + r, seeing the context before the anchor within its window, the sink and the
        rows before it at this anchor (the head's own growing KV, both engines)."""
        (ctx_k, ctx_v), _ = context
        streams = self.project(self.first_hidden(anchors, context, ctx_starts))[:, None]  # [A, 1, hc, H]
        hidden = [self.logit_state(streams)[:, 0]]
        starts = torch.zeros_like(anchors) if ctx_starts is None else ctx_starts
        layer, backend = self.layers[0], _backend(attention)
        keys = layer.self_attn.sink(anchors.shape[0], block_embeds)
        for r in range(1, block_embeds.shape[1]):
            x, residual = layer.enter(self.combine(streams, block_embeds[:, r : r + 1]))  # [A, 1, H]
            cos, sin = self.rope(x, (anchors + r - 1)[:, None])
            k, v = layer.self_attn.keys_values(x, cos, sin)  # [A, 1, 1, d + heads]
            keys = torch.cat([keys[0], k], 2), torch.cat([keys[1], v], 2)
            window = None if self.window is None else self.window - (r - 1)  # q - p < w at t - 1 + r
            with timing.stage("masks"):
                base = MASK_BUILDERS[backend](anchors, 1, ctx_k.shape[-2], False, window, starts)
            q = layer.self_attn.queries(x, cos, sin)
            attended = layer.self_attn.attend_to(
                q, *keys, ctx_k, ctx_v, with_block_keys(base, keys[0].shape[2]), cos, sin
            )
            streams = layer.finish(attended, residual)
            hidden.append(self.logit_state(streams)[:, 0])
        return torch.stack(hidden, dim=1)


def _backend(attention: str) -> str:
    """A chain step has one query per anchor: the blockwise path serves it where flex would (step_chain.py)."""
    return "blockwise" if attention == "flex" else attention
