"""The decoder fields an engine honours that the replay does not implement, refused by name when
their value is not the neutral one (docs/config-fields.md): RoPE over part of each head, an
interleaved RoPE, (1 + w) norms, a logit scale, another decoder kind.

`where` prefixes a field with its namespace ('' for the top level, 'transformer_layer_config.');
`hf` is transformers' config the reference builds from the decoder's fields."""

from __future__ import annotations

from proposers.toolkit.config import refuse_field

ALL_THREE = "vLLM, SGLang and llama.cpp"


def shown(value) -> str:
    """A config value as the file spells it (JSON's true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def refuse(source: str, field: str, value, why: str) -> None:
    refuse_field(source, field, shown(value), why)


def _stated(decoder: dict, key: str, where: str) -> str:
    """Where the file states a RoPE key: at the decoder's level, or inside rope_parameters / rope_scaling."""
    if key in decoder:
        return f"{where}{key}"
    name = next((n for n in ("rope_parameters", "rope_scaling") if key in (decoder.get(n) or {})), "rope_parameters")
    return f"{where}{name}.{key}"


def _rope_dicts(hf) -> list[dict]:
    rope = getattr(hf, "rope_parameters", None) or {}
    nested = [v for k, v in rope.items() if k in ("full_attention", "sliding_attention") and isinstance(v, dict)]
    return nested or [rope]


def check_rope(decoder: dict, hf, where: str, source: str, engines: str, rotary: str) -> None:
    """partial_rotary_factor and rope_dim, as transformers resolves them: `engines` rotate only
    part of each head; specreplay (transformers' `rotary`, the reference's) rotates every dim."""
    head_dim = hf.head_dim
    for rope in _rope_dicts(hf):
        factor = rope.get("partial_rotary_factor")
        if factor is not None and factor != 1.0:
            refuse(
                source,
                _stated(decoder, "partial_rotary_factor", where),
                factor,
                f"{engines} rotate only int(head_dim * {factor}) = {int(head_dim * factor)} of the {head_dim} dims of "
                f"each head; specreplay (transformers' {rotary}, as the trainer's reference) rotates every dim",
            )
        dims = rope.get("rope_dim")
        if dims is not None and dims != head_dim:
            refuse(
                source,
                _stated(decoder, "rope_dim", where),
                dims,
                f"vLLM rotates only {dims} of the {head_dim} dims of each head; specreplay rotates every dim",
            )


def check_logit_scale(decoder: dict, where: str, source: str) -> None:
    scale = decoder.get("logit_scale")
    if scale is not None and scale != 1.0:
        refuse(
            source,
            f"{where}logit_scale",
            scale,
            "vLLM multiplies the draft logits by it (greedy drafts stay, draft probabilities at temperature > 0 "
            "change); specreplay does not",
        )


def check_block_decoder(decoder: dict, hf, where: str, source: str, own_model_type: bool) -> None:
    """A block drafter's Qwen3 decoder (DFlash, DFlash2, DSpark, every layout). `own_model_type`:
    the layout states the decoder's model_type itself (z-lab, SpecForge, DeepSpec; speculators' is
    checked where its decoder is read)."""
    kind = decoder.get("model_type")
    if own_model_type and kind is not None and kind != "qwen3":
        refuse(
            source,
            f"{where}model_type",
            kind,
            "specreplay builds Qwen3 decoder layers for every DFlash-family drafter (q/k norms, Qwen3's MLP), "
            "and vLLM and llama.cpp build another model for another model_type",
        )
    if decoder.get("use_gemma_norm"):
        refuse(
            source,
            f"{where}use_gemma_norm",
            True,
            "SGLang's DFlash norms then scale by (1 + w); specreplay's Qwen3 norms scale by w",
        )
    for key, who in (("is_neox_style", "vLLM and SGLang"), ("rope_is_neox_style", "llama.cpp and SGLang")):
        if decoder.get(key) is False:
            refuse(
                source,
                f"{where}{key}",
                False,
                f"{who} then rotate interleaved pairs of dims (GPT-J style); specreplay's RoPE rotates the two "
                f"halves of each head (NeoX style)",
            )
    check_logit_scale(decoder, where, source)
    check_rope(decoder, hf, where, source, ALL_THREE, "Qwen3RotaryEmbedding")


def check_eagle_decoder(decoder: dict, hf, where: str, source: str) -> None:
    """An EAGLE-3 drafter's decoder (speculators' transformer_layer_config, SpecForge's top level)."""
    check_logit_scale(decoder, where, source)
    check_rope(
        decoder, hf, where, source, "vLLM and SGLang", f"{type(hf).__name__.removesuffix('Config')}RotaryEmbedding"
    )


