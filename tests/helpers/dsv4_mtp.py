"""DeepSeek-V4's own MTP head (`mtp.0.*` of the target's checkpoint) for tests/parity/test_mtp_dsv4_parity.py:
a reference head and its online greedy loop written rule by rule from vLLM 0.33's
vllm/models/deepseek_v4/nvidia/mtp.py on transformers' own DeepSeek-V4 modules (DeepseekV4DecoderLayer as the
`mtp_block`, with its hyper-connections, attention sinks through eager_attention_forward and MoE;
DeepseekV4HyperHead, DeepseekV4RMSNorm, DeepseekV4RotaryEmbedding), fitted briefly through its own forward and
saved in DeepSeek's checkpoint layout (the names vLLM's load_weights reads, mtp.py:359-557).

The rule (nvidia/mtp.py):
  - the target's last layer output streams [T, hc, H], before hc_head and the final norm (the target stashes
    them in `_mtp_hidden_buffer`, nvidia/model.py:1036-1038);
  - the embedding zeroed at position 0, enorm; hnorm per stream (fused_mtp_input_rmsnorm.py:3-9, 87-119);
  - x = h_proj(hnorm(h)) + e_proj(enorm(e)) into every stream (mtp.py:183-185), through mtp_block and its
    hc_post (198-204), returned as streams and fed to the next step (207-210, spec_step_idx % 1: one head);
  - logits = head(norm(hc_head(streams))) (compute_logits, 274-300), the target's lm_head (DeepSeek's MTPBlock
    shares it), the block's attention a sliding window (attention.py:236-242: ratio 1 past the target's layers).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
    DeepseekV4RotaryEmbedding,
)

from tests.helpers import dsv4_dspark as d4
from tests.helpers.dspark_online import commit
from tests.helpers.eagle3_online import OnlineRun

HEAD_INIT = 0.3  # the block's init std: large, so its attention and experts move the drafts
SINKS = (1.5, -1.0, 2.5, 0.5)  # not transformers' zeros, so reading them is checked
TO_DEEPSEEK = dict(d4.TO_DEEPSEEK)
OWN = {"hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}


class ReferenceHead(nn.Module):
    """DeepSeekV4MultiTokenPredictorLayer (nvidia/mtp.py:79-210) on transformers' modules."""

    def __init__(self, hf=None):
        super().__init__()
        hf = hf or d4.hf_config(1)
        size, eps = hf.hidden_size, hf.rms_norm_eps
        self.hf, self.window = hf, hf.sliding_window
        self.enorm, self.hnorm = DeepseekV4RMSNorm(size, eps), DeepseekV4RMSNorm(size, eps)  # :98-99
        self.e_proj, self.h_proj = nn.Linear(size, size, bias=False), nn.Linear(size, size, bias=False)  # :103-118
        self.hc_head = DeepseekV4HyperHead(hf)  # hc_head_fn / base / scale :123-134
        self.norm = DeepseekV4RMSNorm(size, eps)  # shared_head.norm :136
        self.block = DeepseekV4DecoderLayer(hf, 0)  # mtp_block :139-144
        self.rotary = DeepseekV4RotaryEmbedding(hf)
        init = type(hf)(**{**hf.to_dict(), "initializer_range": HEAD_INIT})
        init._attn_implementation = "eager"
        from transformers import DeepseekV4ForCausalLM

        model = DeepseekV4ForCausalLM(init)  # transformers' own initialisation of the block and the hc head
        self.block.load_state_dict(model.model.layers[0].state_dict())
        self.hc_head.load_state_dict(model.model.hc_head.state_dict())
        with torch.no_grad():  # trained norms and sinks: at 1 (0) they would hide a wrong rule
            for norm in (self.enorm, self.hnorm, self.norm):
                norm.weight.normal_(1.0, 0.3)
            self.block.self_attn.sinks.copy_(torch.tensor(SINKS))

    def forward(self, embeds, streams, positions, valid=None) -> torch.Tensor:
        """The block's output streams [B, n, hc, H] of rows (embeds [B, n, H], streams [B, n, hc, H]) at
        `positions` [B, n], each seeing the `valid` rows (all: None) at or before its position within the
        window (a KV cache of the same rows computes the same)."""
        embeds = torch.where(positions[..., None] == 0, torch.zeros_like(embeds), embeds)  # fused kernel :88-96
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(embeds)).unsqueeze(-2)  # :183-185
        cos, sin = self.rotary(x, positions, "main")
        q, k = positions[:, :, None], positions[:, None, :]
        visible = (k <= q) & (q - k < self.window)  # sliding causal: a layer past the target's never compresses
        if valid is not None:
            visible = visible & valid[:, None, :]
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[:, None]
        return self.block(x, position_embeddings={"main": (cos, sin)}, position_ids=positions, attention_mask=mask)

    def logit_state(self, streams: torch.Tensor) -> torch.Tensor:
        """[.., H]: norm(hc_head(streams)) (compute_logits :283-299)."""
        return self.norm(self.hc_head(streams))

    def deepseek_state(self) -> dict:
        """The head's tensors as DeepSeek's checkpoint names them (`mtp.0.*`), each routed expert's w1/w2/w3."""
        out = {}
        for name, tensor in self.state_dict().items():
            tensor = tensor.detach().contiguous()
            if name.startswith("block."):
                rest = name.removeprefix("block.")
                if rest.startswith("mlp.experts."):
                    out |= d4._experts("0", rest, tensor)
                    continue
                new = next((rest.replace(a, b, 1) for a, b in TO_DEEPSEEK.items() if rest.startswith(a)), None)
                assert new is not None, name
                out[f"mtp.0.{new}"] = tensor
            else:
                out[f"mtp.0.{OWN.get(name, name)}"] = tensor
        return out


