"""The conventions a replay follows, as explicit switches: the reference's, or one changed on purpose.

A drafter trained under a convention that differs from the reference's (block position ids one
too high, the wrong feature layer, one context position too many, ...) scores badly under the
reference, although its weights are fine. `specreplay diagnose` replays a checkpoint with one
switch changed at a time to find which. `score` uses `REFERENCE`, the reference's semantics
(docs/anchors-and-blocks.md), except where its --walk-rule names an engine that computes a
drafter otherwise (`lead_slot`: llama.cpp's MTP; scoring/replay/walk_rules.py).

Every switch is stated relative to an anchor t, whose block [x_t, mask, ...] drafts t + 1 ...:
"""

from __future__ import annotations

from dataclasses import dataclass

WINDOW_MODES = ("configured", "none", "everywhere")


@dataclass(frozen=True)
class Conventions:
    # Block position ids start at t + block_position_offset (reference: t). Context keys keep
    # positions 0..; only the block's RoPE positions move.
    block_position_offset: int = 0
    # The drafter sees context positions 0 .. t - 1 + context_offset (reference: 0 .. t - 1).
    # +1 lets it see the anchor's own feature, which an online step does not have yet.
    # Sliding windows count distances in the [context ; block] key sequence, as the
    # reference's _attention_mask does, so the block's queries sit at t + context_offset + i.
    context_offset: int = 0
    # Every feature layer id shifted by this (the hidden_states[i] vs [i + 1] confusion).
    # Applied where feature columns are selected; the shards must store the shifted layers.
    layer_offset: int = 0
    # "configured": sliding layers use the config's window (reference); "none": the window is
    # dropped (each layer keeps its causality), as the DDTree code's SDPA path does on CPU;
    # "everywhere": every layer gets the config's window.
    window: str = "configured"
    # True: the block attends causally inside itself in every layer (reference: bidirectional
    # in full-attention layers, causal in sliding ones).
    causal_block: bool = False
    # True: input_embedding_scale, output_multiplier and final_logit_softcapping at their
    # neutral values (1, 1, none) instead of the config's.
    neutral_scales: bool = False
    # True: an MTP head reads the target's final hidden state BEFORE the target's final norm
    # (speculators' MTP training data); reference: after it, as vLLM serves MTP heads (mtp.py).
    prenorm_hidden: bool = False
    # True: llama.cpp's MTP draft KV (docs/walk-rules.md): slot k reads (x_k, the target's row
    # k - 1) at position k, slot 0 the prompt's first token with a zero row (a server slot's first
    # request), so the chain's slots and steps sit one position later than vLLM's and every anchor
    # sees one slot more. Reference: slot s reads (x_{s+1}, row s) at position s.
    lead_slot: bool = False
    # True: a NextN head (GLM-4.5's, proposers/mtp/nextn.py) feeds its step output back AFTER its
    # shared_head.norm, as llama.cpp's MTP graph returns it (src/models/glm4-moe.cpp:267-269, t_h_nextn);
    # reference: BEFORE it, as vLLM's Glm4MoeMultiTokenPredictorLayer.forward returns it
    # (model_executor/models/glm4_moe_mtp.py:127-128). Other heads feed back one state under every rule.
    nextn_feed_normed: bool = False
    # True: llama.cpp's chained MTP heads (MiMo-V2-Flash's three, proposers/mtp/mimo.py): step k runs
    # head k, each fed the state before its final_layernorm, step 1 the target's before its final norm
    # (common/speculative.cpp:1615-1626, src/models/mimo2.cpp:251-257,384-387); reference: head 0 at
    # every step fed its normed output, as vLLM's mimo_v2_mtp.py:52-56,205-208 serves it.
    chain_heads: bool = False
    # True: vLLM's V1 model runner on a stack of N > 1 NextN heads (proposers/mtp/nextn.py): head 0 at
    # every step of the chain, as v1/spec_decode/llm_base_proposer.py:731-753 passes no spec_step_idx
    # (deepseek_mtp.py:231 then picks head 0 % N); reference: vLLM's default model runner (V2),
    # whose multi-module speculator runs step j on head j over the draft window
    # (v1/worker/gpu/spec_decode/multi_module_mtp/speculator.py:426-478).
    first_head_only: bool = False
    # True: llama.cpp's DFlash graph (every block family under --walk-rule llama.cpp): one causality
    # for every layer, is_causal's, absent bidirectional (common/speculative.cpp:990-991,1063: not
    # layer_types'), and a window hiding only keys w or more before the query (src/llama-hparams.h:
    # 475-487), so a bidirectional windowed layer sees every later slot of its block.
    llama_block: bool = False
    # True: XPress's refiner reads the other token before its slot 0 than its layout's rule: x_{t-1}
    # where vLLM reads the anchor x_t, or x_t where speculators reads x_{t-1} (proposers/xpress/model.py).
    xpress_other_slot0: bool = False

    def __post_init__(self):
        if self.window not in WINDOW_MODES:
            raise ValueError(f"window must be one of {WINDOW_MODES}, got {self.window!r}")

    @property
    def visible_offset(self) -> int:
        """Context rows anchor t sees past t - 1 (the shifted context, or the lead slot)."""
        return self.context_offset + int(self.lead_slot)

    @property
    def is_reference(self) -> bool:
        return self == REFERENCE


REFERENCE = Conventions()
