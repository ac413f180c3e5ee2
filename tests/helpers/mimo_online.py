"""MiMo-V2-Flash's MTP heads written from the engines' source alone, on transformers' own
MiMoV2FlashDecoderLayer (its sliding-window attention with sinks and value scale, dense MLP), and a
tiny MiMo-V2-Flash target saved as the released checkpoints are (hub config keys, three heads).

vLLM 0.33 `model_executor/models/mimo_v2_mtp.py`, one head (`MiMoV2MTPLayer`, 61-142):
  enorm/hnorm/eh_proj over [enorm(embed) ; hnorm(previous_hidden_states)] (128-132, embedding first),
  input_layernorm, self_attn of the SWA kind (78-107: swa_* shapes, sinks, swa_rope_theta),
  pre_mlp_layernorm, dense mlp (134-140), returned AFTER final_layernorm (142); compute_logits applies
  lm_head to that (214-220); only head 0 exists (`_MIMO_V2_FLASH_NUM_MTP_LAYERS = 1`, 52-54, 177),
  reused at each step (`spec_step_idx % num_mtp_layers`, 209-210) by v1/spec_decode/llm_base_proposer.py,
  which feeds the returned tensor back (599-602, 753-760): `Head.fed_back` is final_layernorm.
  Step 1 reads the target model's output, after its final norm (mimo_v2.py:848).

The module names are the checkpoint's (`model.mtp.layers.{i}.*`): the decoder layer's
`post_attention_layernorm` is saved as `pre_mlp_layernorm`, its `sinks` as `attention_sink_bias`
(transformers' own renaming, conversion_mapping.py `mimo_v2_flash`), its q/k/v fused into `qkv_proj`
[Q;K;V] (MiMo-V2.5's layout, which llama.cpp's MTP graph asserts, src/models/mimo2.cpp:285)."""

from __future__ import annotations

import copy
import json
import os
import shutil

import torch
from torch import nn

SWA = "sliding_attention"
TARGET = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
    head_dim=24, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
    sliding_window_size=64, max_position_embeddings=256, attention_value_scale=0.707, tie_word_embeddings=False,
)  # fmt: skip
# the released config.json's keys the engines read (transformers' class derives its own from defaults)
HUB = dict(
    hybrid_layer_pattern=[0, 1], moe_layer_freq=[0, 1], swa_head_dim=24, swa_v_head_dim=16, swa_num_attention_heads=4,
    swa_num_key_value_heads=2, layernorm_epsilon=1e-5, topk_method="noaux_tc", scoring_func="sigmoid",
    rope_theta=5000000.0, swa_rope_theta=10000.0, partial_rotary_factor=0.334, add_swa_attention_sink_bias=True,
    add_full_attention_sink_bias=False, sliding_window=64, sliding_window_size=64,
)  # fmt: skip
HEADS = 3


def target_config(vocab_size: int):
    from transformers import MiMoV2FlashConfig

    return MiMoV2FlashConfig(**TARGET, vocab_size=vocab_size)


def head_layer_config(config):
    """The decoder-layer config of an MTP head: transformers' sliding layer (kv heads doubled there,
    so swa_num_key_value_heads / 2), dense MLP, eager attention (sinks)."""
    head = copy.deepcopy(config)
    head.layer_types, head.mlp_layer_types = [SWA], ["dense"]
    head.num_key_value_heads = HUB["swa_num_key_value_heads"] // 2
    head._attn_implementation = "eager"
    return head


class Rotary(nn.Module):
    """transformers' MiMo rotary embedding at the sliding layers' parameters (swa_rope_theta)."""

    def __init__(self, config):
        from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashRotaryEmbedding

        super().__init__()
        self.inner = MiMoV2FlashRotaryEmbedding(config)

    def forward(self, x, positions):
        return self.inner(x, positions, SWA)


