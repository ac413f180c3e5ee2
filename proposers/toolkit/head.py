"""What every family's drafter model does after its last hidden state, in one place: the output
head (the target's lm_head, or a reduced draft vocabulary's own rows with its id map, vocab.py),
logits over the target's vocabulary, the drafts the replay reads (`DraftModel.drafts`), q at T > 0,
and RoPE of given positions. The families' models (block_drafter.py's, step_chain.py's and theirs)
differ in how they reach that hidden state, not in this."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.common import timing
from pipeline.common.sampling import Sampling, token_logprob
from proposers.interface import Drafts
from proposers.toolkit.config import DrafterConfig
from proposers.toolkit.conventions import REFERENCE, Conventions
from proposers.toolkit.vocab import check_vocab_mapping, to_target_vocab


def renamed(name: str, table: dict[str, str], others: str = "") -> str:
    """`name` with the first prefix of `table` it starts with replaced by its value (a checkpoint's
    own module names -> this model's); a name no prefix matches gets `others` in front."""
    own = next((prefix for prefix in table if name.startswith(prefix)), None)
    return table[own] + name[len(own) :] if own else others + name


class DraftHead(nn.Module):
    """Mixin of the drafter models; a subclass sets `config`, `rotary` (transformers' rotary
    embedding: the loader rebuilds its buffers, which no state dict holds) and `lm_head`/`d2t`/`t2d`
    (`add_draft_vocab`, or its own when its head is always its own)."""

    config: DrafterConfig
    rowwise_drafts = True  # drafts = logits row by row: chunks may share one lm_head GEMM (neural.py)
    optional_weights: tuple[str, ...] = ()  # weights a checkpoint may leave out (the target's used instead)
    # tensors a layout's own loader always overwrites from the target, whatever a checkpoint holds:
    # never read (files.read_state_dict), so a saver's NaN placeholder there is no damage
    reloaded_weights: tuple[str, ...] = ()
    # the prefix of its tensors inside a target's own checkpoint, read alone (a native MTP head); None:
    # the checkpoint is the drafter's
    embedded_prefix: str | None = None
    embedded_promise: str | None = None  # the config field that says those tensors are there

    def add_draft_vocab(self, config: DrafterConfig) -> None:
        """A reduced draft vocabulary's own head and id map (vocab.py); none: the target's lm_head."""
        if config.draft_vocab_size is None:
            self.lm_head = self.d2t = self.t2d = None
            return
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.add_id_map(config)

    def add_id_map(self, config: DrafterConfig) -> None:
        """The buffers d2t [Vo] (target id = d + d2t[d]) and t2d [V] (bool), as saved beside the head."""
        self.register_buffer("d2t", torch.zeros(self.lm_head.out_features, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def check_checkpoint(self, state: dict, source: str, config_file: str) -> None:
        """A family's own one-line refusal of a checkpoint (as read, before `canonical_names`) that
        disagrees with its config where the strict name and shape check would say less (MTP's experts)."""

    @staticmethod
    def canonical_names(state: dict) -> dict:
        """The checkpoint's tensors under this model's names (a family whose savers disagree on
        some names maps them here; DFlash's agree)."""
        return state

    def attach_target_head(self, target) -> None:
        """Take what the family needs of the stored target head (a proposers.interface.TargetHead)
        beyond the embedding and lm_head every call is given (MTP: the final norm's weight); most
        need nothing."""

    def drop_weights(self, names) -> None:
        """Use the target's tensors instead of the optional weights `names`, absent from the
        checkpoint: the modules holding them are dropped (their users then take the target's)."""
        for name in names:
            if name not in self.optional_weights:
                raise ValueError(f"{name} is not an optional weight of this drafter")
            setattr(self, name.split(".")[0], None)

    def embedding_table(self, target_embed: torch.Tensor) -> torch.Tensor:
        """The [V, H] table block tokens are embedded with: the drafter's own `embed_tokens` (DSpark,
        the EAGLE families), else the target's (none, or dropped as an absent optional weight)."""
        own = getattr(self, "embed_tokens", None)
        return target_embed if own is None else own.weight

    def head_weight(self, lm_head: torch.Tensor) -> torch.Tensor:
        """The output head [Vo, H]: the drafter's own (a reduced vocabulary), else the target's."""
        return lm_head if self.lm_head is None else self.lm_head.weight

    def to_target(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores over the output vocabulary -> over the target's (-inf outside a reduced one)."""
        return scores if self.d2t is None else to_target_vocab(scores, self.d2t, self.config.vocab_size)

    def check_loaded(self, source: str) -> None:
        """After loading: the vocabulary mapping is one the drafter can score with."""
        if self.d2t is not None:
            check_vocab_mapping(self.d2t, self.t2d, self.config.vocab_size, source)

    def rope(self, like: torch.Tensor, positions: torch.Tensor):
        """cos/sin [*positions.shape, d] in like's dtype."""
        flat = positions.reshape(1, -1)
        cos, sin = self.rotary(like, flat)
        return cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)

    def logits(self, hidden: torch.Tensor, lm_head: torch.Tensor, conventions: Conventions = REFERENCE) -> torch.Tensor:
        """Draft logits [..., V] over the target's vocabulary (head_logits, mapped by to_target)."""
        return self.to_target(self.head_logits(hidden, self.head_weight(lm_head), conventions))

    def head_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor, conventions: Conventions = REFERENCE):
        """`lm_head` on drafter states, then output_multiplier and optional soft-capping."""
        # One [rows, H] x [H, V] GEMM: F.linear on a non-contiguous [a, L, H] view (the block
        # minus its first position) falls back to a slower batched matmul on CPU (bench/README.md).
        with timing.stage("lm_head", rows=hidden.shape[0] * hidden.shape[1]):
            logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]), lm_head)
        logits = logits.view(*hidden.shape[:-1], -1)
        _, multiplier, cap = self.config.scales(conventions)
        if multiplier != 1.0:
            logits = logits * multiplier
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def drafts(self, hidden, lm_head, previous, conventions: Conventions = REFERENCE) -> Drafts:
        """Independent drafts per block position: the logits alone (greedy draft = argmax)."""
        return Drafts(self.logits(hidden, lm_head, conventions))

    def draft_logprob(self, logits: torch.Tensor, tokens: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """The drafter samples every block position with the target's settings, independently."""
        return token_logprob(logits, tokens, sampling)
