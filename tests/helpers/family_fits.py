"""speculators DFlash and DFlash2 drafters fitted to a tiny target with the references' own code,
for the end-to-end family parity tests (tests/parity/test_dflash_families_parity.py).

Everything here is the public references' code or plain transformers, never specreplay's: the
drafter is speculators' own `DFlashDraftModel` / `DFlash2DraftModel` (eager attention, so it runs
on CPU), its target-owned weights copied from the target's files as its `load_verifier_weights`
copies them, a reduced vocabulary built by its own `build_vocab_mappings_from_distribution`,
fitted by its own training forward on the target's real hidden states (transformers'), saved by
its own save_pretrained. `zlab_layout` writes the same tensors beside a z-lab config (the layout
`dflash.model` reads).

Two targets: `random_target` (greedy tests: features of adjacent layers unlike each other) and
`markov_target` (sampled tests: a drafter fitted for seconds is about as uncertain as the target).

Fits are cached for the session by their arguments (`fitted`): several tests share one.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass

import torch

from tests.helpers.masks import broadcast_masks
from tests.helpers.models import TINY_TOKENIZER_VOCAB, build_tiny_qwen3, seeded

# The drafters' decoder: one layer of the tiny target's width (tests/helpers/models.py text_kwargs)
DECODER = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=10000.0)
VOCABULARY = ("lm_head.weight", "d2t", "t2d")  # a reduced draft vocabulary's tensors (speculators only)
DFLASH2_FIELDS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}


@dataclass(frozen=True)
class Recipe:
    """One drafter: its family ("dflash" or "dflash2"), before-layer feature ids (speculators'
    `aux_hidden_state_layer_ids`), block size, draft vocabulary (None: the target's) and fit."""

    family: str = "dflash"
    aux_ids: tuple[int, ...] = (2, 4)
    block_size: int = 4
    draft_vocab_size: int | None = None
    layers: int = 1  # the drafter's decoder layers
    steps: int = 60
    anchors: int = 128  # anchors per step, drawn by the drafter's own select_anchors
    lr: float = 1e-2
    # DFlash2's selector learns at lr x this: its cross-entropy to the target's argmax has no
    # optimum short of certainty, so a fully trained selector makes every q one-hot
    selector_lr_scale: float = 1.0
    seed: int = 0


# --------------------------------------------------------------------------- targets


@torch.no_grad()
def random_target(save_dir, logit_scale: float = 3.0, mlp_gain: float = 4.0, seed: int = 0) -> str:
    """build_tiny_qwen3's random 6-layer target, its lm_head scaled so that most positions have
    one likely token, and each layer's MLP output scaled to `mlp_gain` x the norm of the
    residual entering the layer (measured on random tokens): every layer then rewrites its
    input, so the hidden states of adjacent layers are unlike each other (unscaled, the residual
    stream makes them nearly parallel and a drafter reads one about as well as the other)."""
    from transformers import Qwen3ForCausalLM

    model_dir = build_tiny_qwen3(save_dir, seed=seed)
    model = Qwen3ForCausalLM.from_pretrained(model_dir).eval()
    model.lm_head.weight.mul_(logit_scale)
    tokens = torch.randint(3, TINY_TOKENIZER_VOCAB, (16, 32), generator=torch.Generator().manual_seed(seed))
    for index, layer in enumerate(model.model.layers):
        entering, out = _layer_input_and_mlp_output(model, index, tokens)
        layer.mlp.down_proj.weight.mul_(mlp_gain * entering.norm(dim=-1).mean() / out.norm(dim=-1).mean())
    model.save_pretrained(model_dir)
    return model_dir


def _layer_input_and_mlp_output(model, index: int, tokens) -> tuple[torch.Tensor, torch.Tensor]:
    captured = []
    hook = model.model.layers[index].mlp.register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        entering = model(tokens, output_hidden_states=True).hidden_states[index]
    finally:
        hook.remove()
    return entering, captured[0]


@torch.no_grad()
def markov_target(save_dir, states: int = 16, successors=(1.0, 0.0, -0.5), seed: int = 3) -> str:
    """A 6-layer tiny Qwen3 whose next token depends on the current token alone: `states` live
    tokens, each followed by len(successors) of them with those logits (p 0.6 / 0.27 / 0.13 at
    T = 1), every other token at -12. Attention and MLP outputs are zero, so every hidden state
    is the token's embedding: live token s a one-hot in dimension 1 + s beside a constant
    dimension 0 (any other token is embedded as live token id % states, so a random prompt leads
    into the live tokens at once). Sampled responses wander over every transition, a short fit
    learns them all, and the fitted drafter is about as uncertain as the target: what a test of
    the drafter's q needs."""
    from transformers import Qwen3ForCausalLM

    model_dir = build_tiny_qwen3(save_dir, seed=seed)
    model = Qwen3ForCausalLM.from_pretrained(model_dir).eval()
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    live = 16 + torch.randperm(TINY_TOKENIZER_VOCAB - 16, generator=g)[:states]  # ordinary text tokens
    order = torch.randperm(states, generator=g)
    shifts = torch.randperm(states, generator=g)[: len(successors)]  # distinct: distinct successors
    state = torch.arange(vocab) % states
    state[live] = torch.arange(states)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    embed = torch.zeros(vocab, hidden)
    embed[torch.arange(vocab), 1 + state] = 1.0
    embed[:, 0] = 1.0
    model.model.embed_tokens.weight.copy_(embed)
    model.model.norm.weight.fill_(1.0)
    gain = (hidden / 2) ** 0.5  # the final norm's gain on an embedding of two ones
    head = torch.zeros(vocab, hidden)
    head[:, 0] = -12.0 / gain
    for shift, logit in zip(shifts, successors):
        following = live[order[(torch.arange(states) + shift) % states]]
        head[following, 1 + torch.arange(states)] = (12.0 + logit) / gain
    model.lm_head.weight.copy_(head)
    model.save_pretrained(model_dir)
    return model_dir


# --------------------------------------------------------------------------- the target's states


@torch.no_grad()
def target_states(target, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(transformers' hidden_states of `ids` [T]: embedding output first, each [T, H]; the last
    decoder layer's output before the final norm [T, H], what vLLM captures as layer id L and
    speculators trains on as `verifier_last_hidden_states`)."""
    captured = {}
    hook = target.model.norm.register_forward_pre_hook(lambda module, args: captured.setdefault("x", args[0]))
    try:
        out = target(ids[None], output_hidden_states=True)
    finally:
        hook.remove()
    return [h[0] for h in out.hidden_states], captured["x"][0]


def training_batch(target, sequences: list[tuple[torch.Tensor, int]], aux_ids) -> dict:
    """speculators' packed training batch of `sequences` (token ids, prompt length): aux features
    concatenated in `aux_ids` order (before layer i = hidden_states[i]), the pre-norm last layer,
    loss on the response positions (the anchors a served drafter sees), one document each."""
    fields = {k: [] for k in ("hidden_states", "verifier_last_hidden_states", "input_ids", "loss_mask")}
    fields.update(document_ids=[], position_ids=[])
    for doc, (ids, prompt_len) in enumerate(sequences):
        states, last = target_states(target, ids)
        fields["hidden_states"].append(torch.cat([states[i] for i in aux_ids], dim=-1))
        fields["verifier_last_hidden_states"].append(last)
        fields["input_ids"].append(ids)
        fields["loss_mask"].append((torch.arange(ids.numel()) >= prompt_len).long())
        fields["document_ids"].append(torch.full((ids.numel(),), doc, dtype=torch.long))
        fields["position_ids"].append(torch.arange(ids.numel()))
    return {k: torch.cat(v)[None] for k, v in fields.items()}


def frequent_tokens(sequences: list[tuple[torch.Tensor, int]], size: int, vocab: int) -> tuple:
    """(t2d, d2t) of the `size` most frequent response tokens, as speculators' data prep builds
    them (token frequencies over loss-masked tokens, then build_vocab_mappings_from_distribution)."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    counts = Counter()
    for ids, prompt_len in sequences:
        counts.update(ids[prompt_len:].tolist())
    d2t, t2d = build_vocab_mappings_from_distribution(dict(counts), size, vocab)
    return t2d, d2t


# --------------------------------------------------------------------------- build, fit, save


def new_drafter(recipe: Recipe, target_dir: str, sequences):
    """speculators' drafter of `recipe` for the target at `target_dir` (its config's shapes),
    target-owned weights loaded from there by its own load_verifier_weights."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dflash2.config import DFlash2SpeculatorConfig
    from speculators.models.dflash2.core import DFlash2DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig, Qwen3Config

    target = AutoConfig.from_pretrained(target_dir)
    decoder = Qwen3Config(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, num_hidden_layers=recipe.layers, **DECODER
    )
    decoder._attn_implementation = "eager"  # flex attention needs a compiler; eager runs anywhere
    settings = SpeculatorsConfig(
        algorithm=recipe.family,
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=recipe.block_size - 1)],
        default_proposal_method="greedy",
        verifier=VerifierConfig.from_pretrained(target_dir),
    )
    config_class, model_class, extra = (
        (DFlashSpeculatorConfig, DFlashDraftModel, {})
        if recipe.family == "dflash"
        else (DFlash2SpeculatorConfig, DFlash2DraftModel, DFLASH2_FIELDS)
    )
    config = config_class(
        transformer_layer_config=decoder,
        draft_vocab_size=recipe.draft_vocab_size or target.vocab_size,
        block_size=recipe.block_size,
        aux_hidden_state_layer_ids=list(recipe.aux_ids),
        mask_token_id=target.vocab_size - 1,
        speculators_config=settings,
        **extra,
    )
    with seeded(recipe.seed):
        model = model_class(config)
    if recipe.draft_vocab_size:
        model.load_vocab_mappings(*frequent_tokens(sequences, recipe.draft_vocab_size, target.vocab_size))
    load_target_weights(model, target_dir)
    return model


@torch.no_grad()
def load_target_weights(model, target_dir: str) -> None:
    """What speculators' `_load_verifier_weights` copies from the verifier (it imports loguru,
    which the test environment lacks): embed_tokens, the final norm, and lm_head (its rows t2d
    for a reduced vocabulary) as the drafter's lm_head and verifier_lm_head; frozen as it freezes them."""
    from safetensors.torch import load_file

    weights = load_file(os.path.join(target_dir, "model.safetensors"))
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])  # a tied target saves no lm_head
    if model.use_draft_vocab:
        head = head[model.t2d.bool()]
    model.embed_tokens.weight.copy_(weights["model.embed_tokens.weight"])
    model.lm_head.weight.copy_(head)
    model.verifier_lm_head.weight.copy_(head)
    model.verifier_norm.weight.copy_(weights["model.norm.weight"])
    for module in (model.embed_tokens, model.lm_head, model.verifier_lm_head, model.verifier_norm):
        module.weight.requires_grad_(False)


