"""Drafters fitted under a WRONG convention with the public reference model, for `diagnose` tests.

Everything a drafter is trained on is built here, from transformers' hidden states and the
public `dflash.model.DFlashDraftModel`, never from specreplay's own convention switches (a bug
mirrored in both would pass). A convention is one of:

    reference      block [x_t, mask, ...] at positions t.., context features 0..t-1 of hidden_states[i + 1]
    positions+1    block position ids start at t + 1
    layers-1       features from hidden_states[i] (layer id i - 1)
    context+1      context features 0..t (the anchor's own feature too)
    causal-block   the block attends causally inside itself

On a plain random target none of these matters much (adjacent layers' features are nearly
parallel; drafters learn loops from content), so the target and data make each one matter:

- `build_layered_target`: attention outputs zeroed, so the feature at p depends on x_p alone,
  and each layer's MLP output scaled to 8x its input, so every layer applies its own random
  nonlinear map and adjacent layers are mutually unreadable (mean-centred cosine ~0.1).
- `periodic`: a random prompt of PERIOD tokens repeated, so the next token is readable only
  from the context PERIOD positions back: a block position id off by one reads the wrong token.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from conftest import IM_END_ID, TINY_HIDDEN, _finish, _seeded, _text_kwargs

CONVENTIONS = ("reference", "positions+1", "layers-1", "context+1", "causal-block")
PERIOD, LENGTH = 5, 32  # prompt = one period; responses teacher-forced up to LENGTH tokens
FIRST_TOKEN, DATA_TOKENS = 16, 112  # data ids 16..127: no special token, no mask id
LAYER_IDS = (1, 3)
BLOCK = 4
MLP_GAIN = 8.0


# --------------------------------------------------------------------------- target and data


def build_layered_target(save_dir, seed: int = 0) -> str:
    """A 6-layer tiny Qwen3 (tests' vocab 512, hidden 64) whose layers are mutually unreadable."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**_text_kwargs(6), rope_theta=10000.0)
    H, inner = config.hidden_size, config.intermediate_size
    g = torch.Generator().manual_seed(seed)
    with _seeded(seed):
        model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.randn(config.vocab_size, H, generator=g))
        model.lm_head.weight.copy_(torch.randn(config.vocab_size, H, generator=g) / math.sqrt(H))
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.copy_(torch.randn(inner, H, generator=g) * 2 / math.sqrt(H))
            layer.mlp.up_proj.weight.copy_(torch.randn(inner, H, generator=g) * 2 / math.sqrt(H))
            layer.mlp.down_proj.weight.copy_(torch.randn(H, inner, generator=g) / math.sqrt(inner))
            layer.self_attn.o_proj.weight.zero_()  # the feature at p depends on x_p alone
        _scale_mlps(model, MLP_GAIN)
    return _finish(model, save_dir)


def _scale_mlps(model, gain: float) -> None:
    """Each layer's down_proj scaled so its output norm is `gain` x its input's (over all tokens)."""
    h = model.model.embed_tokens(torch.arange(model.config.vocab_size)[None])
    for layer in model.model.layers:
        x = layer.post_attention_layernorm(h)  # the attention adds nothing (o_proj is zero)
        out = layer.mlp(x)
        layer.mlp.down_proj.weight.mul_(gain * h.norm(dim=-1).mean() / out.norm(dim=-1).mean())
        h = h + layer.mlp(x)


def periodic(seed: int, n: int) -> torch.Tensor:
    """[n, LENGTH] sequences: PERIOD random data tokens, repeated."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(FIRST_TOKEN, FIRST_TOKEN + DATA_TOKENS, (n, PERIOD), generator=g)
    return prompt.repeat(1, -(-LENGTH // PERIOD))[:, :LENGTH]


def prompt_records(tokens: torch.Tensor) -> list[dict]:
    """Prompts JSONL records: the first period as input_ids, the rest as a given response."""
    return [
        {"id": f"p{i}", "input_ids": row[:PERIOD].tolist(), "response": row[PERIOD:].tolist(), "dataset": "periodic"}
        for i, row in enumerate(tokens)
    ]


@torch.no_grad()
def target_and_states(model_dir: str, tokens: torch.Tensor):
    """(the target, its transformers hidden_states on `tokens`: embedding output first, each [n, LENGTH, H])."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return target, list(target(tokens, output_hidden_states=True).hidden_states)


