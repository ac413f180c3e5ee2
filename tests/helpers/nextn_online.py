"""A GLM-4.5 NextN head written from vLLM's rule alone, on transformers' own Glm4MoeDecoderLayer
(its Glm4MoeMoE: sigmoid router with the score-correction bias, routed and shared experts), driven
by tests/helpers/mtp_online.py's growing-cache loop. vLLM 0.33 `model_executor/models/glm4_moe_mtp.py`:

  Glm4MoeMultiTokenPredictorLayer.forward (106-128): the embedding is zeroed at position 0 (116),
  h = eh_proj([enorm(embed) ; hnorm(previous_hidden_states)]) (117-122, embedding first), the
  decoder layer of the target's kind (`mtp_block`, 98-104, built at layer index
  num_hidden_layers: MoE), returned as `residual + hidden_states` (127-128), BEFORE shared_head.norm;
  compute_logits (182-191): shared_head.head(shared_head.norm(h)) (shared_head.head: the target's
  lm_head when the checkpoint has none, load_weights 252-254);
  v1/spec_decode/llm_base_proposer.py: a single returned tensor (`model_returns_tuple` false for
  Glm4MoeMTPModel, 1001-1014) is both what the logits read and what the next step reads (599-602,
  753-760), so the state fed back is the one before shared_head.norm.

DeepSeek-V3 (`model_executor/models/deepseek_mtp.py`, the same loop on transformers' own
DeepseekV3DecoderLayer: MLA, group-limited routing): the same forward (113-144: position 0 zeroed at
123, [enorm(e) ; hnorm(h)] at 124-129), but it returns `(h, shared_head(h))` (144) and, with
`model_returns_tuple` true for DeepSeekMTPModel (llm_base_proposer.py:1001-1012), the proposer feeds
back the second (603-604, 757-758): the state AFTER shared_head.norm.

Also a tiny GLM-4.5 target (transformers' Glm4MoeForCausalLM: layer 0 dense, the rest MoE) and the
head saved into its checkpoint as `model.layers.{L}.*`, named as the target's save_pretrained names
its own layers (experts one at a time)."""

from __future__ import annotations

import torch
from torch import nn

GLM = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,  # layer 0 dense, layer 1 and the NextN layer MoE (GLM-4.5's 3 of 92)
    routed_scaling_factor=2.5,  # GLM-4.5's
    attention_bias=True,  # GLM-4.5's q/k/v biases
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    num_nextn_predict_layers=1,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


# DeepSeek-V3's NextN head: MLA (q LoRA, compressed kv, interleaved rope, YaRN), group-limited routing
DEEPSEEK = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,  # DeepSeek-V3's 8 groups, 4 kept, in small
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    rope_interleave=True,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },  # fmt: skip
    num_nextn_predict_layers=1,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def glm_config(vocab_size: int):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**GLM, vocab_size=vocab_size)


def deepseek_config(vocab_size: int):
    from transformers import DeepseekV3Config

    # the keys DeepSeek-V3's config.json states and vLLM reads (transformers' class does not declare them)
    return DeepseekV3Config(**DEEPSEEK, vocab_size=vocab_size, scoring_func="sigmoid", topk_method="noaux_tc")


def draw_moe(mlp, bias_std: float = 0.3) -> None:
    """A Glm4MoeMoE outside a PreTrainedModel holds torch.empty experts and a zero router: drawn
    like nn.Linear's, and a non-zero score-correction bias (it picks the experts, not their weights)."""
    with torch.no_grad():
        for weight in (mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight):
            weight.normal_(0.0, weight.shape[-1] ** -0.5)
        mlp.gate.e_score_correction_bias.normal_(0.0, bias_std)


