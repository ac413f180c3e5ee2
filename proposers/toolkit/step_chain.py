"""The step-chain drafter EAGLE-3 and the MTP heads are built on: a chain of autoregressive steps
over the target's features, written for batched teacher-forced replay.

Inference (vLLM's EagleProposer, which serves both): slot s of the draft KV is written from the
token after s and the target's features at s, at position s. Step 1 at anchor t is slot t - 1
itself: its last hidden state h_1 gives draft 1. Step j > 1 reads (embed(d_{j-1}), h_{j-1}) at
position t + j - 2, attending to slots < t and to its own earlier steps' keys at that anchor.

Offline (the replay): `context_kv` runs every slot of a sample once, causally, layer by layer,
and keeps each layer's keys/values and the last layer's output of every slot (step 1 at every
anchor). `forward` then runs steps 2.. for a chunk of anchors together, step by step, d_{j-1}
the stored token (teacher-forced: a draft is verified only while the earlier ones equalled the
stored tokens), each step's query seeing the context before its anchor and its own earlier steps
(attention.with_block_keys): speculators' training-time-test forward with its diagonal mask, one
anchor at a time in vLLM, all anchors at once here. `step` is one such step for any rows: the
chain's anchors, or the branches of a tree (proposers/toolkit/eagle/tree.py), each row seeing its own
path of earlier steps.

A family subclasses `StepChainDrafter`, builds `fc`, `layers` (each with `self_attn` and
`finish(attended, residual)`), `norm` and `rotary`, and says how its features and tokens enter:
`project` (the features a slot reads), `layer_input` (what a layer's q/k/v read, and its
residual) and `feedback` (what the next step reads of a step's last hidden state).
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.common import timing
from proposers.toolkit.attention import MASK_BUILDERS, with_block_keys
from proposers.toolkit.conventions import REFERENCE, Conventions
from proposers.toolkit.head import DraftHead


class StepChainDrafter(DraftHead):
    """The chain's context pass and steps; the family's hooks say how its inputs enter."""

    def project(self, features: torch.Tensor, conventions: Conventions = REFERENCE) -> torch.Tensor:
        """[..., H] what slot s reads of the target's features [..., n*H] at s."""
        raise NotImplementedError

    def layer_input(self, layer: nn.Module, h: torch.Tensor, embeds: torch.Tensor | None):
        """(what `layer`'s q/k/v read, its residual) of hidden h [..., H] and, first layer, the
        token embeddings [..., H] (None for the other layers)."""
        raise NotImplementedError

    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        """What the next step reads of this step's last hidden state h."""
        raise NotImplementedError

    def feedback_under(self, h: torch.Tensor, conventions: Conventions) -> torch.Tensor:
        """`feedback` as `conventions` has it: the same under every rule, except where the engines
        disagree on what is fed back (a NextN head, proposers/mtp/nextn.py)."""
        return self.feedback(h)

    def slot_embeds(self, embeds: torch.Tensor, positions: torch.Tensor, conventions: Conventions) -> torch.Tensor:
        """The token embeddings [c, H] the context slots at `positions` [c] read: as they are, except
        where an engine masks one (a NextN head under vLLM zeroes position 0's)."""
        return embeds

    def context_kv(
        self,
        features: torch.Tensor,
        dtype: torch.dtype | None = None,
        chunk_rows: int | None = None,
        *,
        tokens=None,
        embed=None,
        attention="dense",
        conventions: Conventions = REFERENCE,
    ) -> list[tuple]:
        """Per layer (k, v) [kv_heads, T, d] of the slots 0..T-1 (slot s = (embed(x_{s+1}), fc(g_s))
        at position s), then (h [1, T, H],): the last layer's output at every slot, pre-norm.

        Layer by layer, `chunk_rows` slots at a time in order: a chunk's keys are written before its
        queries attend to the keys of every slot up to them (causal), so the pass never holds more
        than the keys, values and two [T, H] layer outputs. The last slot has no next token; its row
        is never visible to an anchor (anchor t sees slots < t <= T - 2), its own token stands in."""
        features, nxt, table, device, dtype = self.slot_inputs(features, tokens, embed, dtype, conventions)
        total = features.shape[0]
        rows = chunk_rows or total
        with timing.stage("drafter context", tokens=total):
            kv, h = [], None
            for layer in self.layers:
                shape = (self.config.num_key_value_heads, total, self.config.head_dim)
                keys, values = (
                    torch.empty(shape, dtype=dtype, device=device),
                    torch.empty(shape, dtype=dtype, device=device),
                )
                out = torch.empty(total, self.config.hidden_size, dtype=dtype, device=device)
                for start in range(0, total, rows):
                    end = min(total, start + rows)
                    if h is None:  # the first layer reads the target's features and the next tokens
                        rows_in = features[start:end].to(device=device, dtype=dtype, non_blocking=True)
                        inputs = self.project(rows_in, conventions)
                        embeds = nn.functional.embedding(nxt[start:end], table).to(dtype)
                    else:
                        inputs, embeds = h[start:end], None
                    out[start:end] = self._context_rows(
                        layer, inputs, embeds, keys, values, start, attention, conventions
                    )
                kv.append((keys, values))
                h = out
        return kv + [(h[None],)]

    def slot_inputs(self, features, tokens, embed, dtype, conventions: Conventions):
        """(features [T, .], the token each slot reads [T], the embedding table, device, dtype) of the
        context pass, under llama.cpp's lead slot where the rule has one."""
        if tokens is None or embed is None:
            raise ValueError("a step chain's context rows read the sample's tokens and the target's embedding")
        if conventions.lead_slot:  # slot k reads (x_k, row k - 1); the last row is never visible
            features = torch.cat([torch.zeros_like(features[:1]), features[:-1]])
            tokens = torch.cat([tokens[:1], tokens])
        device = self.fc.weight.device
        nxt = torch.cat([tokens[1:], tokens[-1:]]).to(device)  # [T] the token slot s reads
        return features, nxt, self.embedding_table(embed), device, dtype or features.dtype

    def _context_rows(self, layer: nn.Module, inputs, embeds, keys, values, start: int, attention: str, conventions):
        """Layer output [c, H] of slots start..start + c - 1 (inputs [c, H]); writes their keys and
        values into keys/values [kv_heads, T, d], which must hold every slot before them."""
        end = start + inputs.shape[0]
        positions = torch.arange(start, end, device=inputs.device)
        if embeds is not None:
            embeds = self.slot_embeds(embeds, positions, conventions)
        x, residual = self.layer_input(layer, inputs, embeds)
        cos, sin = self.rope(x, positions)
        k, v = layer.self_attn.keys_values(x, cos, sin)  # [kv_heads, c, d]
        keys[:, start:end], values[:, start:end] = k, v
        q = layer.self_attn.queries(x, cos, sin)  # [heads, c, d]
        # slot s: the slots before it as context, its own key as a block of one
        mask = MASK_BUILDERS[_backend(attention)](positions, 1, end, False, None)
        one = [x.transpose(0, 1)[:, :, None] for x in (q, k, v)]  # [c, heads or kv_heads, 1, d]
        attended = layer.self_attn.attend_to(*one, keys[:, :end], values[:, :end], mask)  # [c, 1, H]
        return layer.finish(attended[:, 0], residual)

    # -- the chain: steps 2.. of a chunk of anchors ------------------------------------------

    def forward(
        self,
        block_embeds: torch.Tensor,
        anchors: torch.Tensor,
        context: list,
        attention: str = "dense",
        ctx_starts: torch.Tensor | None = None,
        conventions: Conventions = REFERENCE,
    ) -> torch.Tensor:
        """Post-norm hidden states [A, b, H] of steps 1..b at `anchors` (positions in their samples,
        which start at `ctx_starts` in the packed context); block_embeds [A, b, H] embed the stored
        tokens x_t, y_{t+1}, ..., the input of each step."""
        if conventions.block_position_offset or conventions.context_offset:
            raise ValueError("a step chain has no block whose positions or context could shift")
        anchors = anchors + int(conventions.lead_slot)  # llama.cpp's slot t is the reference's t - 1
        with timing.stage("drafter steps", anchors=block_embeds.shape[0], block=block_embeds.shape[1]):
            return self._steps(block_embeds, anchors, context, _backend(attention), ctx_starts, conventions)

    def _steps(self, block_embeds, anchors, context, attention, ctx_starts, conventions) -> torch.Tensor:
        h = self.first_hidden(anchors, context, ctx_starts)  # [A, H]
        hidden = [self.norm(h)]
        base, layer_kv = self.step_context(anchors, context, attention, ctx_starts)
        path = None  # per layer, the keys and values of steps 2..j [A, kv_heads, j - 1, d]
        for j in range(1, block_embeds.shape[1]):
            positions = (anchors + j - 1)[:, None]  # [A, 1] step j + 1 sits at t - 1 + j
            h, path = self.step(h, block_embeds[:, j], positions, base, layer_kv, path, conventions)
            hidden.append(self.norm(h))
        return torch.stack(hidden, dim=1)

    @staticmethod
    def first_hidden(anchors, context, ctx_starts=None) -> torch.Tensor:
        """[A, H] step 1 at each anchor t: slot t - 1's last hidden state (pre-norm), from `context_kv`."""
        starts = torch.zeros_like(anchors) if ctx_starts is None else ctx_starts
        return context[-1][0][0, starts + anchors - 1]

    def step_context(self, anchors, context, attention="dense", ctx_starts=None):
        """(the mask letting a step at each of `anchors` [R] see the slots before it, the layers'
        context (k, v)) for `step`; rows may repeat an anchor (a tree's branches)."""
        *layer_kv, _ = context
        starts = torch.zeros_like(anchors) if ctx_starts is None else ctx_starts
        with timing.stage("masks"):  # a step's own path keys are added per step (with_block_keys)
            base = MASK_BUILDERS[_backend(attention)](anchors, 1, layer_kv[0][0].shape[-2], False, None, starts)
        return base, layer_kv

    def step(self, h, embeds, positions, base, layer_kv, path, conventions: Conventions = REFERENCE):
        """One drafter step for rows [R] (a chain's anchors, or a tree's branches): h [R, H] the
        previous step's last hidden state (fed back), embeds [R, H] the token it reads, positions
        [R, 1]; each row sees the context `base` lets it see and the keys of `path` (per layer
        (k, v) [R, kv_heads, m, d], None before any: the earlier steps on its own path) beside its
        own. Returns (h [R, H] pre-norm, `path` with this step's keys appended)."""
        h, embeds, grown = self.feedback_under(h, conventions)[:, None], embeds[:, None], []
        for i, (layer, (ctx_k, ctx_v)) in enumerate(zip(self.layers, layer_kv)):
            x, residual = self.layer_input(layer, h, embeds)
            cos, sin = self.rope(x, positions)
            k, v = layer.self_attn.keys_values(x, cos, sin)  # [R, kv_heads, 1, d]
            if path is not None:
                k, v = torch.cat([path[i][0], k], 2), torch.cat([path[i][1], v], 2)
            grown.append((k, v))
            q = layer.self_attn.queries(x, cos, sin)  # [R, heads, 1, d]
            mask = with_block_keys(base, k.shape[2])
            h = layer.finish(layer.self_attn.attend_to(q, k, v, ctx_k, ctx_v, mask), residual)
        return h[:, 0], grown


def _backend(attention: str) -> str:
    """flex is the block drafters' block-sparse kernel for blocks of many queries; a chain's steps have one
    query per anchor, which the blockwise path (running softmax over key chunks) serves on any device."""
    return "blockwise" if attention == "flex" else attention
