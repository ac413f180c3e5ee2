"""One valid config.json of every declared layout (config only, no weights), for the field tests
(tests/proposers/): each parses through proposers.detect as is, so a change to one field is the
only thing a test varies. `with_field` sets a field by its path as messages name it
('dflash_config.causal', 'speculators_config.proposal_methods[0].speculative_tokens')."""

from __future__ import annotations

import copy
import re

from proposers.toolkit.zlab_layout import LILICORR_KEYS
from tests.helpers.drafters import drafter_config

TARGET_LAYERS = 6  # the target every base config is for (feature layers 1 and 3, before-layer 2 and 4)
QWEN3 = dict(
    model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, vocab_size=512, rms_norm_eps=1e-6, rope_theta=10000.0,
)  # fmt: skip
LLAMA = {**QWEN3, "model_type": "llama", "num_hidden_layers": 1}
MTP_TEXT = {**QWEN3, "num_hidden_layers": 3, "layer_types": ["full_attention"] * 3}
MOE_TEXT = {k: v for k, v in MTP_TEXT.items() if k != "intermediate_size"} | dict(
    model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)  # fmt: skip
GLM = dict(
    model_type="glm4_moe", hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, vocab_size=512, moe_intermediate_size=32, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, num_nextn_predict_layers=1,
)  # fmt: skip
DEEPSEEK = {k: v for k, v in GLM.items() if k != "head_dim"} | dict(
    model_type="deepseek_v3", num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_group=4, topk_group=2, moe_layer_freq=1,
    scoring_func="sigmoid", topk_method="noaux_tc", ep_size=1,
)  # fmt: skip
GEMMA4_DSPARK = dict(
    architectures=["Gemma4DSparkModel"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=16, num_global_key_value_heads=1, intermediate_size=128,
    vocab_size=512, layer_types=["full_attention"] * 2, attention_k_eq_v=True, hidden_activation="gelu_pytorch_tanh",
    rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}},
    num_target_layers=TARGET_LAYERS, block_size=4, mask_token_id=511, target_layer_ids=[1, 3], num_anchors=8,
    markov_rank=8, markov_head_type="vanilla", enable_confidence_head=False, confidence_head_with_markov=False,
)  # fmt: skip
MIMO = dict(
    model_type="mimo_v2_flash", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
    head_dim=24, v_head_dim=16, intermediate_size=128, vocab_size=512, swa_num_attention_heads=4,
    swa_num_key_value_heads=2, swa_head_dim=24, swa_v_head_dim=16, swa_rope_theta=10000.0, sliding_window_size=64,
    add_swa_attention_sink_bias=True, layernorm_epsilon=1e-5,
)  # fmt: skip
DSV4_DSPARK = dict(
    architectures=["DeepseekV4DSparkModel"], vocab_size=512, hidden_size=64, moe_intermediate_size=32,
    num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=1, head_dim=16, qk_rope_head_dim=8,
    q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    scoring_func="sqrtsoftplus", norm_topk_prob=True, hc_mult=4, sliding_window=8, rope_theta=10000.0,
    compress_ratios=[4, 128, 4, 128, 4, 0, 0, 0], num_hash_layers=3, n_mtp_layers=2, dspark_block_size=4,
    dspark_noise_token_id=511, dspark_target_layer_ids=[1, 3], dspark_markov_rank=8, enable_confidence_head=False,
)  # fmt: skip
DSV4_MTP = {k: v for k, v in DSV4_DSPARK.items() if not k.startswith(("dspark_", "n_mtp", "enable_conf", "arch"))} | dict(
    model_type="deepseek_v4", num_nextn_predict_layers=1, compress_ratios=[4, 128, 4, 128, 4, 0, 0],
)  # fmt: skip
DFLASH2_KEYS = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=4)


def _settings(kind: str, tokens: int) -> dict:
    return {
        "algorithm": kind,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": None, "architectures": ["Qwen3ForCausalLM"]},
    }