class SharedHead(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm  # no `head`: the target's lm_head serves (llama.cpp's and vLLM's fallback)


class NextnHead(nn.Module):
    """The head's modules, named as the checkpoint's `model.layers.{L}.*` (the decoder layer's own
    modules at the top: `state` below)."""

    def __init__(self, config):
        from tests.helpers.mtp_online import _classes

        super().__init__()
        decoder_layer, norm, _ = _classes(config)  # Glm4MoeDecoderLayer or DeepseekV3DecoderLayer
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = norm(hidden, eps=eps)
        self.hnorm = norm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(norm(hidden, eps=eps))
        # vLLM feeds back GLM-4.5's layer output (glm4_moe_mtp.py:127-128), DeepSeek-V3's normed one
        # (deepseek_mtp.py:136-144: `return hidden_states, self.shared_head(hidden_states)`, the second fed back)
        self.feeds_normed = config.model_type == "deepseek_v3"
        with torch.no_grad():  # a trained norm's weight: at 1 hnorm would cancel it, and with it the
            self.shared_head.norm.weight.normal_(1.0, 0.5)  # difference between the engines' feedbacks
        layer = decoder_layer(config, config.num_hidden_layers)  # vLLM's mtp_block: layer L, MoE
        layer.self_attn.layer_idx = 0  # the head's own one-layer cache
        self.layers = nn.ModuleList([layer])
        draw_moe(layer.mlp)

    def combine(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """glm4_moe_mtp.py:116-122: position 0's embedding zeroed, then [enorm(e) ; hnorm(h)]."""
        embeds = torch.where(positions[..., None] == 0, 0.0, embeds)
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))

    def logit_state(self, h: torch.Tensor) -> torch.Tensor:
        return self.shared_head.norm(h)  # compute_logits, glm4_moe_mtp.py:189

    def fed_back(self, h: torch.Tensor) -> torch.Tensor:
        return self.shared_head.norm(h) if self.feeds_normed else h

    def state(self, layer_index: int) -> dict[str, torch.Tensor]:
        """The tensors as the checkpoint names them (fused experts: save_head un-fuses them)."""
        prefix = f"model.layers.{layer_index}."
        return {
            prefix + name.removeprefix("layers.0."): tensor.detach().contiguous()
            for name, tensor in self.state_dict().items()
        }


def build_target(config, seed: int = 0):
    """A random Glm4MoeForCausalLM (DeepseekV3ForCausalLM) of `config`, its score-correction biases drawn (non-zero) and its
    final norm's weight drawn (at 1 the pre- and post-norm states differ by a scale alone, which hnorm removes)."""
    from transformers import DeepseekV3ForCausalLM, Glm4MoeForCausalLM

    from tests.helpers.models import seeded

    causal = DeepseekV3ForCausalLM if config.model_type == "deepseek_v3" else Glm4MoeForCausalLM
    with seeded(seed):
        model = causal(config).eval()
        with torch.no_grad():
            for layer in model.model.layers[config.first_k_dense_replace :]:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
            model.model.norm.weight.normal_(0.0, 1.0)
    return model


def save_head(head: NextnHead, save_dir: str, target, index: int = 0) -> None:
    """The head's tensors added to the target's safetensors as `model.layers.{L + index}.*`, experts
    one at a time (transformers' revert_weight_conversion, as the target's own layers are saved)."""
    import os

    from safetensors.torch import load_file, save_file
    from transformers.core_model_loading import revert_weight_conversion

    path = os.path.join(save_dir, "model.safetensors")
    state = load_file(path)
    state.update(revert_weight_conversion(target, head.eval().state(target.config.num_hidden_layers + index)))
    save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})


def build_dir(save_dir, config) -> tuple[str, object, NextnHead]:
    """(dir, target, a new head): build_target's target, peaked (lm_head x 3: its greedy continuations
    have structure to learn), saved with the tiny tokenizer."""
    from tests.helpers.models import make_tokenizer, seeded

    target = build_target(config)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
    target.save_pretrained(str(save_dir))
    make_tokenizer(str(save_dir))
    with seeded(1):
        head = NextnHead(config)
    return str(save_dir), target, head


# -- a stack of N heads under vLLM's default model runner (V2): its multi-module speculator ----------
# vLLM 0.33 `v1/worker/gpu/spec_decode/multi_module_mtp/speculator.py` (the speculator whenever
# min(num_nextn_predict_layers, num_speculative_tokens) > 1: config/speculative.py:2188-2194,
# v1/worker/gpu/spec_decode/__init__.py:65-70; the V2 runner is the default, config/vllm.py:731-767).


def _stack_pass(head: NextnHead, embeds, states) -> torch.Tensor:
    """One head over slots 0..n-1 (embeds, states [n, H]) at positions 0..n-1, causal: its outputs."""
    from tests.helpers.mtp_online import _forward

    return _forward(head, embeds[None], states[None], torch.arange(embeds.shape[0])[None], None)[0]


def fit_later_heads(heads: list[NextnHead], target, sequences, steps: int, lr: float = 5e-3) -> float:
    """Adam on heads 1.. (head 0 as fitted), each on its teacher-forced loss: head j's slot s reads
    (x_{s+1+j}, head j - 1's output at s as fed on) and predicts x_{s+2+j}; the last head's loss."""
    from tests.helpers.mtp_online import target_states

    data = [(ids, target_states(target, ids)[1]) for ids in sequences]
    optimizer = torch.optim.Adam([p for head in heads[1:] for p in head.parameters()], lr=lr)
    embed, loss = target.model.embed_tokens, torch.tensor(0.0)
    for step in range(steps):
        ids, state = data[step % len(data)]
        losses = []
        for j, head in enumerate(heads):
            n = ids.numel() - 2 - j
            with torch.no_grad():
                embeds = embed(ids[1 + j : 1 + j + n])
            out = _stack_pass(head, embeds, state[:n])
            if j:
                losses.append(
                    nn.functional.cross_entropy(target.lm_head(head.logit_state(out)), ids[2 + j : 2 + j + n])
                )
            state = head.fed_back(out)
        loss = sum(losses)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(losses[-1].detach())