# --------------------------------------------------------------------------- drafter inputs


def drafter_inputs(convention: str, states, tokens, rows, anchors, embed, mask_id: int):
    """The reference drafter's inputs for anchors (rows[i], anchors[i]) under `convention`,
    batched: context slots 0..LENGTH-1 padded and hidden by an explicit boolean mask."""
    B = anchors.numel()
    offset = 0 if convention == "layers-1" else 1  # hidden_states[i] instead of [i + 1]
    features = torch.cat([states[i + offset] for i in LAYER_IDS], dim=-1)[rows]  # [B, LENGTH, n*H]
    slots = torch.arange(LENGTH)
    visible = slots[None, :] < (anchors + (convention == "context+1"))[:, None]  # [B, LENGTH]
    first = anchors + (convention == "positions+1")
    positions = torch.cat([slots[None].expand(B, LENGTH), first[:, None] + torch.arange(BLOCK)[None]], dim=1)
    inside = torch.ones(BLOCK, BLOCK, dtype=torch.bool)
    if convention == "causal-block":
        inside = inside.tril()
    mask = torch.cat([visible[:, None, :].expand(B, BLOCK, LENGTH), inside.expand(B, BLOCK, BLOCK)], dim=2)
    block = torch.full((B, BLOCK), mask_id)
    block[:, 0] = tokens[rows, anchors]
    wanted = anchors[:, None] + torch.arange(1, BLOCK)[None]  # [B, BLOCK - 1]
    labels = torch.where(wanted < LENGTH, tokens[rows[:, None], wanted.clamp(max=LENGTH - 1)], -100)
    inputs = {
        "position_ids": positions,
        "attention_mask": mask[:, None],  # [B, 1, BLOCK, LENGTH + BLOCK]
        "noise_embedding": F.embedding(block, embed),
        "target_hidden": features * visible[..., None],
    }
    return inputs, labels


def all_anchors(n: int):
    rows, anchors = torch.meshgrid(torch.arange(n), torch.arange(PERIOD, LENGTH - 1), indexing="ij")
    return rows.reshape(-1), anchors.reshape(-1)


# --------------------------------------------------------------------------- fit and evaluate


def new_reference_drafter(seed: int, vocab: int):
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    from conftest import drafter_config

    raw = drafter_config(
        {"hidden_size": TINY_HIDDEN, "num_layers": 6, "vocab_size": vocab},
        layers=1,
        block_size=BLOCK,
        layer_ids=LAYER_IDS,
        num_heads=4,
        intermediate_size=128,
        mask_token_id=vocab - 1,
    )
    config = Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    config.architectures = raw["architectures"]
    with _seeded(seed):
        return DFlashDraftModel(config)


def fit(convention: str, states, tokens, target, seed: int = 0, steps: int = 200, batch: int = 128):
    """A reference drafter trained under `convention` (AdamW, one-cycle lr 5e-3, 128 anchors a
    step, cross-entropy at block positions 1..BLOCK-1). The target's embedding and lm_head are
    frozen: they are the target's."""
    vocab = target.config.vocab_size
    drafter = new_reference_drafter(seed, vocab)
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    rows, anchors = all_anchors(tokens.shape[0])
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=5e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=5e-3, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed + 1000)
    drafter.train()
    for _ in range(steps):
        pick = torch.randint(0, anchors.numel(), (batch,), generator=g)
        inputs, labels = drafter_inputs(convention, states, tokens, rows[pick], anchors[pick], embed, vocab - 1)
        logits = F.linear(drafter(**inputs)[:, 1:], lm_head)
        loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    return drafter.eval()


@torch.no_grad()
def streak(drafter, convention: str, states, tokens, target) -> float:
    """Mean chain accepted length over every anchor with a full block, inputs as `convention`."""
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
    rows, anchors = all_anchors(tokens.shape[0])
    full = anchors <= LENGTH - BLOCK
    rows, anchors = rows[full], anchors[full]
    inputs, labels = drafter_inputs(convention, states, tokens, rows, anchors, embed, target.config.vocab_size - 1)
    draft = F.linear(drafter(**inputs)[:, 1:], lm_head).argmax(-1)
    return float(((draft == labels).long().cumprod(1).sum(1)).float().mean())


def stop_free(tokens: torch.Tensor) -> bool:
    return not bool((tokens == IM_END_ID).any())