def _speculators(kind: str, decoder: dict, tokens: int, **top) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": kind,
        "speculators_version": "0.9.0",
        "transformer_layer_config": dict(decoder),
        "draft_vocab_size": decoder["vocab_size"],
        "speculators_config": _settings(kind, tokens),
        **top,
    }


def _block(kind: str, tokens: int) -> dict:
    return _speculators(kind, QWEN3, tokens, block_size=4, mask_token_id=511, aux_hidden_state_layer_ids=[2, 4])


# layout -> a function building its base config; keys as docs/config-fields.md's sections name them
BASE = {
    "dflash:z-lab": lambda: drafter_config(num_heads=4),
    "dflash2:z-lab": lambda: drafter_config(num_heads=4, dflash_extra=dict(DFLASH2_KEYS)),
    "dflash:speculators": lambda: _block("dflash", 3),
    "dflash2:speculators": lambda: _block("dflash2", 3),
    "xpress:speculators": lambda: {**_block("xpress", 3), "xpress_rank": 8},
    "xpress:vllm": lambda: {
        **drafter_config(num_heads=4),
        "architectures": ["Qwen3XPressModel"],
        "xpress_block_size": drafter_config(num_heads=4)["block_size"],
        "xpress_rank": 8,
        "xpress_mlp_hidden": 16,
        "xpress_num_passes": 2,
    },
    "dspark:speculators": lambda: _block("dspark", 4),  # sample_from_anchor true by default: 4 queries draft
    "dspark:specforge": lambda: {
        **QWEN3,
        "architectures": ["DSparkDraftModel"],
        "block_size": 4,
        "num_target_layers": TARGET_LAYERS,
        "dflash_config": {"projector_type": "dspark", "mask_token_id": 511, "target_layer_ids": [1, 3]},
    },
    "dspark:deepspec": lambda: {
        **QWEN3,
        "architectures": ["Qwen3DSparkModel"],
        "block_size": 4,
        "num_target_layers": TARGET_LAYERS,
        "mask_token_id": 511,
        "target_layer_ids": [1, 3],
        "num_anchors": 8,
        "enable_confidence_head": False,
        "markov_rank": 0,
    },
    "dspark:qwen3-omni": lambda: {
        **QWEN3,
        "architectures": ["Qwen3OmniDSparkModel"],
        "block_size": 4,
        "target_hidden_size": 64,
        "target_layer_ids": [1, 3],
        "use_aux_hidden_state": True,
        "markov_rank": 8,
        "markov_head_type": "vanilla",
        "mask_token_id": 511,
    },
    "dspark:k3": lambda: dict(
        architectures=["K3DSparkModel"],
        model_type="k3_dspark",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        intermediate_size=128,
        vocab_size=512,
        target_hidden_size=64,
        num_target_layers=2,
        target_layer_ids=[1, 3],
        block_size=4,
        mask_token_id=511,
        markov_rank=8,
    ),  # fmt: skip
    "dspark:gemma4": lambda: dict(GEMMA4_DSPARK),
    "dspark:deepseek-v4": lambda: dict(DSV4_DSPARK),
    "eagle3:speculators": lambda: _speculators("eagle3", LLAMA, 3, eagle_aux_hidden_state_layer_ids=[2, 3, 4]),
    "peagle:speculators": lambda: _speculators(
        "peagle", LLAMA, 3, eagle_aux_hidden_state_layer_ids=[2, 3, 4], mask_token_id=1
    ),
    "eagle3:specforge": lambda: {
        **LLAMA,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": 512,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True},
    },
    "peagle:specforge": lambda: {
        **LLAMA,
        "num_hidden_layers": 2,
        "architectures": ["PEagleDraftModel"],
        "draft_vocab_size": 512,
        "norm_before_residual": False,
        "mask_token_id": 1,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]},
    },
    "eagle:sglang": lambda: {**LLAMA, "architectures": ["LlamaForCausalLMEagle"]},
    "eagle:vllm": lambda: {**LLAMA, "architectures": ["EagleLlamaForCausalLM"], "bias": False},
    "mtp:speculators": lambda: _speculators("mtp", {**MTP_TEXT, "model_type": "qwen3_5_text"}, 3),
    "mtp:native": lambda: {"model_type": "qwen3_5", "text_config": {**MTP_TEXT, "model_type": "qwen3_5_text"}},
    "mtp:native-qwen3-next": lambda: {**MTP_TEXT, "model_type": "qwen3_next", "num_experts": 0},
    "mtp:native-moe": lambda: {"model_type": "qwen3_5_moe", "text_config": dict(MOE_TEXT)},
    "mtp:nextn": lambda: dict(GLM),
    "mtp:nextn-deepseek": lambda: dict(DEEPSEEK),
    "mtp:mimo": lambda: dict(MIMO),
    "mtp:deepseek-v4": lambda: dict(DSV4_MTP),
    "ngram:vllm": lambda: {"method": "ngram", "num_speculative_tokens": 3},
    "ngram:llama.cpp": lambda: {"spec-type": "ngram-simple"},
    "ngram:sglang": lambda: {"speculative_algorithm": "NGRAM"},
    "draft:llama.cpp": lambda: {"spec-type": "draft-simple", "model-draft": "small"},
    "draft:vllm": lambda: {"method": "draft_model", "model": "small", "num_speculative_tokens": 3},
    "suffix:vllm": lambda: {"method": "suffix"},
}


