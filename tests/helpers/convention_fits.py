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
parallel; drafters learn loops from content), so each RECIPE (target, data, drafter shape)
makes its conventions matter:

- "periodic" (positions+1, layers-1, reference): `build_layered_target` zeroes the attention
  outputs, so the feature at p depends on x_p alone, and scales each layer's MLP output to 8x
  its input, so every layer applies its own random nonlinear map and adjacent layers are
  mutually unreadable (mean-centred cosine ~0.1); the data repeat a random prompt of PERIOD
  tokens, so the next token is readable only PERIOD positions back and a block position id off
  by one reads the wrong token.
- "markov" (causal-block): the same target; x_{p+1} = pi(x_p) for a fixed permutation; a
  2-layer drafter with block 8 and rope_theta 1, whose RoPE says little about position, so a
  drafter trained with a causal block leans on the mask for "where in the block am I".
- "order2" (context+1): `build_lookahead_target`, a hand-written target for x_{p+1} =
  T[x_{p-1}, x_p] whose layer-2 feature at t holds x_{t+1} and x_{t+2} as one-hot slots: a
  drafter that saw F[t] in training reads the answer there, and loses it without F[t].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from tests.helpers.models import IM_END_ID, save_target, seeded, text_kwargs

LENGTH = 32  # tokens per sequence: the prompt, then a teacher-forced response
MLP_GAIN = 8.0


@dataclass(frozen=True)
class Recipe:
    name: str
    prompt_len: int
    block: int
    layer_ids: tuple[int, ...]
    drafter_layers: int = 1
    rope_theta: float = 10000.0
    steps: int = 200


RECIPES = {
    "periodic": Recipe("periodic", prompt_len=5, block=4, layer_ids=(1, 3)),
    "markov": Recipe("markov", prompt_len=2, block=8, layer_ids=(1, 3), drafter_layers=2, rope_theta=1.0, steps=300),
    "order2": Recipe("order2", prompt_len=2, block=4, layer_ids=(2,), steps=300),
}
RECIPE_OF = {"reference": "periodic", "positions+1": "periodic", "layers-1": "periodic", "causal-block": "markov"}
RECIPE_OF["context+1"] = "order2"


# --------------------------------------------------------------------------- targets


def build_layered_target(save_dir, seed: int = 0) -> str:
    """A 6-layer tiny Qwen3 (tests' vocab 512, hidden 64) whose layers are mutually unreadable."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**text_kwargs(6), rope_theta=10000.0)
    H, inner = config.hidden_size, config.intermediate_size
    g = torch.Generator().manual_seed(seed)
    with seeded(seed):
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
    return save_target(model, save_dir)


def _scale_mlps(model, gain: float) -> None:
    """Each layer's down_proj scaled so its output norm is `gain` x its input's (over all tokens)."""
    h = model.model.embed_tokens(torch.arange(model.config.vocab_size)[None])
    for layer in model.model.layers:
        x = layer.post_attention_layernorm(h)  # the attention adds nothing (o_proj is zero)
        out = layer.mlp(x)
        layer.mlp.down_proj.weight.mul_(gain * h.norm(dim=-1).mean() / out.norm(dim=-1).mean())
        h = h + layer.mlp(x)


SLOT = 32  # build_lookahead_target: hidden 128 = four one-hot slots of 32
LOOK_VOCAB = SLOT  # ids 0..30 are tokens (data uses 3..30: 0-2 are special), 31 the mask
CONSTANT = SLOT - 1  # a dimension every embedding sets: the lookups' bias


def order2_table(seed: int = 777) -> torch.Tensor:
    """T[a, b] for a, b in 0..30: the next token after (a, b), a data token 3..30."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, SLOT - 1, (SLOT - 1, SLOT - 1), generator=g)


