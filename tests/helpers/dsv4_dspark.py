"""DeepSeek-V4's DSpark drafter (`DeepseekV4DSparkModel`) for tests/parity/test_engine_parity_dspark_dsv4.py:
a tiny random DeepSeek-V4 target from transformers' own class, and an independent reference drafter
written rule by rule from vLLM's vllm/models/deepseek_v4/nvidia/dspark.py on transformers' own
DeepSeek-V4 modules (DeepseekV4DecoderLayer's projections, norms, hyper-connections and MoE,
DeepseekV4HyperHead, DeepseekV4RotaryEmbedding, apply_rotary_pos_emb, eager_attention_forward with
its sinks), fitted through its own forward (no public class trains this drafter) and saved in
DeepSeek's checkpoint layout (`mtp.{i}.*`, the names vLLM's load_weights and llama.cpp's converter
read; transformers' conversion_mapping.py "deepseek_v4" renames, reversed).

The window the reference applies is either engine's: vLLM's anchored at the block (every query sees
the `sliding_window` context positions before the anchor, vllm/v1/attention/backends/mla/
sparse_swa.py:1293-1296) or llama.cpp's per query (t + i - p < sliding_window, src/llama-hparams.h:
475-487, every DSpark stage windowed: src/models/dflash.cpp:83-88).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, GenerationConfig
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
    DeepseekV4RotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from tests.helpers import dsv4_served as served, gemma4_dspark as g4, llama_engine as engine
from tests.helpers.models import seeded

VOCAB = engine.SMOLLM2_VOCAB  # SmolLM2's tokenizer: its pre-tokenizer is one llama.cpp's converter knows
SMALL_VOCAB = g4.VOCAB  # the Gemma 4 test's byte-fallback BPE tokenizer (no server: a small vocabulary fits fast)
LIVE = 12  # the target emits ids SPECIAL .. SPECIAL + LIVE - 1 only
TARGET_LAYERS = 4
FEATURES = [0, 1]  # output of layers 0 and 1
STORED = [0, 1, 2]  # what the shards hold: the features and one layer past them (the one-off rule)
STAGES = 2
BLOCK = 4
WINDOW = 8  # sliding_window: shorter than most anchors, so the window decides what a block sees
RANK = 4
DRAFTER_INIT = 0.5  # the stages' init std: large, so their attention and experts move the drafts
SINKS = (2.0, -1.0, 3.0, 1.0)  # each stage's attention sinks: not transformers' zeros, so reading them is checked
NOISE = engine.SPECIAL - 1  # an unused special token: the block's noise (mask) token
# The decoder in DeepSeek's own config keys (the checkpoint's config.json, which DeepseekV4Config reads)
DECODER = dict(
    vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=1,
    head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True,
    routed_scaling_factor=1.5, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0,
    sliding_window=WINDOW, rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=2048,
)  # fmt: skip
CSA = dict(index_n_heads=2, index_head_dim=128, index_topk=64)  # a CSA layer's indexer: top-k above any context's
COMPRESSED = dict(compress_rope_theta=1e5, **CSA)  # a compressed last layer's fields (ROPE["compress"])
ROPE = {
    "main": {"rope_type": "default", "rope_theta": 10000.0},
    "compress": {"rope_type": "default", "rope_theta": 1e5},
}


def hf_config(layers: int, init: float = 0.05, last: str = "sliding_attention", vocab: int = VOCAB) -> DeepseekV4Config:
    """transformers' DeepseekV4Config of `layers` top-k routed layers, uncompressed but the last (of
    type `last`), at `vocab` ids; `init` the weights' std (small: the target's greedy responses repeat,
    which a briefly fitted drafter can follow)."""
    fields = {k: v for k, v in DECODER.items() if k not in ("rope_theta", "vocab_size")}
    config = DeepseekV4Config(
        **fields, vocab_size=vocab, num_hidden_layers=layers, layer_types=["sliding_attention"] * (layers - 1) + [last],
        **(COMPRESSED if last != "sliding_attention" else {}),
        mlp_layer_types=["moe"] * layers, rope_parameters=json.loads(json.dumps(ROPE)), initializer_range=init,
        eos_token_id=engine.STOP, bos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return config


def save_target(model_dir, servable: bool = True) -> str:
    """A tiny random DeepSeek-V4 (transformers' class) emitting LIVE ids. Servable: saved with SmolLM2's
    tokenizer, its last layer compressed (CSA) and its experts MXFP4-exact, as llama-server serves it
    (tests/helpers/dsv4_served.py); else (the MTP head's test, no server) four uncompressed layers at
    the Gemma 4 test's small BPE vocabulary, which a head fits faster."""
    last = "compressed_sparse_attention" if servable else "sliding_attention"
    with seeded(0):
        model = DeepseekV4ForCausalLM(
            hf_config(TARGET_LAYERS, last=last, vocab=VOCAB if servable else SMALL_VOCAB)
        ).eval()
    if servable:
        served.mxfp4_exact(model)
    with torch.no_grad():
        if servable:  # the CSA layer only lets llama-server load the target (tests/helpers/dsv4_served.py):
            # its output is zeroed, as transformers' and llama.cpp's compressed attention differ (4 of 8 responses)
            model.model.layers[-1].self_attn.o_b_proj.weight.zero_()
        model.lm_head.weight.mul_(10.0)
        model.lm_head.weight[: engine.SPECIAL] = 0.0  # logit 0 never wins: only live ids are emitted
        model.lm_head.weight[engine.SPECIAL + LIVE :] = 0.0
    model.generation_config = GenerationConfig(eos_token_id=engine.STOP, pad_token_id=engine.STOP, do_sample=False)
    model.save_pretrained(str(model_dir))
    engine.smollm2_tokenizer(model_dir) if servable else g4.save_tokenizer(model_dir)
    return str(model_dir)


def drafter_config(**changes) -> dict:
    """The DSpark config.json: the DeepSeek-V4 checkpoint's own (DeepSeek's keys, the target's layer
    count) with the dspark_* fields."""
    return (
        dict(
            architectures=["DeepseekV4DSparkModel"],
            **DECODER,
            **CSA,  # the target's indexer keys, which llama.cpp's converter reads from the config
            compress_rope_theta=ROPE["compress"]["rope_theta"],
            num_hidden_layers=TARGET_LAYERS,
            compress_ratios=[0] * (TARGET_LAYERS + STAGES),
            num_hash_layers=0,
            n_mtp_layers=STAGES,
            dspark_block_size=BLOCK,
            dspark_noise_token_id=NOISE,
            dspark_target_layer_ids=FEATURES,
            dspark_markov_rank=RANK,
            enable_confidence_head=False,
        )
        | changes
    )


# -- the reference drafter: vLLM's deepseek_v4/nvidia/dspark.py, rule by rule ----------------------


class ReferenceDSV4DSpark(nn.Module):
    """vLLM's DSparkDeepseekV4Model at one anchor's block, on transformers' DeepSeek-V4 modules."""

    def __init__(
        self, hf: DeepseekV4Config | None = None, features: int = len(FEATURES), rank: int = RANK, sinks=SINKS
    ):
        """`hf` the stages' config (the tests': hf_config(STAGES); the bench's, at its own widths), `sinks`
        each head's attention sink (None: transformers' zeros)."""
        super().__init__()
        hf = hf or hf_config(STAGES)
        self.hf, size = hf, hf.hidden_size
        self.main_proj = nn.Linear(size * features, size, bias=False)  # dspark.py:115-122
        self.main_norm = DeepseekV4RMSNorm(size, eps=hf.rms_norm_eps)  # :123
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(hf, i) for i in range(hf.num_hidden_layers))  # :131-139
        self.norm = DeepseekV4RMSNorm(size, eps=hf.rms_norm_eps)  # :154
        self.hc_head = DeepseekV4HyperHead(hf)  # hc_head_fn / base / scale :156-164
        self.markov_head = nn.Module()  # qwen3_dspark.py DSparkMarkovHead: w1 [V, r], w2 [r -> V]
        self.markov_head.markov_w1 = nn.Embedding(hf.vocab_size, rank)
        self.markov_head.markov_w2 = nn.Linear(rank, hf.vocab_size, bias=False)
        self.rotary = DeepseekV4RotaryEmbedding(hf)
        init = type(hf)(**{**hf.to_dict(), "initializer_range": DRAFTER_INIT})
        init._attn_implementation = "eager"
        model = DeepseekV4ForCausalLM(init)  # transformers' own initialisation
        self.layers.load_state_dict(model.model.layers.state_dict())
        self.hc_head.load_state_dict(model.model.hc_head.state_dict())
        for layer in self.layers if sinks else ():
            layer.self_attn.sinks.data = torch.tensor(sinks)

    def rope(self, x: torch.Tensor, positions: torch.Tensor):
        return self.rotary(x, positions[None], "main")  # sliding layers: plain RoPE (common/rope.py:32-36)

    def context_kv(self, attn, main_x: torch.Tensor) -> torch.Tensor:
        """precompute_and_store_context_kv (dspark.py:193-224) and _insert_context_kv's RoPE: every
        stage's own kv_norm(wkv(main_x)) at the context's positions."""
        cos, sin = self.rope(main_x, torch.arange(main_x.shape[0]))
        return apply_rotary_pos_emb(attn.kv_norm(attn.kv_proj(main_x))[None, None], cos, sin)[0, 0]  # [T, d]

    def attention(self, attn, x, positions, ctx, visible) -> torch.Tensor:
        """DeepseekV4Attention over [context ; block] (transformers' modeling_deepseek_v4.py:811-881):
        q_a -> q_norm -> q_b -> per-head unweighted norm -> RoPE; K = V = kv_norm(wkv) roped; sinks in the
        softmax (eager_attention_forward); the output's rope channels rotated back; grouped wo_a, wo_b."""
        cos, sin = self.rope(x, positions)
        q = attn.q_b_norm(attn.q_b_proj(attn.q_a_norm(attn.q_a_proj(x))).view(1, -1, attn.num_heads, attn.head_dim))
        q = apply_rotary_pos_emb(q.transpose(1, 2), cos, sin)  # [1, h, b, d]
        kv = apply_rotary_pos_emb(attn.kv_norm(attn.kv_proj(x))[:, None], cos, sin)[0, 0]  # [b, d]
        keys = torch.cat([ctx, kv])[None, None]  # [1, 1, W + b, d]
        bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
        out, _ = eager_attention_forward(attn, q, keys, keys, bias, scaling=attn.scaling)  # [1, b, h, d]
        out = apply_rotary_pos_emb(out, cos, -sin, unsqueeze_dim=2)
        grouped = attn.o_a_proj(out.reshape(1, out.shape[1], attn.config.o_groups, -1)).flatten(2)
        return attn.o_b_proj(grouped)[0]

    def window(self, anchor: int, queries: int, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(context positions gathered, visible [b, W + b]): vLLM's block-anchored window, or llama.cpp's
        per query; the block bidirectional in both."""
        start = max(0, anchor - WINDOW)
        positions = torch.arange(start, anchor)
        ctx = torch.ones(queries, positions.numel(), dtype=torch.bool)
        if rule == "llama.cpp":
            ctx = (anchor + torch.arange(queries))[:, None] - positions[None, :] < WINDOW
        return positions, torch.cat([ctx, torch.ones(queries, queries, dtype=torch.bool)], dim=1)

    def pre_norm(self, features, ids, anchor: int, queries: int, embed, rule: str = "vllm") -> torch.Tensor:
        """[queries, H]: the hc_head-collapsed state (the forward's return, dspark.py:262-277) of the
        block [x_t, noise, ...] at positions t.. over the context before t."""
        main_x = self.main_norm(self.main_proj(features[:anchor]))  # combine_hidden_states :185-190
        block = torch.full((queries,), NOISE, dtype=torch.long)
        block[0] = ids[anchor]
        h = embed[block][:, None, :].repeat(1, self.hf.hc_mult, 1)[None]  # [1, b, hc, H] :253
        positions = torch.arange(anchor, anchor + queries)
        kept, visible = self.window(anchor, queries, rule)
        for layer in self.layers:
            ctx = self.context_kv(layer.self_attn, main_x)[kept]
            post, comb, collapsed = layer.attn_hc(h)  # hc_pre; mhc_post below
            out = self.attention(layer.self_attn, layer.input_layernorm(collapsed), positions, ctx, visible)
            h = post.unsqueeze(-1) * out[None, :, None, :] + comb.transpose(-1, -2) @ h
            post, comb, collapsed = layer.ffn_hc(h)
            out = layer.mlp(layer.post_attention_layernorm(collapsed))
            h = post.unsqueeze(-1) * out.unsqueeze(-2) + comb.transpose(-1, -2) @ h
        return self.hc_head(h)[0]

    def logits(self, features, ids, anchor: int, count: int, embed, head, rule: str = "vllm") -> torch.Tensor:
        """[count, V] base logits lm_head(norm(h_k)) (compute_logits :418-420)."""
        return self.norm(self.pre_norm(features, ids, anchor, count, embed, rule)) @ head.T

    def chain(self, features, ids, anchor: int, count: int, embed, head, rule: str = "vllm") -> tuple[list, list]:
        """(vLLM's greedy proposal: slot k drafts argmax(base_k + W2 W1[prev_k]), prev_0 the anchor token
        and prev_k the draft before (the speculator's sequential Markov sampling); each slot's argmax
        given the stored token before it instead, teacher-forced)."""
        base = self.logits(features, ids, anchor, count, embed, head, rule)
        stored = ids[anchor : anchor + count]  # a llama.cpp block may reach past the response: fewer forced
        forced = (base[: stored.numel()] + self.markov_head.markov_w2(self.markov_head.markov_w1(stored))).argmax(-1)
        forced = forced.tolist()
        previous, drafts = int(ids[anchor]), []
        for k in range(count):
            bias = self.markov_head.markov_w2(self.markov_head.markov_w1(torch.tensor(previous)))
            previous = int((base[k] + bias).argmax())
            drafts.append(previous)
        return drafts, forced

    def block_loss(self, features, ids, anchor: int, embed, head) -> torch.Tensor:
        """Cross-entropy of one block's teacher-forced drafts."""
        queries = min(BLOCK, ids.numel() - 1 - anchor)
        logits = self.logits(features, ids, anchor, queries, embed, head)
        logits = logits + self.markov_head.markov_w2(self.markov_head.markov_w1(ids[anchor : anchor + queries]))
        return nn.functional.cross_entropy(logits, ids[anchor + 1 : anchor + 1 + queries])


@torch.no_grad()
def target_features(target, ids: torch.Tensor, layers=FEATURES) -> torch.Tensor:
    """[T, n H]: the mean of the hyper-connection streams of the target's outputs of `layers`, as vLLM
    (deepseek_v4/nvidia/model.py:1006-1011) and llama.cpp (src/models/deepseek4.cpp:269, 1239-1241)."""
    states = target(ids[None], output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1][0].mean(dim=-2) for i in layers], dim=-1)


def fit(drafter: ReferenceDSV4DSpark, target, sequences, steps: int, lr: float, seed: int = 0) -> float:
    """A short Adam fit of the reference's own forward on random anchors of the target's greedy
    responses (the target's embedding and lm_head frozen, as vLLM shares them); the last loss."""
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    data = [(target_features(target, ids), ids, prompt) for ids, prompt in sequences]
    optimizer = torch.optim.Adam(drafter.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = 0.0
        for features, ids, prompt in data:
            anchor = int(torch.randint(max(1, prompt - 1), ids.numel() - 1, (1,), generator=gen))
            loss = loss + drafter.block_loss(features, ids, anchor, embed, head)
        (loss / len(data)).backward()
        optimizer.step()
    return float(loss.detach()) / len(data)


# transformers' names -> DeepSeek's (conversion_mapping.py "deepseek_v4", reversed)
TO_DEEPSEEK = [
    ("self_attn.q_a_proj.", "attn.wq_a."), ("self_attn.q_a_norm.", "attn.q_norm."), ("self_attn.q_b_proj.", "attn.wq_b."),
    ("self_attn.kv_proj.", "attn.wkv."), ("self_attn.kv_norm.", "attn.kv_norm."), ("self_attn.o_a_proj.", "attn.wo_a."),
    ("self_attn.o_b_proj.", "attn.wo_b."), ("self_attn.sinks", "attn.attn_sink"), ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "ffn_norm."), ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"), ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"),
    ("ffn_hc.scale", "hc_ffn_scale"), ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.weight", "ffn.gate.weight"), ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."), ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
]  # fmt: skip
HEAD_STACK = {"norm.weight": "norm.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
              "hc_head.hc_scale": "hc_head_scale"}  # fmt: skip