def base(layout: str) -> dict:
    return copy.deepcopy(BASE[layout]())


def with_field(raw: dict, path: str, value) -> dict:
    """A copy of `raw` with the field at `path` set to `value` (namespaces created as needed)."""
    out = copy.deepcopy(raw)
    parts = [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", path)]
    node = out
    for part in parts[:-1]:
        if isinstance(part, str) and node.get(part) is None:
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return out


# (layout, field path, a value refused, an engine the refusal names, the neutral value accepted);
# docs/config-fields.md lists each of these as refused (tests/proposers/test_config_fields_doc.py)
class _Absent:
    """The neutral value is the field left out; its repr names it, so test ids are the same in
    every pytest-xdist worker (an object()'s address is not)."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()
REFUSALS = [
    # the block drafters' Qwen3 decoder, in every layout (top level or transformer_layer_config)
    ("dflash:z-lab", "partial_rotary_factor", 0.5, "llama.cpp", 1.0),
    ("dflash:z-lab", "rope_parameters.partial_rotary_factor", 0.5, "SGLang", 1.0),
    ("dflash:z-lab", "rope_parameters.rope_dim", 8, "vLLM", 16),
    ("dflash:z-lab", "is_neox_style", False, "vLLM", True),
    ("dflash:z-lab", "rope_is_neox_style", False, "llama.cpp", True),
    ("dflash:z-lab", "use_gemma_norm", True, "SGLang", False),
    ("dflash:z-lab", "logit_scale", 2.0, "vLLM", 1.0),
    ("dflash:z-lab", "model_type", "llama", "vLLM", "qwen3"),
    ("dflash:speculators", "transformer_layer_config.partial_rotary_factor", 0.5, "vLLM", 1.0),
    ("dflash:speculators", "transformer_layer_config.is_neox_style", False, "vLLM", True),
    ("dflash:speculators", "transformer_layer_config.logit_scale", 0.5, "vLLM", 1.0),
    ("dflash:speculators", "transformer_layer_config.model_type", "llama", "Qwen3", "qwen3"),
    ("dflash2:speculators", "transformer_layer_config.rope_is_neox_style", False, "llama.cpp", True),
    ("dspark:speculators", "transformer_layer_config.use_gemma_norm", True, "SGLang", False),
    ("dspark:specforge", "partial_rotary_factor", 0.25, "vLLM", 1.0),
    ("dspark:specforge", "model_type", "gemma4_text", "llama.cpp", "qwen3"),
    ("dspark:deepspec", "logit_scale", 2.0, "vLLM", 1.0),
    ("dspark:deepspec", "is_neox_style", False, "SGLang", True),
    # z-lab's DFlash fields (dflash_config first, then the top level)
    ("dflash:z-lab", "dflash_config.use_swa", True, "llama.cpp", False),
    ("dflash:z-lab", "dflash_config.attention_sink_bias", True, "SGLang", False),
    ("dflash:z-lab", "add_swa_attention_sink_bias", True, "vLLM", False),
    ("dflash:z-lab", "dflash_config.projector_type", "domino", "SGLang", ABSENT),
    ("dflash:z-lab", "projector_type", "domino", "SGLang", ABSENT),
    *[("dflash:z-lab", f"dflash_config.{key}", 1, "SGLang", ABSENT) for key in LILICORR_KEYS[1:]],
    ("dflash:z-lab", "dflash_config.lilicorr_enabled", True, "SGLang", False),
    ("dflash:z-lab", "dflash_config.sample_from_anchor", True, "vLLM", False),
    ("dflash:z-lab", "dflash_config.use_aux_hidden_state", False, "vLLM", True),
    ("dflash:z-lab", "use_aux_hidden_state", False, "vLLM", True),
    ("dflash:z-lab", "draft_vocab_size", 256, "vLLM", 512),
    ("dflash:z-lab", "target_hidden_size", 128, "vLLM", 64),
    ("dflash2:z-lab", "dflash_config.use_swa", True, "vLLM", False),
    ("dflash2:z-lab", "dflash_config.sample_from_anchor", True, "vLLM", False),
    # speculators' block drafters
    ("dflash:speculators", "speculators_config.proposal_methods[0].speculative_tokens", 5, "vLLM", 3),
    ("dflash2:speculators", "speculators_config.proposal_methods[0].speculative_tokens", 4, "vLLM", 3),
    ("dspark:speculators", "speculators_config.proposal_methods[0].speculative_tokens", 3, "vLLM", 4),
    ("dflash:speculators", "target_hidden_size", 128, "vLLM", 64),
    ("dspark:speculators", "target_hidden_size", 32, "vLLM", 64),
    ("dspark:speculators", "use_aux_hidden_state", False, "vLLM", True),
    ("dspark:specforge", "target_hidden_size", 128, "vLLM", 64),
    # EAGLE-3
    ("eagle3:speculators", "transformer_layer_config.partial_rotary_factor", 0.5, "SGLang", 1.0),
    ("eagle3:speculators", "transformer_layer_config.logit_scale", 2.0, "vLLM", 1.0),
    ("eagle3:specforge", "partial_rotary_factor", 0.5, "vLLM", 1.0),
    ("eagle3:specforge", "rope_parameters.partial_rotary_factor", 0.75, "SGLang", 1.0),
    ("eagle3:specforge", "logit_scale", 2.0, "vLLM", 1.0),
    ("eagle3:specforge", "norm_before_fc", True, "SGLang", False),
    ("eagle3:specforge", "eagle_config.norm_before_fc", True, "vLLM", False),
    ("eagle3:specforge", "use_aux_norm", True, "SGLang", False),
    ("eagle3:specforge", "norm_output", True, "SGLang", ABSENT),
    ("eagle3:specforge", "norm_before_residual", True, "llama.cpp", False),
    ("eagle3:specforge", "tie_word_embeddings", True, "SGLang", False),
    ("eagle3:specforge", "bias", True, "SGLang", False),
    ("eagle3:specforge", "num_aux_hidden_states", 4, "vLLM", 3),
    # P-EAGLE
    ("peagle:speculators", "fc_norm", True, "vLLM", False),
    ("peagle:specforge", "fc_norm", True, "vLLM", False),
    ("peagle:specforge", "norm_before_fc", True, "vLLM", False),
    ("peagle:specforge", "eagle_config.norm_before_fc", True, "vLLM", False),
    ("peagle:specforge", "num_aux_hidden_states", 4, "vLLM", 3),
    # EAGLE-1/2
    ("eagle:sglang", "model_type", "qwen2", "SGLang", "llama"),
    ("eagle:vllm", "logit_scale", 2.0, "vLLM", 1.0),
    ("eagle:sglang", "partial_rotary_factor", 0.5, "SGLang", 1.0),
    # MTP heads
    ("mtp:native", "text_config.mtp_num_hidden_layers", 2, "vLLM", 1),
    ("mtp:native", "text_config.attn_output_gate", False, "vLLM", True),
    ("mtp:native", "text_config.layer_scale", True, "vLLM", False),
    ("mtp:native", "text_config.qkv_bias", True, "vLLM", False),
    ("mtp:native", "text_config.attention_bias", True, "vLLM", False),
    ("mtp:native-qwen3-next", "num_nextn_predict_layers", 2, "llama.cpp", 1),
    ("mtp:native-moe", "text_config.norm_topk_prob", False, "vLLM", True),
    ("mtp:mimo", "hidden_act", "gelu", "vLLM", "silu"),
    ("mtp:mimo", "num_nextn_predict_layers", 4, "llama.cpp", 2),
    ("mtp:native-moe", "text_config.shared_expert_intermediate_size", 0, "vLLM", 48),
    ("mtp:native-moe", "text_config.num_experts_per_tok", 8, "vLLM", 4),
    ("mtp:speculators", "transformer_layer_config.mtp_num_hidden_layers", 3, "SGLang", 1),
    ("mtp:nextn", "num_nextn_predict_layers", 0, "llama.cpp", 2),
    ("mtp:nextn", "first_k_dense_replace", 4, "llama.cpp", 3),
    ("mtp:nextn", "n_shared_experts", 0, "llama.cpp", 2),
    ("mtp:nextn-deepseek", "moe_layer_freq", 2, "vLLM", 1),
    ("mtp:nextn-deepseek", "scoring_func", "softmax", "vLLM", "sigmoid"),
    ("mtp:nextn-deepseek", "topk_method", "greedy", "vLLM", "noaux_tc"),
    ("mtp:nextn-deepseek", "v_head_dim", 32, "MLA", 24),
    ("mtp:nextn-deepseek", "head_dim", 64, "vLLM", 8),
    # a standalone draft model
    ("draft:llama.cpp", "spec-draft-n-min", 2, "llama.cpp", 0),
    ("draft:llama.cpp", "spec-draft-p-min", 0.6, "llama.cpp", 0.0),
    ("draft:vllm", "draft_sample_method", "probabilistic", "vLLM", "greedy"),
]

REFUSALS += [  # DeepSpec's Gemma 4 DSpark: what llama.cpp's converter refuses or vLLM reads otherwise
    ("dspark:gemma4", "attention_k_eq_v", False, "llama.cpp", True),
    ("dspark:gemma4", "layer_types", ["sliding_attention", "full_attention"], "llama.cpp", ["full_attention"] * 2),
    ("dspark:gemma4", "hidden_activation", "gelu", "llama.cpp", "gelu_pytorch_tanh"),
    ("dspark:gemma4", "attention_bias", True, "llama.cpp", False),
    ("dspark:gemma4", "draft_vocab_size", 256, "llama.cpp", 512),
    ("dspark:gemma4", "markov_head_type", "gated", "llama.cpp", "vanilla"),
    ("dspark:gemma4", "final_logit_softcapping", 30.0, "vLLM", ABSENT),
    ("dspark:gemma4", "attn_logit_softcapping", 50.0, "vLLM", ABSENT),
    ("dspark:gemma4", "dflash_config.use_swa", True, "vLLM", ABSENT),
    ("dspark:gemma4", "dflash_config.mask_token_id", 7, "vLLM", 511),
]

REFUSALS += [  # DeepSeek-V4's DSpark: what llama.cpp's graph refuses, or the engines run apart
    ("dspark:deepseek-v4", "scoring_func", "softmax", "llama.cpp", "sqrtsoftplus"),
    ("dspark:deepseek-v4", "hidden_act", "gelu", "llama.cpp", "silu"),
    ("dspark:deepseek-v4", "norm_topk_prob", False, "vLLM", True),
    ("dspark:deepseek-v4", "num_key_value_heads", 2, "vLLM", 1),
    ("dspark:deepseek-v4", "n_shared_experts", 2, "llama.cpp", 1),
    ("dspark:deepseek-v4", "hc_mult", 2, "llama.cpp", 4),
    ("dspark:deepseek-v4", "draft_vocab_size", 256, "vLLM", 512),
    ("dspark:deepseek-v4", "dspark_draft_topk", 8, "vLLM", ABSENT),
    ("dspark:deepseek-v4", "sample_from_anchor", False, "vLLM", True),
    ("dspark:k3", "mla_use_nope", True, "vLLM", False),
    ("dspark:k3", "mla_use_output_gate", True, "vLLM", False),
    ("dspark:k3", "mla_use_qk_norm", True, "vLLM", False),
    ("dspark:k3", "dspark_bonus_anchor", True, "vLLM", False),
    ("dspark:k3", "draft_vocab_size", 256, "vLLM", 512),
    ("dspark:k3", "hidden_act", "situ", "vLLM", "silu"),
    ("dspark:k3", "rope_interleave", False, "vLLM", True),
    ("dspark:k3", "attention_bias", True, "vLLM", False),
    ("dspark:k3", "n_routed_experts", 8, "k3_dspark.py", 0),
    ("dspark:k3", "logit_scale", 2.0, "vLLM", 1.0),
    ("dspark:k3", "markov_rank", 0, "vLLM", 8),
    ("dspark:k3", "target_hidden_size", 128, "vLLM", 64),
    ("dspark:k3", "mask_token_id", 512, "vocabulary", 511),
    ("dspark:qwen3-omni", "markov_head_type", "gated", "vLLM", "vanilla"),
    ("dspark:qwen3-omni", "markov_rank", 0, "vLLM", 8),
    ("dspark:qwen3-omni", "use_aux_hidden_state", False, "vLLM", True),
    ("dspark:qwen3-omni", "sample_from_anchor", False, "vLLM", True),
    ("dspark:qwen3-omni", "dspark_bonus_anchor", True, "vLLM", False),
    ("dspark:qwen3-omni", "draft_vocab_size", 256, "vocab_size", 512),
    ("dspark:qwen3-omni", "target_hidden_size", 128, "vLLM", 64),
    ("dspark:qwen3-omni", "mrope_section", [8, 4, 4], "vLLM", ABSENT),
    ("dspark:qwen3-omni", "rope_parameters.mrope_section", [8, 4, 4], "vLLM", ABSENT),
    ("dspark:qwen3-omni", "rope_scaling.mrope_section", [8, 4, 4], "vLLM", ABSENT),
    ("dspark:qwen3-omni", "mask_token_id", 512, "vLLM", 511),
]

REFUSALS += [  # DeepSeek-V4's own MTP head: what llama.cpp's graph refuses, or the engines run apart
    ("mtp:deepseek-v4", "num_nextn_predict_layers", 2, "llama.cpp", 1),
    ("mtp:deepseek-v4", "scoring_func", "softmax", "specreplay", "sqrtsoftplus"),
    ("mtp:deepseek-v4", "hidden_act", "gelu", "llama.cpp", "silu"),
    ("mtp:deepseek-v4", "norm_topk_prob", False, "specreplay", True),
    ("mtp:deepseek-v4", "num_key_value_heads", 2, "vLLM", 1),
    ("mtp:deepseek-v4", "n_shared_experts", 2, "llama.cpp", 1),
    ("mtp:deepseek-v4", "hc_mult", 2, "llama.cpp", 4),
    ("mtp:deepseek-v4", "num_hash_layers", 7, "llama.cpp", 3),
    ("mtp:deepseek-v4", "model_type", "deepseek_v41", "vLLM", "deepseek_v4"),
]

# Refusals that predate docs/config-fields.md or need several fields changed at once:
# (layout, the field the error names, the changes that make the config refused)
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True, "sliding_window": 8}
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0}
PRIOR_REFUSALS = [
    ("dflash:z-lab", "dflash_config.use_swa", {**SLIDING, "dflash_config.use_swa": True}),
    ("dflash:speculators", "sample_from_anchor", {"sample_from_anchor": True}),
    ("dflash2:speculators", "draft_vocab_size", {"draft_vocab_size": 256}),
    ("xpress:speculators", "sample_from_anchor", {"sample_from_anchor": True}),
    ("xpress:speculators", "draft_vocab_size", {"draft_vocab_size": 256}),
    ("xpress:vllm", "sample_from_anchor", {"sample_from_anchor": True}),
    ("xpress:vllm", "xpress_block_size", {"xpress_block_size": 99}),
    ("xpress:vllm", "xpress_block_size", {"xpress_block_size": None}),  # absent: vLLM's mixer is 16 slots
    ("xpress:vllm", "xpress_topc", {"xpress_topc": 100000}),
    ("xpress:vllm", "draft_vocab_size", {"draft_vocab_size": 256}),
    ("eagle3:speculators", "target_hidden_size", {"target_hidden_size": 48}),
    ("eagle3:speculators", "transformer_layer_config.model_type", {"transformer_layer_config.model_type": "gemma3"}),
    ("eagle3:speculators", "layer_types", {"transformer_layer_config.layer_types": ["sliding_attention"]}),
    ("eagle3:specforge", "sliding_window", {"use_sliding_window": True, "sliding_window": 8}),
    ("eagle3:specforge", "num_hidden_layers", {"num_hidden_layers": 2}),
    ("eagle3:specforge", "norm_output", {"norm_output": False}),
    ("eagle3:specforge", "eagle_config.use_aux_hidden_state", {"eagle_config.use_aux_hidden_state": False}),
    ("eagle3:specforge", "target_hidden_size", {"target_hidden_size": 48}),
    ("peagle:specforge", "eagle_config.use_aux_hidden_state", {"eagle_config.use_aux_hidden_state": False}),
    ("peagle:specforge", "mask_token_id", {"mask_token_id": None}),
    ("peagle:specforge", "target_hidden_size", {"target_hidden_size": 48}),
    ("mtp:speculators", "model_type", {"transformer_layer_config.model_type": "qwen3"}),
    ("mtp:speculators", "num_nextn_predict_layers", {"num_nextn_predict_layers": 2}),
    ("mtp:nextn", "topk_group", {"n_group": 2, "topk_group": 1}),
    ("mtp:nextn-deepseek", "quantization_config", {"quantization_config": {"quant_method": "fp8"}}),
    ("dspark:gemma4", "enable_moe_block", {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2}),
    ("dspark:gemma4", "rope_parameters.full_attention.rope_type", {"rope_parameters.full_attention": LINEAR_ROPE}),
    ("dspark:gemma4", "dflash_config.markov_head_type", {"dflash_config.markov_head_type": "gated"}),
    ("dspark:gemma4", "dflash_config.target_layer_ids", {"dflash_config.target_layer_ids": [1, 2]}),
    ("dspark:gemma4", "mask_token_id", {"mask_token_id": None}),
    ("dspark:gemma4", "target_layer_ids", {"target_layer_ids": None}),
    ("dspark:gemma4", "target_layer_ids", {"target_layer_ids": [1, 5]}),  # the target's last layer
    ("dspark:gemma4", "markov_rank", {"markov_rank": 0}),
    ("mtp:mimo", "quantization_config", {"quantization_config": {"quant_method": "fp8"}}),
    ("mtp:mimo", "swa_head_dim", {"swa_head_dim": None}),
    ("mtp:mimo", "swa_num_attention_heads", {"swa_num_attention_heads": None}),
    ("mtp:mimo", "swa_num_key_value_heads", {"swa_num_key_value_heads": None}),
    ("dspark:deepseek-v4", "compress_ratios", {"compress_ratios": [0] * 6 + [4, 0]}),  # a stage compressed
    ("mtp:deepseek-v4", "compress_ratios", {"compress_ratios": [0] * 6 + [4]}),  # the head compressed
    ("mtp:deepseek-v4", "quantization_config", {"quantization_config": {"quant_method": "fp8"}}),
    ("mtp:deepseek-v4", "sliding_window", {"sliding_window": None}),
    ("dspark:deepseek-v4", "dspark_noise_token_id", {"dspark_noise_token_id": 600}),  # past the vocabulary
    ("dspark:deepseek-v4", "dspark_noise_token_id", {"dspark_noise_token_id": None}),
    ("dspark:deepseek-v4", "dspark_target_layer_ids", {"dspark_target_layer_ids": [1, 5]}),  # the target's last
    ("dspark:deepseek-v4", "dspark_markov_rank", {"dspark_markov_rank": None}),
    ("dspark:k3", "num_target_layers", {"num_target_layers": 6}),  # the target's, not the ids' count
    ("dspark:k3", "target_layer_ids", {"target_layer_ids": [1, 5]}),  # the target's last layer
    ("dspark:k3", "rope_parameters.rope_type", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}),
    ("dspark:k3", "q_lora_rank", {"q_lora_rank": None}),
    ("dspark:k3", "dspark_noise_token_id", {"mask_token_id": None, "dspark_noise_token_id": 600}),
    ("dspark:k3", "pard_token", {"mask_token_id": None, "pard_token": 600}),
    ("dspark:k3", "ptd_token_id", {"mask_token_id": None, "ptd_token_id": 600}),
    ("dspark:qwen3-omni", "dflash_config.use_aux_hidden_state", {"dflash_config.use_aux_hidden_state": False}),
    ("dspark:qwen3-omni", "eagle_config.use_aux_hidden_state", {"eagle_config.use_aux_hidden_state": False}),
    ("dspark:qwen3-omni", "use_aux_hidden_state", {"use_aux_hidden_state": None}),  # vLLM requires it stated
    ("dspark:qwen3-omni", "markov_head_type", {"markov_head_type": None}),
    ("dspark:qwen3-omni", "block_size", {"block_size": None}),
    ("dspark:qwen3-omni", "mask_token_id", {"mask_token_id": None}),
    ("dspark:qwen3-omni", "target_layer_ids", {"target_layer_ids": [3, 1]}),  # not increasing
    ("dspark:qwen3-omni", "target_layer_ids", {"target_layer_ids": [1, 5]}),  # the target's last layer
    ("dspark:qwen3-omni", "dflash_config.target_layer_ids", {"dflash_config.target_layer_ids": [2, 5]}),
    ("dspark:qwen3-omni", "dspark_target_layer_ids", {"dspark_target_layer_ids": [3, 2]}),
    ("dspark:qwen3-omni", "dflash_config.mask_token_id", {"dflash_config.mask_token_id": 600}),
    ("dspark:qwen3-omni", "dspark_noise_token_id", {"mask_token_id": None, "dspark_noise_token_id": 600}),
    ("dspark:qwen3-omni", "pard_token", {"mask_token_id": None, "pard_token": 600}),
    ("dspark:qwen3-omni", "ptd_token_id", {"mask_token_id": None, "ptd_token_id": 600}),
    ("dspark:qwen3-omni", "eagle_aux_hidden_state_layer_ids", {"eagle_aux_hidden_state_layer_ids": [1, 3]}),
    ("ngram:llama.cpp", "lookup-cache-static", {"spec-type": "ngram-cache", "lookup-cache-static": "static.bin"}),
    ("ngram:llama.cpp", "lookup-cache-dynamic", {"spec-type": "ngram-cache", "lookup-cache-dynamic": "dynamic.bin"}),
    ("ngram:sglang", "speculative_ngram_external_corpus_path", {"speculative_ngram_external_corpus_path": "c.jsonl"}),
]


def changed(layout: str, changes: dict) -> dict:
    raw = base(layout)
    for path, value in changes.items():
        raw = with_field(raw, path, value)
    return raw