@torch.no_grad()
def build_lookahead_target(save_dir, table: torch.Tensor) -> str:
    """A hand-written 4-layer Qwen3 (vocab 32, hidden 128) computing x_{t+1} = T[x_{t-1}, x_t]:

        slot 0  one-hot x_t, plus the constant dimension (the embedding)
        slot 1  one-hot x_{t-1}        layer 0: a previous-token head (constant q/k biases
                                       whose RoPE score peaks at offset 1) copies slot 0
        slot 2  one-hot T[x_{t-1},x_t] layer 1: one MLP neuron per pair (a, b), firing when
                                       slot 1 = a and slot 0 = b
        slot 3  one-hot x_{t+2}        layer 2: the same lookup on (slot 0, slot 2)

    The lm_head reads slot 2, so the target's greedy text is the data; its layer-2 feature at t
    holds the next two tokens."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab, hidden, pairs = LOOK_VOCAB, 4 * SLOT, (SLOT - 1) ** 2
    config = Qwen3Config(**{**text_kwargs(4), "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": pairs})
    config.attention_bias = True
    model = Qwen3ForCausalLM(config).eval()
    for parameter in model.parameters():
        parameter.zero_()
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):
            parameter.fill_(1.0)
    scale = math.sqrt(hidden / 2)
    embed = torch.zeros(vocab, hidden)
    embed[torch.arange(vocab), torch.arange(vocab)] = scale
    embed[:, CONSTANT] = scale
    model.model.embed_tokens.weight.copy_(embed)
    _previous_token_head(model.model.layers[0].self_attn)
    sample = order2_sequences(table, 999, 64)
    _pair_lookup(model, 1, table, sample, first=SLOT, second=0, out=2 * SLOT)
    _pair_lookup(model, 2, table, sample, first=0, second=2 * SLOT, out=3 * SLOT)
    model.lm_head.weight[torch.arange(vocab - 1), 2 * SLOT + torch.arange(vocab - 1)] = 1.0
    return save_target(model, save_dir)


def _previous_token_head(attention) -> None:
    """Constant queries and keys whose RoPE score peaks at query - key = 1; values copy slot 0
    (two kv heads of 16 dims) and the output writes it into slot 1."""
    head_dim, half = attention.head_dim, attention.head_dim // 2
    frequencies = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    query, key = torch.zeros(head_dim), torch.zeros(head_dim)
    query[:half], query[half:] = torch.cos(frequencies), -torch.sin(frequencies)
    key[:half] = 1.0
    attention.q_proj.bias.copy_(query.repeat(attention.config.num_attention_heads))
    attention.k_proj.bias.copy_(key.repeat(attention.config.num_key_value_heads))
    attention.q_norm.weight.fill_(8.0)  # sharpness
    attention.v_proj.weight[torch.arange(SLOT), torch.arange(SLOT)] = 1.0
    attention.o_proj.weight[SLOT + torch.arange(16), torch.arange(16)] = 1.0  # query head 0 (kv head 0)
    attention.o_proj.weight[SLOT + 16 + torch.arange(16), 32 + torch.arange(16)] = 1.0  # head 2 (kv head 1)


def _pair_lookup(model, index: int, table, sample, first: int, second: int, out: int) -> None:
    """Layer `index`'s MLP writes one-hot T[a, b] into slot `out` where slot `first` holds a and
    slot `second` holds b: a neuron per pair, its gate threshold set between the matching and
    the best non-matching pre-activation measured on `sample` (Qwen3's MLP has no bias, so the
    constant dimension carries the threshold)."""
    mlp = model.model.layers[index].mlp
    a, b = torch.arange(SLOT - 1).repeat_interleave(SLOT - 1), torch.arange(SLOT - 1).repeat(SLOT - 1)
    h = model(sample, output_hidden_states=True).hidden_states[index]
    x = model.model.layers[index].post_attention_layernorm(h)  # [n, LENGTH, hidden]; attention adds 0
    gate = torch.zeros(a.numel(), x.shape[-1])
    gate[torch.arange(a.numel()), first + a] = 1.0
    before = torch.cat([sample[:, :1], sample[:, :-1]], 1)  # x_{t-1}
    after = torch.cat([sample[:, 1:], sample[:, -1:]], 1)  # x_{t+1}
    want_a, want_b = (before, sample) if first == SLOT else (sample, after)
    inner = slice(1, -1)  # positions where both slots are defined
    ratio = (
        x.gather(-1, (first + want_a)[..., None])[:, inner].mean()
        / x.gather(-1, (second + want_b)[..., None])[:, inner].mean()
    )
    gate[torch.arange(a.numel()), second + b] = ratio
    pre = x @ gate.T
    match = (a == want_a[..., None]) & (b == want_b[..., None])
    on, off = pre[:, inner][match[:, inner]].min(), pre[:, inner][~match[:, inner]].max()
    constant = x[..., CONSTANT].mean()
    gate[:, CONSTANT] = -(on + off) / 2 / constant
    mlp.gate_proj.weight.copy_(gate * 10.0 / (on - off))
    mlp.up_proj.weight[:, CONSTANT] = 1.0 / constant
    mlp.down_proj.weight[out + table[a, b], torch.arange(a.numel())] = h[..., CONSTANT].mean() / 10.0


# --------------------------------------------------------------------------- data


def periodic(seed: int, n: int, period: int = 5) -> torch.Tensor:
    """[n, LENGTH]: `period` random data tokens (ids 16..127), repeated."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(16, 128, (n, period), generator=g)
    return prompt.repeat(1, -(-LENGTH // period))[:, :LENGTH]


def markov(seed: int, n: int) -> torch.Tensor:
    """[n, LENGTH]: x_{p+1} = pi(x_p), pi a fixed permutation of the data tokens 16..127."""
    pi = 16 + torch.randperm(112, generator=torch.Generator().manual_seed(12345))
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, LENGTH, dtype=torch.long)
    x[:, 0] = torch.randint(16, 128, (n,), generator=g)
    for p in range(1, LENGTH):
        x[:, p] = pi[x[:, p - 1] - 16]
    return x


def order2_sequences(table: torch.Tensor, seed: int, n: int) -> torch.Tensor:
    """[n, LENGTH]: two random data tokens, then x_{p+1} = T[x_{p-1}, x_p]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, LENGTH, dtype=torch.long)
    x[:, :2] = torch.randint(3, SLOT - 1, (n, 2), generator=g)
    for p in range(2, LENGTH):
        x[:, p] = table[x[:, p - 2], x[:, p - 1]]
    return x


def sequences(recipe: Recipe, seed: int, n: int, table=None) -> torch.Tensor:
    if recipe.name == "periodic":
        return periodic(seed, n, recipe.prompt_len)
    return markov(seed, n) if recipe.name == "markov" else order2_sequences(table, seed, n)


def prompt_records(tokens: torch.Tensor, prompt_len: int) -> list[dict]:
    """Prompts JSONL records: the first `prompt_len` tokens as input_ids, the rest as a given response."""
    return [
        {"id": f"p{i}", "input_ids": row[:prompt_len].tolist(), "response": row[prompt_len:].tolist(), "dataset": "d"}
        for i, row in enumerate(tokens)
    ]


@torch.no_grad()
def target_and_states(model_dir: str, tokens: torch.Tensor):
    """(the target, its transformers hidden_states on `tokens`: embedding output first, each [n, LENGTH, H])."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return target, list(target(tokens, output_hidden_states=True).hidden_states)


def stop_free(tokens: torch.Tensor) -> bool:
    return not bool((tokens == IM_END_ID).any())


# --------------------------------------------------------------------------- drafter inputs


def drafter_inputs(recipe: Recipe, convention: str, states, tokens, rows, anchors, embed, mask_id: int):
    """The reference drafter's inputs for anchors (rows[i], anchors[i]) under `convention`,
    batched: context slots 0..LENGTH-1 padded and hidden by an explicit boolean mask."""
    B, b = anchors.numel(), recipe.block
    offset = 0 if convention == "layers-1" else 1  # hidden_states[i] instead of [i + 1]
    features = torch.cat([states[i + offset] for i in recipe.layer_ids], dim=-1)[rows]  # [B, LENGTH, n*H]
    slots = torch.arange(LENGTH)
    visible = slots[None, :] < (anchors + (convention == "context+1"))[:, None]  # [B, LENGTH]
    first = anchors + (convention == "positions+1")
    positions = torch.cat([slots[None].expand(B, LENGTH), first[:, None] + torch.arange(b)[None]], dim=1)
    inside = torch.ones(b, b, dtype=torch.bool)
    if convention == "causal-block":
        inside = inside.tril()
    mask = torch.cat([visible[:, None, :].expand(B, b, LENGTH), inside.expand(B, b, b)], dim=2)
    block = torch.full((B, b), mask_id)
    block[:, 0] = tokens[rows, anchors]
    wanted = anchors[:, None] + torch.arange(1, b)[None]  # [B, b - 1]
    labels = torch.where(wanted < LENGTH, tokens[rows[:, None], wanted.clamp(max=LENGTH - 1)], -100)
    inputs = {
        "position_ids": positions,
        "attention_mask": mask[:, None],  # [B, 1, b, LENGTH + b]
        "noise_embedding": F.embedding(block, embed),
        "target_hidden": features * visible[..., None],
    }
    return inputs, labels


def all_anchors(recipe: Recipe, n: int):
    rows, anchors = torch.meshgrid(torch.arange(n), torch.arange(recipe.prompt_len, LENGTH - 1), indexing="ij")
    return rows.reshape(-1), anchors.reshape(-1)


# --------------------------------------------------------------------------- fit and evaluate


def new_reference_drafter(recipe: Recipe, target, seed: int):
    """The public DFlashDraftModel for `target`, in the layout `specreplay fit` writes."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    from tests.helpers.drafters import drafter_config

    vocab = target.config.vocab_size
    raw = drafter_config(
        {"hidden_size": target.config.hidden_size, "num_layers": target.config.num_hidden_layers, "vocab_size": vocab},
        layers=recipe.drafter_layers,
        block_size=recipe.block,
        layer_ids=recipe.layer_ids,
        num_heads=4,
        intermediate_size=128,
        mask_token_id=vocab - 1,
        rope_theta=recipe.rope_theta,
    )
    config = Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    config.architectures = raw["architectures"]
    with seeded(seed):
        return DFlashDraftModel(config)


def fit(recipe: Recipe, convention: str, states, tokens, target, seed: int = 0, batch: int = 128):
    """A reference drafter trained under `convention` (AdamW, one-cycle lr 5e-3, 128 anchors a
    step, cross-entropy at block positions 1..b-1). The target's embedding and lm_head are
    frozen: they are the target's."""
    vocab = target.config.vocab_size
    drafter = new_reference_drafter(recipe, target, seed)
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    rows, anchors = all_anchors(recipe, tokens.shape[0])
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=5e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=5e-3, total_steps=recipe.steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed + 1000)
    drafter.train()
    for _ in range(recipe.steps):
        pick = torch.randint(0, anchors.numel(), (batch,), generator=g)
        inputs, labels = drafter_inputs(recipe, convention, states, tokens, rows[pick], anchors[pick], embed, vocab - 1)
        logits = F.linear(drafter(**inputs)[:, 1:], lm_head)
        loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    return drafter.eval()


@torch.no_grad()
def streak(recipe: Recipe, drafter, convention: str, states, tokens, target) -> float:
    """Mean chain accepted length over every anchor with a full block, inputs as `convention`."""
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
    rows, anchors = all_anchors(recipe, tokens.shape[0])
    full = anchors <= LENGTH - recipe.block
    rows, anchors = rows[full], anchors[full]
    mask_id = target.config.vocab_size - 1
    inputs, labels = drafter_inputs(recipe, convention, states, tokens, rows, anchors, embed, mask_id)
    draft = F.linear(drafter(**inputs)[:, 1:], lm_head).argmax(-1)
    return float(((draft == labels).long().cumprod(1).sum(1)).float().mean())
