"""The EAGLE-1/2 drafter of the EAGLE repository (PyPI eagle-llm 1.2.1, `eagle/model/cnets.py`
`Model`), built, fitted with the repository's own training loss and saved as its checkpoints are,
and driven online by tests/helpers/eagle3_online.py's loop and eagle3_tree_online.py's tree
(tests/parity/test_eagle1_parity.py).

The reference's rule (cnets.py `Model.forward`, `generate`; vLLM and SGLang llama_eagle.py): slot
s of the draft KV reads (x_{s+1}, the target's last hidden state after its final norm at s) at
position s through fc([embed ; hidden]) and one Llama layer without an input norm; a step's draft
is the target's lm_head on the layer's output, and the next step reads (that draft, that output).
`Eagle1Reference` gives the online loops what they call on a drafter (`new_cache`, `states`,
`steps`); `ReferenceCache` is the model on its own legacy KV cache (tuples, cut by slicing).
Training (the repository's eagle/train/main.py): forward over (hidden [T], x_{1..T}), loss
p_w * cross-entropy against the target's distribution at the next position + v_w * smooth-L1 of
the predicted hidden state against the target's next one, on response positions. Nothing here
imports specreplay's code.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
from torch import nn

from tests.helpers.dspark_online import target_states
from tests.helpers.models import seeded

P_W, V_W = 1.0, 1.0  # the repository's are p_w 0.1, v_w 1.0 at 7B; the tiny target's logits are
# small against its hidden states, so the probability term is weighted up to match


class Eagle1Reference:
    """The reference model with the target's lm_head it drafts through, as the loops drive it."""

    def __init__(self, model, target, steps: int):
        self.model, self.target, self.steps = model, target, steps
        self.lm_head = target.lm_head.weight.detach()

    def new_cache(self) -> ReferenceCache:
        return ReferenceCache(self)

    @staticmethod
    @torch.no_grad()
    def states(target, ids: torch.Tensor):
        """(logits [T, V], the drafter's feature [T, H]: the target's post-norm last hidden state, the
        pre-norm one [T, H]) of `ids`, for the loops' `target_states` slot."""
        logits, _, pre_norm = target_states(target, ids)
        return logits, target.model.norm(pre_norm), pre_norm