def check_mtp_decoder(decoder: dict, hf, where: str, source: str) -> None:
    """An MTP head's decoder (the target's text config): what vLLM builds that specreplay does not."""
    layers = decoder.get("mtp_num_hidden_layers") or decoder.get("num_nextn_predict_layers")
    if layers is not None and layers > 1:
        key = "mtp_num_hidden_layers" if decoder.get("mtp_num_hidden_layers") else "num_nextn_predict_layers"
        refuse(
            source,
            f"{where}{key}",
            layers,
            f"vLLM cycles the draft steps through {layers} MTP layers (step i uses layer i % {layers}), SGLang builds "
            f"one and llama.cpp refuses more than one; specreplay scores one",
        )
    checks = (
        (
            "attn_output_gate",
            False,
            "vLLM then builds ungated attention (q_proj without the gate); specreplay's is gated",
        ),
        ("layer_scale", True, "vLLM then scales the attention and MLP branches by learned per-layer weights"),
        ("qkv_bias", True, "vLLM then adds q/k/v biases; specreplay's MTP attention has none"),
        ("attention_bias", True, "vLLM reads qkv_bias instead and never biases o_proj; specreplay would bias q/k/v/o"),
    )
    for key, value, why in checks:
        if decoder.get(key) is value:
            refuse(source, f"{where}{key}", value, why)


def mtp_layer_is_moe(kind: str, hf) -> bool:
    """Whether engines build the MTP layer's MLP as a mixture of experts. Qwen3.5: by model_type alone
    (vLLM qwen3_5.py builds the sparse block for qwen3_5_moe_text). Qwen3-Next: as for its decoder
    layer 0 (mtp.layers.0), from the RESOLVED config: num_experts > 0, 0 not in mlp_only_layers and
    (0 + 1) % decoder_sparse_step == 0; an absent num_experts is Qwen3NextConfig's default (512), not 0."""
    if kind != "qwen3_next":
        return kind == "qwen3_5_moe_text"
    experts = getattr(hf, "num_experts", 0) or 0
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return experts > 0 and 0 not in (getattr(hf, "mlp_only_layers", None) or []) and 1 % step == 0


def check_mtp_experts(decoder: dict, hf, kind: str, where: str, source: str) -> None:
    """An MoE MTP layer's router and shared expert: what transformers' block (the reference) computes
    and what an engine would compute otherwise."""
    top_k, experts = hf.num_experts_per_tok, hf.num_experts
    if top_k > experts:
        refuse(
            source,
            f"{where}num_experts_per_tok",
            top_k,
            f"vLLM, llama.cpp and transformers route each token to its top-k of the {experts} experts (num_experts): "
            f"there are fewer",
        )
    if hf.shared_expert_intermediate_size == 0:
        refuse(
            source,
            f"{where}shared_expert_intermediate_size",
            0,
            "vLLM then builds no shared expert; specreplay's MoE block (transformers') always has one",
        )
    if kind == "qwen3_5_moe_text" and decoder.get("norm_topk_prob") is False:
        refuse(
            source,
            f"{where}norm_topk_prob",
            False,
            "vLLM then leaves the top-k routing weights unnormalized, while transformers' Qwen3.5-MoE router and "
            "llama.cpp always renormalize them; specreplay does not pick between them",
        )


def check_nextn_decoder(raw: dict, hf, source: str) -> None:
    """A GLM-4.5 or DeepSeek-V3 target's NextN heads (proposers/mtp/nextn.py): MoE; GLM-4.5's
    routed over every expert (llama.cpp's export has no groups), DeepSeek-V3's as its own keys say."""
    layers = hf.num_nextn_predict_layers  # absent: Glm4MoeConfig's 1
    if not layers:
        refuse(
            source,
            "num_nextn_predict_layers",
            layers,
            "the target has no NextN head to score (vLLM builds none, deepseek_mtp.py:157-167; llama.cpp's MTP "
            "graph asserts one, src/models/glm4-moe.cpp:134)",
        )
    if hf.first_k_dense_replace > hf.num_hidden_layers:
        refuse(
            source,
            "first_k_dense_replace",
            hf.first_k_dense_replace,
            f"the NextN layer (layer {hf.num_hidden_layers}) is then dense in vLLM while llama.cpp's MTP graph always "
            "builds it MoE (src/models/glm4-moe.cpp:150); specreplay does not pick between them",
        )
    if raw["model_type"] == "deepseek_v3":
        _check_deepseek(raw, hf, source)
    elif hf.n_group > 1 and hf.topk_group < hf.n_group:
        refuse(
            source,
            "topk_group",
            hf.topk_group,
            f"vLLM and transformers then route inside the best {hf.topk_group} of {hf.n_group} expert groups, while "
            "llama.cpp's GLM-4.5 converter writes no groups (conversion/glm.py:151-183) and routes over every "
            "expert; specreplay does not pick between them",
        )
    if not hf.n_shared_experts:
        refuse(
            source,
            "n_shared_experts",
            hf.n_shared_experts,
            "llama.cpp's MTP graph always adds the shared experts (src/models/glm4-moe.cpp:248-257); specreplay's "
            "MoE block (transformers' Glm4MoeMoE) would add an empty one",
        )
    check_logit_scale(raw, "", source)