@torch.no_grad()
def target_streams(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V], the last layer's output streams [T, hc, H]: what the MTP head reads)."""
    seen = []
    hook = target.model.layers[-1].register_forward_hook(lambda module, args, out: seen.append(out[0]))
    try:
        logits = target(ids[None]).logits[0]
    finally:
        hook.remove()
    return logits, seen[0]


@torch.no_grad()
def propose(head: ReferenceHead, target, ids: torch.Tensor, streams: torch.Tensor, start: int, count: int) -> list:
    """`count` greedy drafts at anchor `start` (ids[start] the last verified token): step 1 is slot start - 1
    (slot s reads (x_{s+1}, streams s) at s), step j > 1 the row (draft j - 1, the streams step j - 1
    returned) at position start + j - 2."""
    embed, lm_head = target.model.embed_tokens, target.lm_head
    tokens, states = ids[1 : start + 1], streams[:start]
    drafts = []
    while len(drafts) < count:
        out = head(embed(tokens)[None], states[None], torch.arange(tokens.numel())[None])[0, -1]
        drafts.append(int(lm_head(head.logit_state(out[None, None]))[0, 0].argmax()))
        tokens, states = torch.cat([tokens, torch.tensor(drafts[-1:])]), torch.cat([states, out[None]])
    return drafts


@torch.no_grad()
def anchor_chains(head: ReferenceHead, target, ids: torch.Tensor, prompt_len: int, steps: int) -> list[list[int]]:
    """`propose`'s greedy chain at every anchor of a stored sample (prompt_len .. T - 2), the anchors batched:
    each anchor's rows are the slots before it (the others masked) and then its own drafted rows."""
    embed, lm_head = target.model.embed_tokens, target.lm_head
    streams, total = target_streams(target, ids)[1], ids.numel()
    anchors = torch.arange(prompt_len, total - 1)
    count = anchors.numel()
    tokens = embed(ids[1:total])[None].expand(count, -1, -1)  # slot s reads x_{s+1}
    states = streams[: total - 1][None].expand(count, -1, -1, -1)
    positions = torch.arange(total - 1)[None].expand(count, -1)
    valid = positions < anchors[:, None]
    chains = []
    for j in range(steps):
        out = head(tokens, states, positions, valid)
        last = out[torch.arange(count), anchors - 1] if j == 0 else out[:, -1]
        chains.append(lm_head(head.logit_state(last[:, None]))[:, 0].argmax(-1))
        tokens = torch.cat([tokens, embed(chains[-1])[:, None]], 1)
        states = torch.cat([states, last[:, None]], 1)
        positions = torch.cat([positions, (anchors + j)[:, None]], 1)
        valid = torch.cat([valid, torch.ones(count, 1, dtype=torch.bool)], 1)
    drafts = torch.stack(chains, 1)
    return [drafts[a, : min(steps, total - 1 - int(t))].tolist() for a, t in enumerate(anchors)]


@torch.no_grad()
def online_mtp(head: ReferenceHead, target, prompt: torch.Tensor, steps: int, max_new: int, stop_ids) -> OnlineRun:
    """The greedy loop for `prompt` with `steps` drafts a step (dflash_generate's budget and stop rules)."""
    max_length = prompt.numel() + max_new
    logits, streams = target_streams(target, prompt)
    seq = torch.cat([prompt, logits[-1].argmax().reshape(1)])
    run, start, stopped = OnlineRun(seq), prompt.numel(), int(seq[-1]) in stop_ids
    while start + 1 < max_length and not stopped:
        drafts = torch.tensor(propose(head, target, seq, streams, start, min(steps, max_length - start - 1)))
        logits, candidate = target_streams(target, torch.cat([seq[: start + 1], drafts]))
        posterior = logits[start:].argmax(dim=-1)
        accepted = int((drafts == posterior[: drafts.numel()]).long().cumprod(0).sum())
        new_tokens = torch.cat([drafts[:accepted], posterior[accepted].reshape(1)])
        seq, streams, produced, stopped = commit(seq, streams, candidate, start, new_tokens, max_length, stop_ids)
        start += produced
        run.produced.append(produced)
        run.accepted.append(accepted)
    run.output_ids = seq[: min(start + 1, max_length)]
    return run


def fit(head: ReferenceHead, target, sequences: list[torch.Tensor], steps: int, lr: float) -> float:
    """Adam on the teacher-forced steps 1 and 2 over whole sequences (step 2 reads step 1's streams), the
    target frozen; the last loss."""
    data = [(ids, target_streams(target, ids)[1]) for ids in sequences]
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    embed, lm_head, loss = target.model.embed_tokens, target.lm_head, torch.tensor(0.0)
    for step in range(steps):
        ids, streams = data[step % len(data)]
        n = ids.numel() - 3
        with torch.no_grad():
            first, second = embed(ids[1 : n + 1]), embed(ids[2 : n + 2])
        out = head(first[None], streams[None, :n], torch.arange(n)[None])
        loss = nn.functional.cross_entropy(lm_head(head.logit_state(out))[0], ids[2 : n + 2])
        out = head(second[None], out, torch.arange(1, n + 1)[None])  # a chain row sees the rows before it: close enough
        loss = loss + nn.functional.cross_entropy(lm_head(head.logit_state(out))[0], ids[3 : n + 3])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss.detach()) / 2


def save_head(head: ReferenceHead, model_dir: str) -> None:
    """The head's `mtp.0.*` tensors added to the target's model.safetensors (DeepSeek's layout)."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    state = load_file(path)
    state.update(head.deepseek_state())
    save_file(state, path, metadata={"format": "pt"})