class ReferenceCache:
    """The reference `Model` on its own KV cache for one sequence (the online loops' draft cache)."""

    def __init__(self, reference: Eagle1Reference):
        self.reference, self.kv = reference, None

    @property
    def length(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[2]

    def __deepcopy__(self, memo) -> ReferenceCache:
        """A tree node's own copy: the same model, its own cache (grown by concatenation, never in
        place, so the tensors themselves are shared safely)."""
        copy = ReferenceCache(self.reference)
        copy.kv = self.kv
        return copy

    def crop(self, length: int) -> None:
        self.kv = tuple((k[:, :, :length], v[:, :, :length]) for k, v in self.kv) if length else None

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Slots length.. from tokens [n] and hidden inputs [n, H] (causal among themselves, seeing
        every cached slot); returns the layer's outputs [n, H]."""
        out, self.kv = self.reference.model(
            hidden[None], input_ids=tokens[None], past_key_values=self.kv, use_cache=True
        )
        return out[0]

    def slots(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.forward(tokens, features)

    def step(self, token: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.forward(token.reshape(1), h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[n, V] the target's lm_head on the layer's output as it is (no norm)."""
        return nn.functional.linear(h, self.reference.lm_head).float()

    def draft_probs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [V] after the step whose output is h [1, H], the target ids of q's entries)."""
        q = torch.softmax(self.logits(h)[0], dim=-1)
        return q, torch.arange(q.numel())


# ---------------------------------------------------------------------------------------------
# build, fit, save as the repository does


def new_model(target, *, layers: int = 1, bias: bool = True, seed: int = 0):
    """The reference `Model` of `layers` layers for the target's widths, its embedding the target's
    (frozen, as the repository loads it with load_emb)."""
    model = reference_model(config_fields(target.config, layers), bias, seed)
    model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.detach())
    return model


def reference_model(fields: dict, bias: bool, seed: int):
    """cnets.py's `Model` for the LlamaConfig `fields` (its own init), in float32."""
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig

    config = EConfig(**fields)
    # transformers 5's PretrainedConfig fills rope_scaling with its default rope parameters, which
    # cnets.py (written for transformers 4) reads as a scaling type; None is what it meant there
    config.rope_scaling = None
    with seeded(seed):
        return Model(config, bias=bias).float()


def random_eagle1(
    save_dir, *, vocab: int, hidden: int, layers: int = 1, std: float = 0.2, seed: int = 0, shapes=None, steps=None
) -> str:
    """The reference `Model` for a target of `hidden` x `vocab` (`shapes`: heads, kv_heads, mlp;
    default 4, 2, 2 * hidden) with every weight drawn N(0, std), saved as the repository saves it
    (SGLang's architecture; `steps` this project's num_speculative_tokens)."""
    shapes = dict(heads=4, kv_heads=2, mlp=2 * hidden) | (shapes or {})
    target = SimpleNamespace(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=shapes["mlp"], num_attention_heads=shapes["heads"],
        num_key_value_heads=shapes["kv_heads"], rms_norm_eps=1e-6, max_position_embeddings=512,
    )  # fmt: skip
    fields = config_fields(target, layers) | ({"num_speculative_tokens": steps} if steps else {})
    model = reference_model(fields, True, seed)
    with seeded(seed), torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, std)
    return save(model, fields, save_dir)


def config_fields(target_config, layers: int) -> dict:
    """The drafter's LlamaConfig fields for the target's widths, as an EAGLE checkpoint states them
    (RoPE base 10000: the only one cnets.py builds)."""
    config = target_config
    return dict(
        model_type="llama",
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        hidden_act="silu",
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=10000.0,
        pretraining_tp=1,
    )


@torch.no_grad()
def training_example(target, ids: torch.Tensor, prompt_len: int) -> dict:
    """The repository's training fields of one sequence (main.py CustomDataset): hidden states [T],
    input ids shifted by one (x_{i+1} at i, a pad at the end), the next hidden state as target,
    the loss on response positions, the last one masked."""
    _, post_norm, _ = Eagle1Reference.states(target, ids)
    loss_mask = (torch.arange(ids.numel()) >= prompt_len).float()
    loss_mask[-1] = 0
    return dict(
        hidden_states=post_norm,
        input_ids=torch.cat([ids[1:], ids.new_zeros(1)]),
        target=torch.cat([post_norm[1:], post_norm.new_zeros(1, post_norm.shape[-1])]),
        loss_mask=loss_mask,
    )


def fit(model, target, examples: list[dict], *, steps: int, lr: float = 3e-3, per_step: int = 4, seed: int = 0):
    """`steps` AdamW steps of the repository's loss on `per_step` random examples; returns the losses."""
    head = target.lm_head
    trainable = [p for p in model.parameters() if p.requires_grad]  # not embed_tokens (frozen)
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    losses = []
    model.train()
    model.gradient_checkpointing = False  # cnets.py recomputes activations to save memory: the same gradients
    with seeded(seed):
        for _ in range(steps):
            chosen = torch.randperm(len(examples))[:per_step].tolist()
            loss = sum(_loss(model, head, examples[i]) for i in chosen) / len(chosen)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
    model.eval()
    return losses


def _loss(model, head, example: dict) -> torch.Tensor:
    """main.py's loss of one example (batch 1)."""
    predict = model(example["hidden_states"][None], input_ids=example["input_ids"][None])
    with torch.no_grad():
        target_p = torch.softmax(head(example["target"][None]), dim=2)
    out_logp = torch.log_softmax(head(predict), dim=2)
    mask = example["loss_mask"][None, :, None]
    ploss = -torch.sum(mask * target_p * out_logp) / (mask.sum() + 1e-5)
    vloss = nn.SmoothL1Loss(reduction="none")(predict, example["target"][None])
    vloss = torch.sum(torch.mean(mask * vloss, 2)) / (mask.sum() + 1e-5)
    return V_W * vloss + P_W * ploss


def save(model, fields: dict, out_dir, *, architecture: str = "LlamaForCausalLMEagle") -> str:
    """An EAGLE checkpoint as the repository's EaModel loads it: config.json (the LlamaConfig
    `fields`, `bias` as the model has it) and pytorch_model.bin (its state dict, embed_tokens included)."""
    os.makedirs(out_dir, exist_ok=True)
    config = {"architectures": [architecture], **fields, "bias": model.fc.bias is not None}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    torch.save(model.state_dict(), os.path.join(out_dir, "pytorch_model.bin"))
    return str(out_dir)


def save_for(model, target, out_dir, **options) -> str:
    """`save` with the fields of the target's widths (`new_model`'s)."""
    return save(model, config_fields(target.config, len(model.layers)), out_dir, **options)
