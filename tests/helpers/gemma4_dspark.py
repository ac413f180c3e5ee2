"""DeepSpec's Gemma 4 DSpark drafter (`Gemma4DSparkModel`) for the engine test
(tests/parity/test_engine_parity_dspark_gemma4.py): a tiny random Gemma 4 target llama.cpp serves,
and an independent reference drafter written rule by rule from vLLM's
model_executor/models/gemma4_dspark.py on transformers' own Gemma 4 modules (Gemma4TextDecoderLayer's
projections, norms and MLP, Gemma4TextRotaryEmbedding, apply_rotary_pos_emb), fitted through its own
forward (no public class trains this drafter) and saved in DeepSpec's layout.

What serving this pair needs (docs/drafter-families.md#dspark): a byte-fallback BPE tokenizer.json
with merges (llama.cpp's Gemma 4 vocabulary, conversion/gemma.py:641-662, src/llama-vocab.cpp:2110-2117);
config.json files without `model_type` for the converter (transformers 5.25's Gemma4TextConfig.to_dict
drops `global_head_dim`, which the converter reads: conversion/gemma.py:745-755, 855); feature layers
short of the target's last (src/models/gemma4.cpp:196).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import Gemma4ForCausalLM, Gemma4TextConfig, PreTrainedTokenizerFast
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4RMSNorm,
    Gemma4TextDecoderLayer,
    Gemma4TextRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tests.helpers import llama_engine as engine
from tests.helpers.models import seeded

VOCAB = 1024
MASK = 16  # an unused special token (engine.SPECIAL: ids below 17 are never emitted)
TARGET_LAYERS = 3
FEATURES = [0, 1]  # output of layers 0 and 1: short of the last (2)
BLOCK = 4
RANK = 16
SCALARS = (0.6, 1.4)  # each drafter layer's layer_scalar: not 1, so reading them is checked
ROPE = {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 10000.0}
DECODER = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, global_head_dim=16, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=False, max_position_embeddings=2048,
)  # fmt: skip


def target_model() -> Gemma4ForCausalLM:
    """A tiny random Gemma 4 (sliding and full layers, proportional RoPE on the full ones)."""
    config = Gemma4TextConfig(
        **DECODER,
        num_hidden_layers=TARGET_LAYERS,
        num_global_key_value_heads=2,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        sliding_window=64,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB,
        initializer_range=0.5,
        eos_token_id=engine.STOP,
        bos_token_id=1,
        pad_token_id=0,
    )
    with seeded(0):
        return Gemma4ForCausalLM(config).eval()


def drafter_config(layers: int = 2) -> dict:
    """The drafter's config.json in DeepSpec's Gemma 4 layout (no model_type: see the module docstring)."""
    return dict(
        architectures=["Gemma4DSparkModel"],
        **DECODER,
        num_hidden_layers=layers,
        num_global_key_value_heads=1,
        layer_types=["full_attention"] * layers,
        attention_k_eq_v=True,
        rope_parameters={"full_attention": ROPE},
        hidden_size_per_layer_input=0,
        num_target_layers=TARGET_LAYERS,
        block_size=BLOCK,
        mask_token_id=MASK,
        target_layer_ids=FEATURES,
        num_anchors=512,
        markov_rank=RANK,
        markov_head_type="vanilla",
        enable_confidence_head=False,
        confidence_head_with_markov=False,
    )


def save_tokenizer(model_dir) -> None:
    """A byte-fallback BPE tokenizer with merges over VOCAB ids (specials, 256 byte tokens, letters
    and their pairs), as llama.cpp's Gemma 4 vocabulary export needs."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"<unused{i}>" for i in range(engine.SPECIAL - 4)]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab |= {f"<0x{b:02X}>": engine.SPECIAL + b for b in range(256)}
    letters = "abcdefghijklmnopqrstuvwxyz"
    for token in [*letters, "▁"]:  # 27 symbols: 729 pairs fill the vocabulary
        vocab[token] = len(vocab)
    symbols = [*letters, "▁"]
    pairs = [(a, b) for a in symbols for b in symbols][: VOCAB - len(vocab)]
    vocab |= {a + b: len(vocab) + i for i, (a, b) in enumerate(pairs)}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=pairs, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    special = dict(bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>")
    PreTrainedTokenizerFast(tokenizer_object=bpe, **special).save_pretrained(str(model_dir))
    (Path(model_dir) / "chat_template.jinja").unlink(missing_ok=True)  # SmolLM2's, left by engine_target


def for_converter(model_dir, out_dir, **fields) -> str:
    """A directory of `model_dir`'s files whose config.json has no model_type (and `fields` added),
    so llama.cpp's converter reads the file itself rather than AutoConfig's to_dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in Path(model_dir).iterdir():
        if path.name != "config.json" and not (out / path.name).exists():
            (out / path.name).symlink_to(path.resolve())
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("model_type", "per_layer_config")} | fields
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    return str(out)


# -- the reference drafter: vLLM's gemma4_dspark.py, rule by rule -----------------------------------


class ReferenceGemma4DSpark(nn.Module):
    """vLLM's Gemma4DSparkForCausalLM at one anchor's block, on transformers' Gemma 4 modules; its
    state dict is DeepSpec's checkpoint layout (the names vLLM's load_weights and llama.cpp read)."""

    def __init__(self, raw: dict):
        super().__init__()
        fields = {k: v for k, v in raw.items() if k in DECODER or k in ("num_hidden_layers", "layer_types")}
        hf = Gemma4TextConfig(
            **fields,
            num_global_key_value_heads=raw["num_global_key_value_heads"],
            attention_k_eq_v=True,
            rope_parameters=raw["rope_parameters"],
            hidden_size_per_layer_input=0,
        )
        hf._attn_implementation = "eager"
        self.hf, size, eps = hf, hf.hidden_size, hf.rms_norm_eps
        self.embed_tokens = nn.Embedding(hf.vocab_size, size)  # gemma4_dspark.py:161-165
        self.fc = nn.Linear(size * len(raw["target_layer_ids"]), size, bias=False)  # :171-178
        self.hidden_norm = Gemma4RMSNorm(size, eps=eps)  # :179
        self.layers = nn.ModuleList(Gemma4TextDecoderLayer(hf, i) for i in range(hf.num_hidden_layers))
        self.norm = Gemma4RMSNorm(size, eps=eps)  # :188
        self.lm_head = nn.Linear(size, hf.vocab_size, bias=False)  # :301-305
        self.markov_head = nn.Module()  # qwen3_dspark.py DSparkMarkovHead: w1 [V, r], w2 [r -> V]
        self.markov_head.markov_w1 = nn.Embedding(hf.vocab_size, raw["markov_rank"])
        self.markov_head.markov_w2 = nn.Linear(raw["markov_rank"], hf.vocab_size, bias=False)
        self.rotary = Gemma4TextRotaryEmbedding(hf)

    def context_kv(self, layer, context: torch.Tensor, positions: torch.Tensor):
        """_project_context_kv (gemma4_dspark.py:242-265) and the inherited k_norm + RoPE: K from
        k_proj(hidden_norm(c)), normed and roped; V the same projection, normed without a weight."""
        attn = layer.self_attn
        k = attn.k_proj(self.hidden_norm(context)).unflatten(-1, (-1, attn.head_dim))  # [T, kv, d]
        cos, sin = self.rotary(k, positions[None], "full_attention")
        keys = apply_rotary_pos_emb(attn.k_norm(k)[None], cos, sin, unsqueeze_dim=2)[0]
        return keys, attn.v_norm(k)

    def attention(self, layer, h: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """Gemma4DSparkAttention.forward (gemma4_dspark.py:106-117): q_norm'd queries, K/V as the
        context's (_kv_proj), RoPE on both, scale 1 (gemma4_mtp.py:181), every key visible."""
        attn = layer.self_attn
        q = attn.q_norm(attn.q_proj(h).unflatten(-1, (-1, attn.head_dim)))
        k = attn.k_proj(h).unflatten(-1, (-1, attn.head_dim))
        v = attn.v_norm(k)
        cos, sin = self.rotary(h, positions[None], "full_attention")
        q = apply_rotary_pos_emb(q[None], cos, sin, unsqueeze_dim=2)[0]
        k = apply_rotary_pos_emb(attn.k_norm(k)[None], cos, sin, unsqueeze_dim=2)[0]
        keys, values = torch.cat([ctx[0], k]), torch.cat([ctx[1], v])  # [T + b, kv, d]
        groups = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        weights = torch.einsum("qhd,khd->hqk", q, keys).softmax(-1)
        return attn.o_proj(torch.einsum("hqk,khd->qhd", weights, values).flatten(-2))

    def block_hidden(self, features: torch.Tensor, ids: torch.Tensor, anchor: int, queries: int) -> torch.Tensor:
        """[queries, H] after `norm` for the block [x_t, mask, ...] at positions t.. over the context
        before t (Gemma4DSparkModel.forward :281-292, Gemma4MTPDecoderLayer.forward :306-331)."""
        context = self.fc(features[:anchor])  # combine_hidden_states (qwen3_dflash.py:829-845)
        block = torch.full((queries,), MASK, dtype=torch.long)
        block[0] = ids[anchor]
        h = self.embed_tokens(block) * self.hf.hidden_size**0.5  # embed_input_ids :209-210
        positions = torch.arange(anchor, anchor + queries)
        for layer in self.layers:
            ctx = self.context_kv(layer, context, torch.arange(anchor))
            residual = h
            h = layer.post_attention_layernorm(self.attention(layer, layer.input_layernorm(h), positions, ctx))
            h = h + residual
            residual = h
            h = layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h))) + residual
            h = h * layer.layer_scalar
        return self.norm(h)

    def chain(self, features: torch.Tensor, ids: torch.Tensor, anchor: int, count: int) -> list[int]:
        """vLLM's greedy DSpark proposal: slot k drafts argmax(lm_head(h_k) + W2 W1[prev_k]), prev_0
        the anchor token, prev_k the draft before (qwen3_dspark.py's Markov chain)."""
        hidden = self.block_hidden(features, ids, anchor, count)
        base, previous, drafts = self.lm_head(hidden), int(ids[anchor]), []
        for k in range(count):
            bias = self.markov_head.markov_w2(self.markov_head.markov_w1(torch.tensor(previous)))
            previous = int((base[k] + bias).argmax())
            drafts.append(previous)
        return drafts

    def block_loss(self, features: torch.Tensor, ids: torch.Tensor, anchor: int) -> torch.Tensor:
        """Cross-entropy of one block's teacher-forced drafts (DeepSpec's training target)."""
        queries = min(BLOCK, ids.numel() - 1 - anchor)
        hidden = self.block_hidden(features, ids, anchor, queries)
        previous = ids[anchor : anchor + queries]
        logits = self.lm_head(hidden) + self.markov_head.markov_w2(self.markov_head.markov_w1(previous))
        return nn.functional.cross_entropy(logits, ids[anchor + 1 : anchor + 1 + queries])