def deepseek_state(drafter: ReferenceDSV4DSpark) -> dict:
    """The reference's weights as DeepSeek's checkpoint names them: the context combiner in mtp.0, the
    head stack and heads in the last stage (dspark.py:572-600), each routed expert's w1/w2/w3."""
    last, out = len(drafter.layers) - 1, {}
    for name, tensor in drafter.state_dict().items():
        tensor = tensor.detach().contiguous()
        if name.startswith("layers."):
            _, stage, rest = name.split(".", 2)
            if rest.startswith("mlp.experts."):
                out |= _experts(stage, rest, tensor)
                continue
            new = next((rest.replace(a, b, 1) for a, b in TO_DEEPSEEK if rest.startswith(a)), None)
            assert new is not None, name
            out[f"mtp.{stage}.{new}"] = tensor
        elif name.startswith("main_"):
            out[f"mtp.0.{name}"] = tensor
        elif name in HEAD_STACK or name.startswith("markov_head."):
            out[f"mtp.{last}.{HEAD_STACK.get(name, name)}"] = tensor
    return out


def _experts(stage: str, rest: str, tensor: torch.Tensor) -> dict:
    if rest.endswith("gate_up_proj"):
        gate, up = tensor.chunk(2, dim=1)
        return {f"mtp.{stage}.ffn.experts.{e}.{w}.weight": t[e].contiguous() for w, t in (("w1", gate), ("w3", up))
                for e in range(t.shape[0])}  # fmt: skip
    return {f"mtp.{stage}.ffn.experts.{e}.w2.weight": tensor[e].contiguous() for e in range(tensor.shape[0])}


def save(drafter: ReferenceDSV4DSpark, raw: dict, out_dir) -> str:
    """The checkpoint in DeepSeek's layout: config.json and model.safetensors of `mtp.*` tensors."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(deepseek_state(drafter), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    return str(out)