@torch.no_grad()
def propose_stack(caches, lm_head, hidden, seq, window: int, start: int, count: int, temperature: float = 0.0):
    """`count` drafts at anchor `start` (_generate_drafts, 392-478). The draft window is slots
    window..start - 1, slot s reading x_{s+1} and the target's state at s at position s (the target's
    inputs shifted left by one, 555-568, its states 664-760). Step j runs head j (`spec_module_idx=step`,
    436; `spec_step_idx % N`, deepseek_mtp.py:217, glm4_moe_mtp.py:172) over every slot of the window,
    writing its own KV cache there (each head its own attention layer); the draft comes from the
    window's last slot (442-451) through head j's shared_head (compute_logits, deepseek_mtp.py:228-237);
    step j + 1 reads the inputs shifted left by one more, the draft appended (update_draft_inputs,
    467-475, _shift_input_ids_kernel 1002-1031), and every slot's output of step j as its state (455,
    the feedback element of _run_model, 317-323: GLM-4.5's pre-norm output, DeepSeek-V3's normed one)."""
    from dflash.model import _sample_probs

    from tests.helpers.mtp_online import _Proposal

    tokens, state = seq[window + 1 : start + 1], hidden[window:start]
    drafts, probs = [], []
    for j in range(count):
        cache = caches[j % len(caches)]
        cache.crop(window)  # the window's slots are rewritten; those before it kept
        out = cache.append(tokens, state)
        logits = lm_head(cache.head.logit_state(out[-1:]))[0]
        if temperature <= 0:
            token = logits.argmax()
        else:
            probs.append(torch.softmax(logits.float() / temperature, dim=-1))
            token = _sample_probs(probs[-1][None])[0]
        drafts.append(token)
        tokens, state = torch.cat([tokens[1:], token.reshape(1)]), cache.head.fed_back(out)
    return _Proposal(torch.stack(drafts), torch.stack(probs) if probs else None)


@torch.no_grad()
def online_stack(heads, target, prompt, steps: int, max_new: int, stop_ids, temperature: float = 0.0):
    """mtp_online.online_mtp's loop with the stack's speculator: after a step verified with r drafts
    rejected, the next window starts max(0, r - 1) slots before the previous anchor, the slots whose
    later heads read a rejected draft re-prefilled (_prepare_input_buffers_kernel, 514-517, 582-595)."""
    from tests.helpers.dspark_online import commit, sample, verify
    from tests.helpers.eagle3_online import OnlineRun
    from tests.helpers.mtp_online import DraftCache, target_states

    max_length = prompt.numel() + max_new
    logits, hidden = target_states(target, prompt)
    first = logits[-1].argmax() if temperature <= 0 else sample(logits[-1:], temperature)[0]
    seq = torch.cat([prompt, first.reshape(1)])
    run, caches = OnlineRun(seq), [DraftCache(head, target.model.embed_tokens) for head in heads]
    start, window, stopped = prompt.numel(), 0, int(seq[-1]) in stop_ids
    while start + 1 < max_length and not stopped:
        count = min(steps, max_length - start - 1)
        proposal = propose_stack(caches, target.lm_head, hidden, seq, window, start, count, temperature)
        logits, candidate_hidden = target_states(target, torch.cat([seq[: start + 1], proposal.drafts]))
        accepted, bonus = verify(logits[start:], proposal, temperature)
        new_tokens = torch.cat([proposal.drafts[:accepted], bonus.reshape(1)])
        seq, hidden, produced, stopped = commit(seq, hidden, candidate_hidden, start, new_tokens, max_length, stop_ids)
        window = start - max(0, count - accepted - 1)
        start += produced
        run.produced.append(produced)
        run.accepted.append(accepted)
    run.output_ids = seq[: min(start + 1, max_length)]
    return run


def stack_chains(heads, target, sample, steps: int) -> list:
    """(anchor row, the stack's drafts, the stored tokens they propose) at every anchor: fresh caches,
    the whole stored prefix its first window (as after the prompt's prefill)."""
    from tests.helpers.mtp_online import DraftCache, target_states

    ids, chains = sample.input_ids, []
    hidden = target_states(target, ids)[1]
    for t in range(sample.prompt_len, ids.numel() - 1):
        depth = min(steps, ids.numel() - 1 - t)
        caches = [DraftCache(head, target.model.embed_tokens) for head in heads]
        drafts = propose_stack(caches, target.lm_head, hidden, ids, 0, t, depth).drafts
        chains.append((t - sample.prompt_len, drafts, ids[t + 1 : t + 1 + depth]))
    return chains