def fit(model, batch: dict, recipe: Recipe):
    """`recipe.steps` AdamW steps of the drafter's own training forward (KL to the target at
    `recipe.anchors` random anchors a step), the target-owned weights frozen as it freezes them."""
    kwargs = type(model).get_trainer_kwargs(
        loss_fn="kl_div",
        loss_implementation="eager",
        max_anchors=recipe.anchors,
    )[0]
    parameters = [p for p in model.parameters() if p.requires_grad]
    selector = [p for name, p in model.named_parameters() if p.requires_grad and name.startswith("candidate_selector.")]
    rest = [p for p in parameters if all(p is not q for q in selector)]
    groups = [{"params": rest, "lr": recipe.lr}]
    if selector:
        groups.append({"params": selector, "lr": recipe.lr * recipe.selector_lr_scale})
    optimizer = torch.optim.AdamW(groups, lr=recipe.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=[group["lr"] for group in groups], total_steps=recipe.steps, pct_start=0.1
    )
    model.train()
    # select_anchors draws a permutation even when it keeps every anchor
    with seeded(recipe.seed + 1), broadcast_masks():
        for _ in range(recipe.steps):
            _, loss, _ = model(**batch, **kwargs)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            schedule.step()
    return model.eval()


_FITTED: dict[tuple, str] = {}