class Head(nn.Module):
    """One MTP head (mtp_online's head interface: combine, logit_state, fed_back, layers[0])."""

    def __init__(self, config):
        from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash as m

        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = m.MiMoV2FlashRMSNorm(hidden, eps), m.MiMoV2FlashRMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([m.MiMoV2FlashDecoderLayer(config, 0)])
        self.final_layernorm = m.MiMoV2FlashRMSNorm(hidden, eps)
        with torch.no_grad():  # trained norms and sinks: at 1 (0) they would hide a wrong rule
            for norm in (self.enorm, self.hnorm, self.final_layernorm):
                norm.weight.normal_(1.0, 0.3)
            self.layers[0].self_attn.sinks.normal_(0.0, 1.0)

    def combine(self, embeds, hidden, positions):
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))  # mimo_v2_mtp.py:128-132

    def logit_state(self, h):
        return self.final_layernorm(h)  # mimo_v2_mtp.py:142

    def fed_back(self, h):
        return self.final_layernorm(h)  # the single returned tensor, llm_base_proposer.py:599-602

    def state(self, index: int) -> dict[str, torch.Tensor]:
        """The head's tensors as the checkpoint names them, q/k/v fused into qkv_proj."""
        prefix, out = f"model.mtp.layers.{index}.", {}
        own = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        attn = "layers.0.self_attn."
        qkv = torch.cat([own.pop(f"{attn}{p}_proj.weight") for p in "qkv"])
        own[f"{attn}qkv_proj.weight"], own[f"{attn}attention_sink_bias"] = qkv, own.pop(f"{attn}sinks")
        own["layers.0.pre_mlp_layernorm.weight"] = own.pop("layers.0.post_attention_layernorm.weight")
        for name, tensor in own.items():
            out[prefix + name.removeprefix("layers.0.")] = tensor
        return out


@torch.no_grad()
def prenorm_states(target, ids: torch.Tensor) -> torch.Tensor:
    """[T, H] the target's final hidden state before its final norm (what llama.cpp's MTP reads)."""
    seen = []
    hook = target.model.norm.register_forward_hook(lambda module, args, out: seen.append(args[0][0]))
    try:
        target.model(input_ids=ids[None])
    finally:
        hook.remove()
    return seen[0]


def fit(heads: nn.ModuleList, target, sequences: list[torch.Tensor], steps: int, lr: float) -> float:
    """Adam on llama.cpp's chain, teacher-forced over whole sequences: head k's row s reads
    (x_{s+1+k}, the state head k - 1 gave there, head 0 the target's pre-norm one) and predicts
    x_{s+2+k}; the heads' losses summed. A brief fit: heads that accept, not an exact rule."""
    from tests.helpers.mtp_online import _forward

    data = [(ids, prenorm_states(target, ids)) for ids in sequences]
    optimizer = torch.optim.Adam(heads.parameters(), lr=lr)
    embed, loss = target.model.embed_tokens, torch.tensor(0.0)
    for step in range(steps):
        ids, state = data[step % len(data)]
        n = ids.numel() - 1 - len(heads)
        loss = torch.tensor(0.0)
        for k, head in enumerate(heads):
            with torch.no_grad():
                embeds = embed(ids[1 + k : 1 + k + n])[None]
            out = _forward(head, embeds, state[None, :n], torch.arange(n)[None], None)
            logits = target.lm_head(head.logit_state(out))[0]
            loss = loss + nn.functional.cross_entropy(logits, ids[2 + k : 2 + k + n])
            state = out[0].detach()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss.detach()) / len(heads)


def build_heads(config, seed: int = 1) -> nn.ModuleList:
    from tests.helpers.models import seeded

    with seeded(seed):
        return nn.ModuleList([Head(head_layer_config(config)) for _ in range(HEADS)])


def save_heads(heads: nn.ModuleList, model_dir: str, keep: int = HEADS) -> None:
    """The first `keep` heads added to the target's safetensors, its config.json rewritten with the
    released checkpoint's keys (HUB) in place of the ones transformers derives."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    state = load_file(path)
    for index, head in enumerate(heads[:keep]):
        state.update(head.eval().state(index))
    save_file(state, path, metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config.pop("rope_parameters", None)  # transformers' defaults are HUB's thetas and factor
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({**config, **HUB}, f, indent=2)


def convertible_copy(model_dir: str, out: str) -> str:
    """The target as llama.cpp's converter reads the released config.json: its files linked, the
    config's model_type one transformers does not know, so that the converter falls back to the
    file (conversion/base.py:1277-1289) instead of transformers' MiMoV2FlashConfig, whose derived
    rope_parameters lack the top-level partial_rotary_factor conversion/mimo.py:165 reads."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    for name in os.listdir(model_dir):
        if name != "config.json":
            os.symlink(os.path.join(model_dir, name), os.path.join(out, name))
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**config, "model_type": "mimo_v2_flash_released"}, f)
    return out