@torch.no_grad()
def target_features(target, ids: torch.Tensor) -> torch.Tensor:
    """[T, n H]: the target's outputs of the FEATURES layers (hidden_states[i + 1])."""
    states = target(ids[None], output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1][0] for i in FEATURES], dim=-1)


def fit(drafter: ReferenceGemma4DSpark, target, sequences, steps: int, lr: float, seed: int = 0) -> float:
    """A short Adam fit of the reference's own forward on random anchors of the target's greedy
    continuations (the embedding and lm_head start as the target's); the last loss."""
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        drafter.lm_head.weight.copy_(target.lm_head.weight)
        for layer, scalar in zip(drafter.layers, SCALARS):
            layer.layer_scalar.fill_(scalar)
    data = [(target_features(target, ids), ids) for ids, _ in sequences]
    optimizer = torch.optim.Adam([p for n, p in drafter.named_parameters() if "embed_tokens" not in n], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = 0.0
        for features, ids in data:
            anchor = int(torch.randint(1, ids.numel() - 1, (1,), generator=gen))
            loss = loss + drafter.block_loss(features, ids, anchor)
        (loss / len(data)).backward()
        optimizer.step()
    return float(loss.detach()) / len(data)


def save(drafter: ReferenceGemma4DSpark, raw: dict, out_dir) -> str:
    """The checkpoint in DeepSpec's Gemma 4 layout: config.json and model.safetensors."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in drafter.state_dict().items() if not k.startswith("rotary.")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    return str(out)
