"""Random MTP heads at SmolLM2's widths for the bench (section `eagle`: their scoring cost beside
DFlash v1's and EAGLE-3's on the same synthetic shards).

Each is a target's config.json (SMOLLM2's widths and layer count, every layer full attention)
with only the head's tensors in its safetensors, as the product reads them (`mtp.*` for Qwen3.5 and
Qwen3.5-MoE, `model.layers.{L}.*` for GLM-4.5's and DeepSeek-V3's NextN heads, `model.mtp.layers.{0,1,2}.*`
for MiMo-V2-Flash's three): the head modules are the tests' reference ones (transformers' own decoder
layer classes: tests/helpers/mtp_online.py, nextn_online.py, mimo_online.py) at their own random init,
the experts saved one at a time as transformers saves a target (a one-layer model of the target's
class supplies the names' conversion).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.sections.families import DECODER
from bench.sections.length import SMOLLM2

# the target's widths: SmolLM2's, its layer the other drafters' decoder layer (families.DECODER)
SHAPES = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")
WIDTHS = {key: DECODER[key] for key in SHAPES} | dict(
    vocab_size=SMOLLM2["vocab_size"],
    hidden_size=SMOLLM2["hidden_size"],
    num_hidden_layers=SMOLLM2["num_layers"],
    tie_word_embeddings=False,
)
# an MoE head's experts: 32 routed (top 4) and a shared one, each as wide as a quarter of the dense MLP
EXPERTS = dict(moe_intermediate_size=384, num_experts_per_tok=4)
KINDS = ("qwen3_5", "qwen3_5_moe", "glm4_moe", "deepseek_v3", "mimo_v2_flash")
# MiMo's heads: sliding layers of 8 query heads of 72 (2 key/value heads, the released config's) over
# SmolLM2's width, its 128-token window; every trunk layer full attention and dense
MIMO_SWA = dict(swa_head_dim=72, swa_v_head_dim=72, swa_num_attention_heads=8, sliding_window=128)
MIMO_SWA |= dict(sliding_window_size=128)


def _config(kind: str):
    """transformers' config of the target of `kind` at SMOLLM2's widths."""
    from transformers import DeepseekV3Config, Glm4MoeConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    from tests.helpers.nextn_online import DEEPSEEK, GLM

    full = {"layer_types": ["full_attention"] * WIDTHS["num_hidden_layers"]}
    if kind == "mimo_v2_flash":
        from transformers import MiMoV2FlashConfig

        swa = dict(num_attention_heads=8, head_dim=72, v_head_dim=72, sliding_window_size=128)
        return MiMoV2FlashConfig(**WIDTHS | swa, mlp_layer_types=["dense"] * WIDTHS["num_hidden_layers"], **full)
    if kind == "qwen3_5":
        return Qwen3_5TextConfig(**WIDTHS, **full)
    if kind == "qwen3_5_moe":
        moe = dict(num_experts=32, shared_expert_intermediate_size=384, **EXPERTS)
        return Qwen3_5MoeTextConfig(**{k: v for k, v in WIDTHS.items() if k != "intermediate_size"}, **full, **moe)
    moe = dict(n_routed_experts=32, n_shared_experts=1, **EXPERTS)
    if kind == "glm4_moe":
        return Glm4MoeConfig(**GLM | WIDTHS | moe)
    mla = dict(num_key_value_heads=9, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32)
    mla |= dict(v_head_dim=64, head_dim=32)  # DeepSeek's head_dim is its rotary width
    mla["rope_parameters"] = DEEPSEEK["rope_parameters"] | {"original_max_position_embeddings": 2048}  # x4: 8192
    return DeepseekV3Config(**DEEPSEEK | WIDTHS | moe | mla, scoring_func="sigmoid", topk_method="noaux_tc")


def _one_layer_target(config):
    """A one-layer model of the target's class: only its weight-name conversion is used."""
    from transformers import AutoModelForCausalLM

    fields = {**config.to_dict(), "num_hidden_layers": 1, "first_k_dense_replace": 0}
    if "layer_types" in fields:
        fields["layer_types"] = fields["layer_types"][:1]
    return AutoModelForCausalLM.from_config(type(config)(**fields))


def _head_state(kind: str, config) -> dict[str, torch.Tensor]:
    """The head's tensors under the checkpoint's names, experts one at a time."""
    from transformers.core_model_loading import revert_weight_conversion

    from tests.helpers.mtp_online import MtpHead
    from tests.helpers.nextn_online import NextnHead

    if kind == "mimo_v2_flash":
        from tests.helpers.mimo_online import build_heads

        return {k: v for i, head in enumerate(build_heads(config)) for k, v in head.eval().state(i).items()}
    if kind.startswith("qwen3_5"):
        head = MtpHead(config)
        state = {f"mtp.{k}": v.detach().contiguous() for k, v in head.state_dict().items()}
    else:
        state = NextnHead(config).eval().state(config.num_hidden_layers)
    if "moe" in kind or not kind.startswith("qwen3_5"):
        state = revert_weight_conversion(_one_layer_target(config), state)
    return {k: v.contiguous() for k, v in state.items()}


def write_head(out: Path, kind: str, seed: int) -> str:
    """A checkpoint directory of `kind` (one of KINDS): the target's config.json, the head's tensors."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    config = _config(kind)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_config_file(kind, config), indent=1))
    save_file(_head_state(kind, config), str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _config_file(kind: str, config) -> dict:
    """The config.json: transformers' own, and for MiMo the released checkpoint's keys the engines read
    (tests/helpers/mimo_online.py's HUB at these widths) in place of the ones transformers derives."""
    fields = config.to_dict()
    if kind != "mimo_v2_flash":
        return fields
    from tests.helpers.mimo_online import HUB

    layers = [0] * WIDTHS["num_hidden_layers"]  # full attention, dense MLP
    fields.pop("rope_parameters", None)
    return fields | HUB | MIMO_SWA | dict(hybrid_layer_pattern=layers, moe_layer_freq=layers)
