"""DeepSeek-V4's DSpark drafter (`DeepseekV4DSparkModel`, stages `mtp.{i}.*`): its config read into a
DrafterConfig, and the DSpark drafter on DeepSeek-V4 blocks (proposers/toolkit/dsv4/decoder.py).

The rule, as vLLM (vllm/models/deepseek_v4/nvidia/dspark.py, v1/worker/gpu/spec_decode/dspark/
speculator.py) and llama.cpp (conversion/deepseek.py:927-1034, src/models/dflash.cpp:857-1031) run it:

- features: the target's layer outputs at `dspark_target_layer_ids`, each the mean of its
  hyper-connection streams (vllm deepseek_v4/nvidia/model.py:1006-1011; src/models/deepseek4.cpp:
  1239-1241); context `main_norm(main_proj(features))`, each stage's keys from it (decoder.py);
- the block [x_t, noise, ...] embedded by the TARGET's embedding, unscaled, copied into `hc_mult`
  streams (dspark.py:253; dflash.cpp:936-940), through the stages, collapsed by `hc_head`
  (dspark.py:262-277; dflash.cpp:1002);
- logits `lm_head(norm(h))` with the target's lm_head (dspark.py:418-420; dflash.cpp:1008-1023), plus
  the vanilla Markov bias; the confidence head reads the collapsed state BEFORE the norm, without a
  bias (dspark.py:176-181, 435-441; dflash.cpp:1004-1005, converter maps `proj.weight` only).

The engines differ in the context window (decoder.py): vLLM's anchored at the block is the default,
llama.cpp's per query runs under `--walk-rule llama.cpp` (its mask as the graph states it; a
running llama-server's draft KV ring keeps more state, not matched yet: docs/drafter-families.md#dspark). Every `--attention` mode gathers the
window's keys (dense arithmetic over at most `sliding_window` context keys per anchor).
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

from proposers.checkpoints.files import CheckpointError
from proposers.dspark.dsv4_layout import DeepseekV4DSpark
from proposers.dspark.layout import resolve_heads
from proposers.dspark.model import DSparkDrafter
from proposers.fields.decoder_rules import shown
from proposers.fields.rules import dspark_from_anchor
from proposers.toolkit.config import DrafterConfig, DrafterConfigError, refuse_field
from proposers.toolkit.conventions import REFERENCE, Conventions
from proposers.toolkit.dsv4.decoder import SLIDING, DSV4BlockLayer, HyperHead, MainRotary, dsv4_config, window_mask
from proposers.toolkit.dsv4.names import dsv4_state

# what --walk-rule llama.cpp leaves out for this layout: the probe in docs/drafter-families.md#dspark
UNMATCHED = {
    "llama.cpp": "llama-server's DeepSeek-V4 DSpark counts differed from this replay on the samples probed "
    "(a block of several queries attends otherwise in its draft graph; docs/drafter-families.md#dspark)"
}


def parse_dsv4(checked: DeepseekV4DSpark, raw: dict, source: str) -> DrafterConfig:
    """The DrafterConfig of a DeepSeek-V4 DSpark config, once what the engines refuse is refused by name."""
    _check_decoder(checked, source)
    confidence = checked.enable_confidence_head is not False  # vLLM's default (dspark.py:176)
    heads = resolve_heads(
        checked.dspark_markov_rank,
        "vanilla",
        confidence,
        confidence,
        checked.confidence_threshold,
        "",
        "vLLM's DSparkDeepseekV4Model",
        source,
    )
    if checked.dspark_noise_token_id >= checked.vocab_size:
        refuse_field(
            source,
            "dspark_noise_token_id",
            checked.dspark_noise_token_id,
            f"outside the vocabulary of {checked.vocab_size}; set a token id below it",
        )
    stages = checked.stages
    return DrafterConfig(
        hidden_size=checked.hidden_size,
        num_hidden_layers=stages,
        num_attention_heads=checked.num_attention_heads,
        num_key_value_heads=1,
        head_dim=checked.head_dim,
        intermediate_size=checked.moe_intermediate_size,
        vocab_size=checked.vocab_size,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        block_size=checked.dspark_block_size,
        mask_token_id=checked.dspark_noise_token_id,
        target_layer_ids=checked.feature_layers(source),
        num_target_layers=checked.num_hidden_layers,
        layer_types=[SLIDING] * stages,
        sliding_window=checked.sliding_window,
        is_causal=False,  # the block bidirectional (dspark.py:6-8; sparse_swa.py:1268-1271)
        raw=raw,
        family="dspark",
        layout="deepseek-v4",
        drafts_from_anchor=dspark_from_anchor(checked),
        family_options=asdict(heads) | {"decoder": "dsv4", "unmatched_rules": UNMATCHED},
    )


# (field, the values the engines run, the file's value, why the others are refused)
def _decoder_rules(checked: DeepseekV4DSpark) -> list[tuple[str, tuple, object, str]]:
    layers = checked.num_hidden_layers or 0
    stage_ratios = sorted(set((checked.compress_ratios or [])[layers:]) - {0})
    return [
        ("scoring_func", ("sqrtsoftplus",), checked.scoring_func or "sqrtsoftplus",
         "llama.cpp's DSpark graph refuses any other MoE scoring (src/models/dflash.cpp:74-76); set sqrtsoftplus"),
        ("hidden_act", ("silu",), checked.hidden_act or "silu",
         "llama.cpp's DSpark graph runs SiLU-gated experts only (src/models/dflash.cpp:975-992); set silu"),
        ("norm_topk_prob", (True,), checked.norm_topk_prob is not False, "vLLM and llama.cpp would leave the routed "
         "weights unnormalized (conversion/deepseek.py:670), which specreplay's stages (transformers' "
         "DeepseekV4TopKRouter) do not implement; set it true"),
        ("num_key_value_heads", (1,), checked.num_key_value_heads or 1,
         "vLLM and llama.cpp attend with DeepSeek-V4's one shared key/value head; set 1"),
        ("hc_mult", (4,), checked.hc_mult, "llama.cpp's DeepSeek-V4 graph runs four hyper-connection streams only "
         "(src/models/deepseek4.cpp:366); set 4"),
        ("n_shared_experts", (1,), 1 if checked.n_shared_experts is None else checked.n_shared_experts,
         "llama.cpp's DSpark graph runs one shared expert (src/models/dflash.cpp:988-992); set 1"),
        ("compress_ratios", ((),), tuple(stage_ratios), "vLLM would compress a stage's attention "
         "(deepseek_v4/attention.py:236-242), llama.cpp's converter writes 0 for every stage "
         "(conversion/deepseek.py:949); give the stages 0"),
        ("draft_vocab_size", (checked.vocab_size,), checked.draft_vocab_size or checked.vocab_size,
         f"vLLM's DeepSeek-V4 DSpark drafts the full vocabulary ({checked.vocab_size}, dspark.py:354); remove it"),
        ("dspark_draft_topk", (None,), checked.dspark_draft_topk, "vLLM samples drafts from the top k "
         "(spec_decode/dspark/speculator.py:78-80), llama.cpp does not read it; remove it"),
        ("sample_from_anchor", (True,), dspark_from_anchor(checked), "vLLM drafts DeepSeek-V4's block from the "
         "anchor's slot (spec_decode/dspark/speculator.py:49-55) and llama.cpp's converter writes no other; remove it"),
    ]  # fmt: skip


def _check_decoder(checked: DeepseekV4DSpark, source: str) -> None:
    for field, served, value, why in _decoder_rules(checked):
        if value not in served:
            shown_value = list(value) if isinstance(value, tuple) else value
            raise DrafterConfigError(
                f"{source}: field '{field}' is {shown(shown_value)}: {why}; refusing rather than scoring it wrong"
            )


def _decoder_config(config: DrafterConfig):
    return dsv4_config(config.raw, config.num_hidden_layers)


# checkpoint names (DeepSeek's, llama.cpp conversion/deepseek.py:810-878) -> this model's (transformers')
ROOT = {
    "main_proj.": "fc.", "main_norm.": "hidden_norm.", "norm.": "norm.", "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale", "markov_head.": "markov_head.",
    "confidence_head.": "confidence_head.",
}  # fmt: skip


def dsv4_names(state: dict) -> dict:
    """The `mtp.{i}.*` tensors under this model's names (toolkit/dsv4/names.py): the head stack and
    context projection at the root (whichever stage holds them, as both engines read them:
    dspark.py:572-600, conversion/deepseek.py:988-1005), every other tensor the target's and dropped, as
    both do."""
    return dsv4_state(state, ROOT)


class DSV4DSparkDrafter(DSparkDrafter):
    """DSpark's heads over DeepSeek-V4 stages; the target's embedding and lm_head (dspark.py:349-352)."""

    layer_class = DSV4BlockLayer
    decoder_config = staticmethod(_decoder_config)
    norm_class = DeepseekV4RMSNorm
    rotary_class = MainRotary
    canonical_names = staticmethod(dsv4_names)

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        hf = self.decoder_config(config)
        self.hc_head = HyperHead(hf)
        if self.confidence_head is not None:  # no bias (vLLM's DSparkConfidenceHead default)
            self.confidence_head.proj = nn.Linear(self.confidence_head.proj.in_features, 1, bias=False)

    def check_checkpoint(self, state: dict, source: str, config_file: str) -> None:
        """A quantized checkpoint (FP8 block scales, MXFP4 experts: DeepSeek's released layout) is refused
        by its first scale tensor: the stages are read in bf16/fp32 only."""
        scale = next((name for name in state if name.startswith("mtp.") and name.endswith(".scale")), None)
        if scale is not None:
            raise CheckpointError(
                f"{source}: tensor {scale!r} is a quantization scale; specreplay reads DeepSeek-V4 DSpark stages in "
                "bf16 or fp32 only; dequantize the checkpoint first (FP8 block scales, MXFP4 experts)"
            )

    @property
    def optional_weights(self) -> tuple[str, ...]:
        """Without its weights vLLM drops the confidence head (dspark.py:567-568); llama.cpp's is optional."""
        return ("confidence_head.proj.weight",) if self.confidence_head is not None else ()

    def _layers(self, block_embeds, anchors, context, attention, ctx_starts, conventions) -> torch.Tensor:
        """The collapsed state BEFORE the final norm (head_logits norms it; the confidence head reads it)."""
        A, b, _ = block_embeds.shape
        positions = (anchors + conventions.block_position_offset)[:, None] + torch.arange(b, device=anchors.device)
        cos, sin = self.rope(block_embeds, positions)
        causal, window, _ = self.config.layer_mask_kind(0, conventions)
        mask = window_mask(anchors, b, ctx_starts, causal, window, conventions.llama_block, conventions.context_offset)
        h = block_embeds[:, :, None, :].repeat(1, 1, self.hc_head.hc_mult, 1)  # [A, b, hc, H]
        for layer, (ctx_k, ctx_v) in zip(self.layers, context):
            h = layer(h, cos, sin, ctx_k, ctx_v, mask)
        return self.hc_head(h)

    def head_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor, conventions: Conventions = REFERENCE):
        return super().head_logits(self.norm(hidden), lm_head, conventions)