def fitted(recipe: Recipe, target_dir: str, sequences, out_dir, start_from: str | None = None) -> str:
    """The directory of a speculators drafter of `recipe` fitted to `sequences` (token ids,
    prompt length) of the target at `target_dir`, saved with its own save_pretrained; its own
    weights first loaded from the checkpoint `start_from` when given (a warm start). Fitted once
    per session per arguments."""
    key = (recipe, target_dir, start_from, tuple((tuple(ids.tolist()), n) for ids, n in sequences))
    if key not in _FITTED or not os.path.isdir(_FITTED[key]):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        model = new_drafter(recipe, target_dir, sequences)
        if start_from is not None:
            state = load_file(os.path.join(start_from, "model.safetensors"))
            missing, unexpected = model.load_state_dict(state, strict=False)
            assert not unexpected, unexpected
        fit(model, training_batch(target, sequences, recipe.aux_ids), recipe)
        model.save_pretrained(str(out_dir))
        _FITTED[key] = str(out_dir)
    return _FITTED[key]


# --------------------------------------------------------------------------- the z-lab layout


def zlab_layout(speculators_dir: str, out_dir, num_target_layers: int, layer_ids: list[int] | None = None) -> str:
    """The speculators checkpoint's tensors, unchanged (names included: z-lab's DFlash2 loader maps
    the codebooks' published names itself), beside the z-lab config of the same drafter: its
    decoder at the top level, architecture as saved, `dflash_config` with block size, mask, and
    `target_layer_ids` = `layer_ids` (default: the aux ids - 1, z-lab counting the output of layer
    i) and DFlash2's selector fields. z-lab has no reduced vocabulary: its tensors (VOCABULARY)
    are left out, and a test that needs them reads them from the speculators file."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(speculators_dir, "config.json")) as f:
        spec = json.load(f)
    decoder = dict(spec["transformer_layer_config"])
    ids = [i - 1 for i in spec["aux_hidden_state_layer_ids"]] if layer_ids is None else list(layer_ids)
    dflash = {"block_size": spec["block_size"], "mask_token_id": spec["mask_token_id"], "target_layer_ids": ids}
    dflash.update({key: spec[key] for key in DFLASH2_FIELDS if key in spec})
    raw = {
        **decoder,
        "architectures": spec["architectures"],
        "num_target_layers": num_target_layers,  # z-lab's loader reads it whatever the ids
        "dflash_config": dflash,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    tensors = load_file(os.path.join(speculators_dir, "model.safetensors"))
    save_file(
        {name: t for name, t in tensors.items() if name not in VOCABULARY}, os.path.join(out_dir, "model.safetensors")
    )
    return str(out_dir)


def load_zlab(path: str):
    """`dflash.model`'s DFlashDraftModel or DFlash2DraftModel (by the config's architecture) from
    `path`, fp32, eval; asserts that every tensor of the file was loaded and none is missing."""
    import dflash.model as reference

    with open(os.path.join(path, "config.json")) as f:
        architecture = json.load(f)["architectures"][0]
    model_class = {"DFlashDraftModel": reference.DFlashDraftModel, "DFlash2DraftModel": reference.DFlash2DraftModel}
    model, info = model_class[architecture].from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()
