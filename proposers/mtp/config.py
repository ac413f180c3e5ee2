"""The MTP family: a target's native multi-token-prediction head in the project's terms (the chain;
trees no).

* native (proposers/ (layout.py of each family, layouts.py)native_mtp.py): the target's own checkpoint directory
  (`score --ckpt <target dir>`); the head's shapes are the target's decoder config (Qwen3.5's
  `text_config`), its `mtp.*` tensors read alone (files.read_prefixed).
* speculators (`speculators_model_type: "mtp"`): the verifier's decoder config in
  `transformer_layer_config`, its tensors `mtp_layers.0.*` (mtp_model.canonical_names);
  k = `speculators_config.proposal_methods[0].speculative_tokens`.

* deepseek-v4 (a DeepSeek-V4 target's config.json, `model_type` `deepseek_v4`): its MTP head `mtp.0.*`, one
  DeepSeek-V4 block on the target's last layer's hyper-connection streams (dsv4.py; dsv4_rules.py).

* nextn (a GLM-4.5 or DeepSeek-V3 target's config.json, `model_type` `glm4_moe` / `deepseek_v3`): its NextN head
  `model.layers.{L}.*`, the target's own config its decoder (nextn.py; decoder_rules.check_nextn_decoder).

native and speculators: Qwen3-Next or Qwen3.5 decoders; the MTP layer's MLP is the target's own sparse MoE block
(routed experts and a gated shared expert) where the engines build one: always for Qwen3.5-MoE, for
Qwen3-Next as its resolved config says (decoder_rules.mtp_layer_is_moe). A block is
the chain at one anchor, as for EAGLE-3: k steps, step j reading the stored token at t + j - 1
and proposing t + j. The model and the rule: model.py.
"""

from __future__ import annotations

from pipeline.common.layer_ids import final_prenorm_id
from proposers.fields.decoder_rules import (
    check_mimo,
    check_mtp_decoder,
    check_mtp_experts,
    check_nextn_decoder,
    mtp_layer_is_moe,
)
from proposers.mtp import nextn
from proposers.mtp.dsv4_rules import check_dsv4_mtp, dsv4_shape
from proposers.mtp.layout import MIMO_HEADS, NativeDSV4, NativeMimo, NativeMTP, NativeNextN, SpeculatorsMTP
from proposers.mtp.model import MtpDrafter, hf_config
from proposers.registry import Family
from proposers.toolkit.config import DrafterConfig, DrafterConfigError, decoder_shape, refuse_field

# Steps a native head drafts when nothing says (vLLM takes num_speculative_tokens at serving time;
# speculators' MTP default is 3)
DEFAULT_STEPS = 3
# why llama.cpp's rule is not an engine's for a stack of NextN heads
NEXTN_STACK_LLAMA = (
    "llama.cpp's GLM-4.5 and DeepSeek MTP graphs build a single NextN head (src/models/glm4-moe.cpp:135, "
    "deepseek2.cpp:173); the replay runs head 0's chain"
)
# model_type -> the decoder kind model.PARTS builds (Qwen3.5's wrapper nests its text config)
KINDS = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_text": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_5_moe_text": "qwen3_5_moe_text",
}


def parse_drafter_config(checked, raw: dict, source: str = "config", target_layers: int | None = None) -> DrafterConfig:
    """An MTP head's config in the project's terms: a target's own config.json or a speculators export."""
    if isinstance(checked, NativeNextN):
        return _nextn(checked, raw, source)
    if isinstance(checked, NativeMimo):
        return _mimo(checked, raw, source)
    if isinstance(checked, NativeDSV4):
        return _dsv4(checked, raw, source)
    if isinstance(checked, NativeMTP):
        decoder, steps = raw.get("text_config") or raw, DEFAULT_STEPS
        where = "text_config." if raw.get("text_config") else ""
    elif isinstance(checked, SpeculatorsMTP):
        decoder, steps = raw["transformer_layer_config"], checked.speculative_tokens or DEFAULT_STEPS
        where = "transformer_layer_config."
    else:
        raise DrafterConfigError(f"{source}: a {type(checked).__name__} config is not one of MTP's layouts")
    kind = _kind(decoder, raw, source)
    hf = hf_config({**decoder, "model_type": kind}, kind, source)
    check_mtp_decoder(decoder, hf, where, source)
    moe = mtp_layer_is_moe(kind, hf)
    if moe:
        check_mtp_experts(decoder, hf, kind, where, source)
    return _config(decoder, kind, hf, checked, steps, moe)


def _kind(decoder: dict, raw: dict, source: str) -> str:
    """The decoder kind of mtp_model.PARTS, or the one line saying why it is not scored."""
    model_type = decoder.get("model_type") or raw.get("model_type")
    if model_type not in KINDS:
        refuse_field(source, "model_type", repr(model_type), f"specreplay scores the MTP heads of {sorted(KINDS)}")
    return KINDS[model_type]


def _config(decoder: dict, kind: str, hf, checked, steps: int, moe: bool) -> DrafterConfig:
    shape = decoder_shape(hf)
    if moe:  # the widest MLP activations a token makes: its routed experts' and the shared expert's
        shape["intermediate_size"] = (
            hf.num_experts_per_tok * hf.moe_intermediate_size + hf.shared_expert_intermediate_size
        )
    options = {"decoder": kind, "feed_post_norm": True, "moe": moe}
    return _head_config(shape, hf.num_hidden_layers, steps, {**decoder, "model_type": kind}, checked, options)


