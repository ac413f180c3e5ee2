"""A standalone draft model at every anchor, as llama-server's draft-simple runs it
(common/speculative.cpp:179-450), teacher-forced along the stored response.

Online, the draft model's KV cache follows the target's batches (process()), and at anchor t it
decodes the last sampled token x_t, then each draft in turn: draft j is the argmax of its
next-token logits after x_0 .. x_t, d_1 .. d_{j-1} (a top-10 sampler whose first candidate is the
argmax). Draft j is verified only while d_1 .. d_{j-1} were the stored tokens, so offline every
draft is the argmax of one causal forward over the stored sequence: draft j at t is top[t + j - 1]
(`prepare`, one forward per sample; `propose` gathers). The server's p-min and n-min (default 0)
are refused by the config: with them the chain's length depends on drafts after a rejected one. q
is a point mass: llama-server verifies a draft by sampling the target and comparing.

vLLM's `use_heterogeneous_vocab` (vocab_mapping.py): the same pass over the stored tokens mapped
target -> draft, each argmax constrained to the two vocabularies' intersection and mapped back.
A draft model given as a GGUF file is read from the transformers directory it converts to
(checks.py transformers_dir).
"""

from __future__ import annotations

import torch

from pipeline.common import timing
from proposers.draft.checks import model_config, transformers_dir
from proposers.draft.vocab_mapping import VocabMapping, checked
from proposers.interface import Chunk, Drafts, PackedTokens
from proposers.toolkit.token_chain import TokenChain

UNPROPOSED = -1  # a slot past the stored sequence: never verified
ROWS = 1024  # positions whose logits one lm_head product holds


class DraftModelProposer(TokenChain):
    """A causal LM drafting greedily: tokens only, no target features; n-max drafts at every anchor,
    which the server cuts to the budget afterwards (walk rule)."""

    attention: str | None = None  # transformers' attention implementation; None: its default

    def __init__(self, config):
        super().__init__(config)
        self.model = None
        self.mapping: VocabMapping | None = None  # vLLM's heterogeneous vocabulary (vocab_mapping.py)

    def load(self, dtype: torch.dtype, device: str) -> dict:
        """Load the draft model; its weights (for the results' content hash), and the vocabulary
        mapping a heterogeneous one drafts through."""
        from transformers import AutoModelForCausalLM

        model_config(self.config)  # one error line when the directory holds no model
        attention = {"attn_implementation": self.attention} if self.attention else {}
        with timing.stage("load draft model"):
            model = AutoModelForCausalLM.from_pretrained(transformers_dir(self.config), dtype=dtype, **attention)
        self.model = model.to(device).eval()
        return {**{name: t.detach().cpu() for name, t in model.state_dict().items()}, **self._mapping()}

    def _mapping(self) -> dict:
        """The mapping score checked against the shards (heterogeneous vocabulary only); its tensors."""
        if not getattr(self.config, "heterogeneous_vocab", False):
            return {}
        self.mapping = checked(self.config.model_dir)
        return self.mapping.tensors()

    def prepare(self, samples, target, options):
        """Per sample, the draft model's argmax after every prefix, concatenated [sum N]."""
        tops = [self._greedy(tokens.to(options.device)) for tokens, _ in samples]
        return torch.cat(tops), [None for _ in tops]

    @torch.no_grad()
    def _greedy(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N] the argmax of the next token after each prefix of `tokens` (target ids)."""
        ids = tokens if self.mapping is None else self.mapping.to_draft(tokens)
        with timing.stage("draft model forward", tokens=tokens.numel()):
            hidden = self.model.base_model(ids[None]).last_hidden_state[0]  # [N, H] after the final norm
        return greedy_rows(self.model, hidden, self.mapping)

    def propose(self, packed: PackedTokens, chunks: list[Chunk], target, options) -> list[Drafts]:
        return [self._drafts(packed, chunk) for chunk in chunks]

    def _drafts(self, packed: PackedTokens, chunk: Chunk) -> Drafts:
        """Draft j at anchor t: top[t + j - 1]; unknown past the stored sequence (never verified)."""
        top = packed.state
        starts, lengths = packed.starts[chunk.sample_idx], packed.lengths[chunk.sample_idx]
        positions = chunk.anchors[:, None] + torch.arange(chunk.block_len, device=top.device)[None, :]  # [a, K]
        flat = (starts[:, None] + positions).clamp(max=top.numel() - 1)
        drafts = torch.where(positions < lengths[:, None], top[flat], torch.full_like(flat, UNPROPOSED))
        return Drafts(None, drafts.long())


def greedy_rows(model, hidden: torch.Tensor, mapping: VocabMapping | None) -> torch.Tensor:
    """[r] the greedy draft (a target id) of each row of `hidden`, ROWS logits [r, V] at a time: the
    argmax, or under a heterogeneous vocabulary the constrained argmax mapped back."""
    head = model.get_output_embeddings()
    pick = (lambda logits: logits.argmax(dim=-1)) if mapping is None else mapping.greedy
    return torch.cat([pick(head(rows)) for rows in hidden.split(ROWS)])
