"""An MTP head's online greedy loop, written from the rule alone (docs/drafter-families.md#mtp;
vLLM's qwen3_5_mtp.py run by v1/spec_decode/eagle.py), on transformers' own Qwen3.5 decoder
layer class and a real growing KV cache, one step at a time:

  h' = norm(layer(fc([norm_e(embed(x)) ; norm_h(h)]))), logits = lm_head(h');
  the slot of verified position s is written from (x_{s+1}, the target's post-norm final hidden
  at s) at position s; step 1 at anchor t is slot t - 1; step j > 1 reads (draft j - 1, h' of
  step j - 1) at position t + j - 2; after verification the draft slots are cropped.

Also: a tiny Qwen3.5 target (all layers full attention; or a Qwen3.5-MoE one, whose MTP layer is
transformers' own Qwen3_5MoeDecoderLayer with its sparse MoE block) saved with `mtp.*` tensors as the
real checkpoints lay them out (transformers' own save-time un-fusing of the experts), and a brief fit
of the head's teacher-forced step-1 loss."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from dflash.model import _sample_probs
from safetensors.torch import load_file, save_file
from torch import nn

from tests.helpers.dspark_online import commit, sample, verify
from tests.helpers.eagle3_online import GrowingCache, OnlineRun

TEXT = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    layer_types=["full_attention"] * 3,  # no gated-delta layers: no fla kernels on CPU
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
# Qwen3.5-MoE: every MLP a sparse MoE block (4 experts, top-2, a shared expert); no dense width
MOE_TEXT = {k: v for k, v in TEXT.items() if k != "intermediate_size"} | dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
)


def _classes(config):
    """transformers' (decoder layer, RMSNorm, rotary embedding) of the config's kind."""
    if config.model_type == "glm4_moe":  # tests/helpers/nextn_online.py's NextN heads
        from transformers.models.glm4_moe import modeling_glm4_moe as m

        return m.Glm4MoeDecoderLayer, m.Glm4MoeRMSNorm, m.Glm4MoeRotaryEmbedding
    if config.model_type == "deepseek_v3":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

        return m.DeepseekV3DecoderLayer, m.DeepseekV3RMSNorm, m.DeepseekV3RotaryEmbedding
    if config.model_type == "mimo_v2_flash":  # tests/helpers/mimo_online.py's heads
        from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash as m

        from tests.helpers.mimo_online import Rotary

        return m.MiMoV2FlashDecoderLayer, m.MiMoV2FlashRMSNorm, Rotary
    if config.model_type == "qwen3_5_moe_text":
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

        return m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeRMSNorm, m.Qwen3_5MoeTextRotaryEmbedding
    if config.model_type == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        return m.Qwen3NextDecoderLayer, m.Qwen3NextRMSNorm, m.Qwen3NextRotaryEmbedding
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    return m.Qwen3_5DecoderLayer, m.Qwen3_5RMSNorm, m.Qwen3_5TextRotaryEmbedding


class MtpHead(nn.Module):
    """The head's modules, named as the checkpoint's `mtp.*` (transformers' own layer class)."""

    def __init__(self, config):
        layer, norm, _ = _classes(config)
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm(hidden, eps=eps)
        self.layers = nn.ModuleList([layer(config, 0)])  # layer_types[0]: full attention
        self.norm = norm(hidden, eps=eps)
        mlp = self.layers[0].mlp
        if hasattr(mlp, "experts"):  # torch.empty experts and a zero router (ties): drawn like nn.Linear's
            with torch.no_grad():
                for weight in (mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight):
                    weight.normal_(0.0, weight.shape[-1] ** -0.5)

    def combine(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def logit_state(self, h: torch.Tensor) -> torch.Tensor:
        """What lm_head reads of the layer's output h: h' = norm(h)."""
        return self.norm(h)

    def fed_back(self, h: torch.Tensor) -> torch.Tensor:
        """What the next step reads: h' too (the MTP model's single returned tensor)."""
        return self.norm(h)


def build_target(save_dir, seed: int = 0, moe: bool = False) -> tuple[str, object, MtpHead]:
    """A tiny random Qwen3_5ForCausalLM (Qwen3_5MoeForCausalLM with `moe`) saved to `save_dir`;
    returns (dir, target, a new head)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(**MOE_TEXT) if moe else Qwen3_5TextConfig(**TEXT)
    target = (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM)(config).eval()
    with torch.no_grad():  # a peaked target: its greedy continuations have structure to learn
        target.lm_head.weight.mul_(3.0)
        # a trained final norm's weight: at its init (0, i.e. 1 + 0) the pre- and post-norm hidden
        # states differ by a scale alone, which pre_fc_norm_hidden (an RMSNorm) removes
        target.model.norm.weight.normal_(0.0, 0.5)
    target.save_pretrained(save_dir)
    return str(save_dir), target, MtpHead(config)


def save_head(head: MtpHead, save_dir: str, target=None) -> None:
    """The head's tensors added to the target's safetensors as `mtp.*` (and to its index, if any),
    named as the target's save_pretrained names its own layers' (transformers' revert_weight_conversion:
    a MoE block's fused experts saved one expert at a time)."""
    from transformers.core_model_loading import revert_weight_conversion

    path = os.path.join(save_dir, "model.safetensors")
    state = load_file(path)
    head_state = {f"mtp.{k}": v.detach().contiguous() for k, v in head.state_dict().items()}
    if target is not None:
        head_state = revert_weight_conversion(target, head_state)
    state.update({k: v.contiguous() for k, v in head_state.items()})
    save_file(state, path, metadata={"format": "pt"})
    index = os.path.join(save_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            data = json.load(f)
        data["weight_map"].update({k: "model.safetensors" for k in state})
        with open(index, "w") as f:
            json.dump(data, f)


@torch.no_grad()
def target_states(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V], the final hidden state after the final norm [T, H]: what vLLM feeds MTP)."""
    out = target.model(input_ids=ids[None])
    hidden = out.last_hidden_state[0]
    return target.lm_head(hidden), hidden


def fit(head: MtpHead, target, sequences: list[torch.Tensor], steps: int = 300, lr: float = 3e-3) -> float:
    """Adam on the teacher-forced step-1 loss: slot s reads (x_{s+1}, h_s) and predicts x_{s+2}."""
    data = [(ids, target_states(target, ids)[1]) for ids in sequences]
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    embed = target.model.embed_tokens
    loss = torch.tensor(0.0)
    for step in range(steps):
        ids, hidden = data[step % len(data)]
        with torch.no_grad():
            embeds = embed(ids[1:-1])[None]
        h = _forward(head, embeds, hidden[None, :-2], torch.arange(ids.numel() - 2)[None], None)
        loss = nn.functional.cross_entropy(target.lm_head(head.logit_state(h))[0], ids[2:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def _forward(head: MtpHead, embeds, hidden, positions, cache):
    """The MTP layer over rows [1, n, H] at `positions` [1, n], causal among themselves and seeing
    every cached slot; the layer's output before `norm`."""
    n = embeds.shape[1]
    start = 0 if cache is None else cache.get_seq_length()
    mask = torch.zeros(1, 1, n, start + n)
    mask.masked_fill_(torch.arange(start + n)[None, :] > (start + torch.arange(n))[:, None], float("-inf"))
    x = head.combine(embeds, hidden, positions)
    rotary = _classes(head.layers[0].self_attn.config)[2](head.layers[0].self_attn.config)
    return head.layers[0](x, position_embeddings=rotary(x, positions), attention_mask=mask, cache=cache)


class DraftCache(GrowingCache):
    """The head's KV cache for one sequence (transformers' DynamicCache)."""

    def __init__(self, head: MtpHead, embed):
        from transformers import DynamicCache

        self.head, self.embed = head, embed
        self.cache = DynamicCache(config=head.layers[0].self_attn.config)

    @torch.no_grad()
    def append(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Slots length.. from tokens [n] and hidden inputs [n, H]; returns the layer's outputs [n, H]."""
        positions = torch.arange(self.length, self.length + tokens.numel())[None]
        return _forward(self.head, self.embed(tokens)[None], hidden[None], positions, self.cache)[0]


@torch.no_grad()
def propose(draft: DraftCache, lm_head, hidden, seq, start: int, count: int, temperature: float = 0.0) -> "_Proposal":
    """`count` drafts at anchor `start`: the verified slots up to start - 1 written from target
    features, then one step at a time, each step's output fed to the next (head.fed_back). Greedy:
    each step's argmax; T > 0: each draft drawn from q = softmax(logits / T), the next step reading
    the drawn one (the sampled rule specreplay scores every chain with: docs/sampling.md)."""
    written = draft.length
    h = draft.append(seq[written + 1 : start + 1], hidden[written:start])[-1:]
    drafts, probs = [], []
    for j in range(count):
        logits = lm_head(draft.head.logit_state(h))[0]
        if temperature <= 0:
            token = logits.argmax()
        else:
            probs.append(torch.softmax(logits.float() / temperature, dim=-1))
            token = _sample_probs(probs[-1][None])[0]
        drafts.append(token)
        if j + 1 < count:
            h = draft.append(token.reshape(1), draft.head.fed_back(h))
    tokens = torch.stack(drafts) if drafts else torch.zeros(0, dtype=torch.long)
    return _Proposal(tokens, torch.stack(probs) if probs else None)


@torch.no_grad()
def online_mtp(
    head: MtpHead, target, prompt: torch.Tensor, steps: int, max_new: int, stop_ids, temperature: float = 0.0
) -> OnlineRun:
    """The loop for `prompt` [P] with `steps` drafts a step (dflash_generate's budget and stop rules;
    at T > 0 z-lab's rejection sampling, torch's global generator: seed it)."""
    max_length = prompt.numel() + max_new
    logits, hidden = target_states(target, prompt)
    first = logits[-1].argmax() if temperature <= 0 else sample(logits[-1:], temperature)[0]
    seq = torch.cat([prompt, first.reshape(1)])
    run, draft = OnlineRun(seq), DraftCache(head, target.model.embed_tokens)
    start, stopped = prompt.numel(), int(seq[-1]) in stop_ids
    while start + 1 < max_length and not stopped:
        proposal = propose(draft, target.lm_head, hidden, seq, start, min(steps, max_length - start - 1), temperature)
        draft.crop(start)  # the draft slots go; verified ones are rewritten from target features
        logits, candidate_hidden = target_states(target, torch.cat([seq[: start + 1], proposal.drafts]))
        accepted, bonus = verify(logits[start:], proposal, temperature)
        new_tokens = torch.cat([proposal.drafts[:accepted], bonus.reshape(1)])
        seq, hidden, produced, stopped = commit(seq, hidden, candidate_hidden, start, new_tokens, max_length, stop_ids)
        start += produced
        run.produced.append(produced)
        run.accepted.append(accepted)
    run.output_ids = seq[: min(start + 1, max_length)]
    return run


@dataclass
class _Proposal:
    drafts: torch.Tensor
    probs: torch.Tensor | None = None  # [n, V] each draft's q at T > 0