def _nextn(checked: NativeNextN, raw: dict, source: str) -> DrafterConfig:
    """A GLM-4.5 or DeepSeek-V3 target's NextN head (nextn.py): its decoder is the target's own config."""
    hf = nextn.nextn_config(raw, source)
    check_nextn_decoder(raw, hf, source)
    shape = decoder_shape(hf)  # the widest MLP activations a token makes: its routed experts' and the shared ones
    shape["intermediate_size"] = hf.moe_intermediate_size * (hf.num_experts_per_tok + hf.n_shared_experts)
    if checked.model_type == "deepseek_v3":  # MLA: every head its own keys, values padded to the key width (mla.py)
        shape["head_dim"] = hf.qk_nope_head_dim + hf.qk_rope_head_dim
        shape["num_key_value_heads"] = hf.num_attention_heads
    # feeds_pre_norm: vLLM feeds back the state before shared_head.norm, where llama.cpp does not (GLM-4.5)
    kind, heads = nextn.KINDS[checked.model_type], hf.num_nextn_predict_layers
    options = {"decoder": checked.model_type, "moe": True, "feeds_pre_norm": kind.feeds_pre_norm, "heads": heads}
    if heads > 1:  # a stack drafts a step per head by default (vLLM reuses head j % N past them: steps.py)
        options["unmatched_rules"] = {"llama.cpp": NEXTN_STACK_LLAMA}
    steps = heads if heads > 1 else DEFAULT_STEPS
    return _head_config(shape, hf.num_hidden_layers, steps, {**raw}, checked, options)


def _mimo(checked: NativeMimo, raw: dict, source: str) -> DrafterConfig:
    """MiMo-V2-Flash's MTP heads (mimo.py): each a sliding-window layer of the `swa_*` shapes, dense MLP."""
    check_mimo(raw, source)
    heads = raw.get("num_nextn_predict_layers") or MIMO_HEADS
    window = raw.get("sliding_window_size", -1)
    shape = dict(
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"], vocab_size=raw["vocab_size"],
        num_hidden_layers=1,
        num_attention_heads=raw["swa_num_attention_heads"], num_key_value_heads=raw["swa_num_key_value_heads"],
        head_dim=raw["swa_head_dim"], rms_norm_eps=raw.get("layernorm_epsilon", 1e-5),
        attention_bias=raw.get("attention_bias", False),
    )  # fmt: skip
    options = {"decoder": "mimo_v2_flash", "heads": heads, "window": window if window > 0 else None}
    return _head_config(shape, raw["num_hidden_layers"], heads, {**raw}, checked, options)


# what --walk-rule llama.cpp leaves unchecked for this layout (docs/drafter-families.md#deepseek-v4-mtp-head)
DSV4_UNMATCHED = {
    "llama.cpp": "llama.cpp's DeepSeek-V4 MTP rule (its lead slot) is written from src/models/deepseek4.cpp and "
    "common/speculative.cpp, not yet compared with a running llama-server (docs/drafter-families.md#deepseek-v4-mtp-head)"
}


def _dsv4(checked: NativeDSV4, raw: dict, source: str) -> DrafterConfig:
    """DeepSeek-V4's MTP head (dsv4.py): one DeepSeek-V4 block over the target's last layer's streams,
    stored as id L; the target's final norm is never read."""
    check_dsv4_mtp(raw, source)
    options = {"decoder": "deepseek_v4", "unmatched_rules": DSV4_UNMATCHED}
    config = _head_config(dsv4_shape(raw), raw["num_hidden_layers"], DEFAULT_STEPS, {**raw}, checked, options)
    config.reads_final_norm = False
    return config


def _head_config(shape: dict, num_layers: int, steps: int, raw: dict, checked, options: dict) -> DrafterConfig:
    """An MTP head's config: the chain of `steps` drafts over the target's final hidden state before
    its norm (id L, the norm's weight from the target head), one full-attention layer of `shape`."""
    layers = final_prenorm_id(num_layers)
    return DrafterConfig(
        **shape,
        block_size=steps,
        mask_token_id=None,
        target_layer_ids=[layers],
        num_target_layers=num_layers,
        layer_types=["full_attention"],
        sliding_window=None,
        is_causal=True,
        raw=raw,
        family="mtp",
        layout=checked.LAYOUT,
        drafts_from_anchor=True,
        teacher_forced_block=True,
        block_conventions=False,
        reads_final_norm=True,
        family_options=options,
        stated_layer_ids=[layers],
        layer_convention="output",
    )


def build_model(config: DrafterConfig):
    """The head's network: a NextN layer (GLM-4.5, DeepSeek-V3), MiMo's chained heads or a Qwen3.5 /
    Qwen3-Next `mtp.*` head."""
    if config.layout == NativeMimo.LAYOUT:
        from proposers.mtp.mimo import MimoDrafter

        return MimoDrafter(config)
    if config.layout == NativeDSV4.LAYOUT:
        from proposers.mtp.dsv4 import DSV4MtpDrafter

        return DSV4MtpDrafter(config)
    return nextn.NextnDrafter(config) if config.layout == NativeNextN.LAYOUT else MtpDrafter(config)


FAMILY = Family("mtp", parse_drafter_config, build_model, independent_drafts=False, chain_steps=True)
