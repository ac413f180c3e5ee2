"""A Qwen3-Omni target and a drafter in vLLM's Qwen3-Omni DSpark layout, for
tests/parity/test_dspark_omni_parity.py.

The target is transformers' own `Qwen3OmniMoeThinkerForConditionalGeneration` (the thinker vLLM's
validator reads the text config of: vllm/config/speculative.py:125-130), tiny, text only: its text
model has the widths of tests/helpers/dspark_reference.py (so speculators' `DSparkDraftModel`
fits it) with MoE layers and interleaved mrope, whose three sections coincide on text positions.
`ThinkerView` exposes it under the names tests/helpers/dspark_online.py's target functions use.

`write_omni` writes a speculators-fitted drafter's weights as a Qwen3-Omni DSpark checkpoint: vLLM
runs it as `Qwen3DSparkForCausalLM` (registry.py:682), the Qwen3 DFlash backbone plus the Markov and
confidence heads of speculators' layout (qwen3_dspark.py:196-230), with the target's embedding and
lm_head when the checkpoint has none (qwen3_dspark.py:325-365); its config holds what
`_validate_qwen3_omni_dspark` requires (speculative.py:167-393).
"""

from __future__ import annotations

import json

import torch
from torch import nn

from tests.helpers.dspark_reference import (
    HIDDEN,
    MASK,
    OUTPUT_IDS,
    TARGET_LAYERS,
    VOCAB,
    _drafter_weights,
    _write,
    qwen3_config,
)
from tests.helpers.models import save_target, seeded

VISION_START = 151652  # outside the vocabulary: no text position is a vision one


def build_target(save_dir, *, seed: int = 0, logit_scale: float = 3.0) -> str:
    """The tiny thinker (4 experts, 2 per token; one-layer vision and audio towers it never runs on
    text), its lm_head scaled so that greedy drafts get accepted. transformers 5.25's
    Qwen3OmniMoeThinkerConfig lacks `vision_start_token_id`, which its get_rope_index reads
    (modeling_qwen3_omni_moe.py:291): set here, as Qwen3-Omni's own config.json carries it."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig

    decoder = qwen3_config(TARGET_LAYERS)
    text = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=decoder.intermediate_size, moe_intermediate_size=16,
        num_hidden_layers=TARGET_LAYERS, num_attention_heads=decoder.num_attention_heads,
        num_key_value_heads=decoder.num_key_value_heads, head_dim=decoder.head_dim, num_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-6, max_position_embeddings=512, initializer_range=0.5,
        rope_scaling={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "interleaved": True},
    )  # fmt: skip
    config = Qwen3OmniMoeThinkerConfig(
        text_config=text,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=HIDDEN),
        audio_config=dict(
            encoder_layers=1, d_model=16, encoder_attention_heads=2, encoder_ffn_dim=16, output_dim=HIDDEN,
            num_mel_bins=16, downsample_hidden_size=8,
        ),
    )  # fmt: skip
    config.initializer_range = 0.5
    config.tie_word_embeddings = False
    config.vision_start_token_id = VISION_START
    with seeded(seed):
        model = Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return save_target(model, save_dir)


def load_target(model_dir: str):
    from transformers import AutoModelForImageTextToText

    return ThinkerView(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval())


class ThinkerView(nn.Module):
    """The thinker under a causal LM's names: `model` its text model (`norm`, `embed_tokens`),
    `lm_head`, `config` its text config; calls go to the thinker itself."""

    def __init__(self, thinker):
        super().__init__()
        self.thinker = thinker
        self.model = thinker.model.language_model
        self.lm_head = thinker.lm_head
        self.config = thinker.config.text_config

    def get_input_embeddings(self):
        return self.thinker.get_input_embeddings()

    def forward(self, *args, **kwargs):
        return self.thinker(*args, **kwargs)


def drafter_config(reference, **changes) -> dict:
    """The Qwen3-Omni DSpark config.json of the fitted speculators `reference`: its Qwen3 decoder at the
    top level, the fields vLLM's validator requires (no embedding or lm_head of its own)."""
    decoder = reference.config.transformer_layer_config.to_diff_dict()
    raw = {k: v for k, v in decoder.items() if k not in ("transformers_version", "_attn_implementation")}
    raw.update(
        architectures=["Qwen3OmniDSparkModel"],
        model_type="qwen3",
        layer_types=["full_attention"] * reference.config.transformer_layer_config.num_hidden_layers,
        target_hidden_size=HIDDEN,
        block_size=reference.block_size,
        target_layer_ids=list(OUTPUT_IDS),
        use_aux_hidden_state=True,
        markov_rank=reference.config.markov_rank,
        markov_head_type=reference.config.markov_head_type,
        enable_confidence_head=reference.config.enable_confidence_head,
        confidence_head_with_markov=reference.config.confidence_head_with_markov,
        mask_token_id=MASK,
        sample_from_anchor=True,
    )
    raw.update(changes)
    return raw


def write_omni(save_dir, reference, **changes) -> str:
    _write(save_dir, drafter_config(reference, **changes), _drafter_weights(reference))
    return str(save_dir)


def rewrite_config(ckpt: str, **changes) -> None:
    with open(f"{ckpt}/config.json") as f:
        raw = json.load(f)
    raw.update(changes)
    with open(f"{ckpt}/config.json", "w") as f:
        json.dump(raw, f, indent=2)
