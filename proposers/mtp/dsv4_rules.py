"""What a DeepSeek-V4 target's config.json must say for its MTP head (proposers/mtp/dsv4.py) to be
scored, torch-free: each field the engines refuse, run apart, or specreplay does not implement,
refused by name in one line (`check_dsv4_mtp`), and the head's DrafterConfig shape."""

from __future__ import annotations

from proposers.fields.decoder_rules import refuse

# the decoder fields the head is built from (DeepseekV4Config's names, DeepSeek's own): no default read
REQUIRED = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank", "qk_rope_head_dim",
    "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "hc_mult",
    "sliding_window", "vocab_size",
)  # fmt: skip


# (field, the values the engines run, the file's value (its default when absent), why the others are refused)
def _rules(raw: dict) -> list[tuple[str, tuple, object, str]]:
    layers = raw["num_hidden_layers"]
    ratios = raw.get("compress_ratios") or []
    return [
        ("num_nextn_predict_layers", (1,), raw.get("num_nextn_predict_layers", 1),
         "llama.cpp's DeepSeek-V4 MTP graph builds one head (src/models/deepseek4.cpp:1365) while vLLM cycles "
         "the steps through them (nvidia/mtp.py:265); specreplay scores one head, and 0 has none"),
        ("quantization_config", (None,), (raw.get("quantization_config") or {}).get("quant_method"),
         "specreplay replays unquantized weights only; dequantize the checkpoint first"),
        ("scoring_func", ("sqrtsoftplus",), raw.get("scoring_func", "sqrtsoftplus"),
         "specreplay's block routes as transformers' DeepseekV4TopKRouter (sqrtsoftplus); set sqrtsoftplus"),
        ("hidden_act", ("silu",), raw.get("hidden_act", "silu"),
         "llama.cpp's MTP graph runs SiLU-gated experts only (src/models/deepseek4.cpp:1452-1468); set silu"),
        ("norm_topk_prob", (True,), raw.get("norm_topk_prob", True) is not False,
         "specreplay's block (transformers' DeepseekV4TopKRouter) normalizes the routed weights; set it true"),
        ("num_key_value_heads", (1,), raw.get("num_key_value_heads", 1),
         "vLLM and llama.cpp attend with DeepSeek-V4's one shared key/value head; set 1"),
        ("hc_mult", (4,), raw["hc_mult"],
         "llama.cpp's DeepSeek-V4 graph runs four hyper-connection streams only (src/models/deepseek4.cpp:366); set 4"),
        ("n_shared_experts", (1,), raw.get("n_shared_experts", 1),
         "llama.cpp's MTP graph runs one shared expert (src/models/deepseek4.cpp:1464-1469); set 1"),
        ("compress_ratios", (0, None), ratios[layers] if len(ratios) > layers else None,
         "vLLM never compresses the MTP block's attention (deepseek_v4/attention.py:236-242) while llama.cpp "
         "reads the ratio at its index (src/models/deepseek4.cpp:55-61); give the head 0"),
        ("num_hash_layers", tuple(range(layers + 1)), raw.get("num_hash_layers", 0),
         "llama.cpp refuses a hash-routed MTP block (src/models/deepseek4.cpp:1450) and specreplay's block routes "
         "by top-k; list the target's hash layers only"),
    ]  # fmt: skip


def check_dsv4_mtp(raw: dict, source: str) -> None:
    """The head's config, one refusal line for the first field specreplay would score wrong."""
    if raw.get("model_type") == "deepseek_v41":
        refuse(
            source,
            "model_type",
            "deepseek_v41",
            "DeepSeek-V4.1 has no MTP head, vLLM says: its `mtp.*` tensors are DSpark stages (vllm/config/speculative.py:"
            "765-778); score them with their DSpark config (architectures DeepseekV4DSparkModel)",
        )
    missing = next((key for key in REQUIRED if raw.get(key) is None), None)
    if missing is not None:
        refuse(source, missing, "absent", "vLLM and llama.cpp build DeepSeek-V4's MTP block from it; state it")
    for field, served, value, why in _rules(raw):
        if value not in served:
            refuse(source, field, list(value) if isinstance(value, tuple) else value, why)


def dsv4_shape(raw: dict) -> dict:
    """The head's DrafterConfig shape: one DeepSeek-V4 block, its widest MLP activation the routed
    experts' and the shared one's."""
    return dict(
        hidden_size=raw["hidden_size"], vocab_size=raw["vocab_size"], num_hidden_layers=1,
        num_attention_heads=raw["num_attention_heads"], num_key_value_heads=1, head_dim=raw["head_dim"],
        intermediate_size=raw["moe_intermediate_size"] * (raw["num_experts_per_tok"] + raw.get("n_shared_experts", 1)),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
    )  # fmt: skip