# DeepSeek-V3's config.json keys vLLM's deepseek_v2.py reads, the value specreplay's replay
# (transformers' DeepseekV3MoE: sigmoid scores, the score-correction bias, every layer from
# first_k_dense_replace on MoE) implements, and what vLLM does when a config leaves one out
DEEPSEEK_ONLY = (
    ("moe_layer_freq", 1, 1, "vLLM then makes only every moe_layer_freq-th layer MoE (deepseek_v2.py:1269,1296)"),
    ("scoring_func", "sigmoid", "softmax", "vLLM then scores the experts so (deepseek_v2.py:387)"),
    ("topk_method", "noaux_tc", None, "vLLM then drops the score-correction bias (deepseek_v2.py:327-332)"),
)


def _check_deepseek(raw: dict, hf, source: str) -> None:
    for key, value, absent, why in DEEPSEEK_ONLY:
        said = raw.get(key, absent)
        if said != value:
            stated = "absent" if key not in raw else shown(said)
            refuse_field(source, key, stated, f"{why}; specreplay scores {shown(value)} (transformers' DeepseekV3MoE)")
    if raw.get("quantization_config") is not None:
        refuse(
            source,
            "quantization_config",
            raw["quantization_config"].get("quant_method", "set"),
            "the checkpoint's weights are quantized (vLLM dequantizes them with their scales); specreplay reads "
            "unquantized weights: dequantize the checkpoint first",
        )
    if raw.get("head_dim") not in (None, hf.qk_rope_head_dim):
        refuse(
            source,
            "head_dim",
            raw["head_dim"],
            f"DeepSeek-V3's rotary embedding is qk_rope_head_dim ({hf.qk_rope_head_dim}) wide: vLLM's MLA reads that "
            "and transformers sets head_dim to it unless a config says otherwise, when its rotary no longer fits",
        )
    if hf.v_head_dim > hf.qk_nope_head_dim + hf.qk_rope_head_dim:
        refuse(
            source,
            "v_head_dim",
            hf.v_head_dim,
            "specreplay's MLA pads the values to the key width (qk_nope_head_dim + qk_rope_head_dim), which is smaller",
        )


# the keys one MiMo-V2-Flash MTP head's shapes come from, and where vLLM reads each
MIMO_HEAD_KEYS = (
    ("hidden_size", "mimo_v2_mtp.py:73-76"),
    ("intermediate_size", "mimo_v2_mtp.py:112-117"),
    ("vocab_size", "mimo_v2_mtp.py:181-184"),
    ("swa_num_attention_heads", "mimo_v2_mtp.py:91"),
    ("swa_num_key_value_heads", "mimo_v2_mtp.py:92"),
    ("swa_head_dim", "mimo_v2_mtp.py:93"),
)


def check_mimo(raw: dict, source: str) -> None:
    """MiMo-V2-Flash's MTP heads (proposers/mtp/mimo.py): the keys their shapes come from stated,
    weights unquantized, a silu MLP."""
    for key, line in MIMO_HEAD_KEYS:
        if raw.get(key) is None:
            refuse_field(
                source,
                key,
                "absent",
                f"vLLM builds every MTP head from it ({line}); state it as the released config.json does",
            )
    if raw.get("quantization_config") is not None:
        refuse(
            source,
            "quantization_config",
            raw["quantization_config"].get("quant_method", "set"),
            "specreplay replays unquantized weights only",
        )
    if raw.get("hidden_act", "silu") != "silu":
        refuse(source, "hidden_act", raw["hidden_act"], "vLLM's MiMo MLP refuses any but silu (mimo_v2.py:104-107)")
    heads = raw.get("num_nextn_predict_layers")
    if heads is not None and heads > 3:
        refuse(
            source,
            "num_nextn_predict_layers",
            heads,
            "MiMo-V2-Flash ships 3 MTP heads and llama.cpp's converter keeps 3 (conversion/mimo.py:22-24)",
        )
