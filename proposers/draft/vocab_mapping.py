"""vLLM 0.33.0's heterogeneous-vocabulary draft model (`"use_heterogeneous_vocab": true` on method
"draft_model"): a draft model with ANOTHER tokenizer drafts for the target through a token-level
intersection of the two vocabularies (its "TLI" algorithm). Paths under vllm/.

- The mapping (v1/spec_decode/vocab_mapping.py:67-127, built from the target's tokenizer and the
  draft's, read from the draft model's own directory, and the two configs' vocab sizes:
  v1/spec_decode/draft_model.py:36-56, config/speculative.py:1408-1413): each tokenizer's space
  prefix is detected by encoding " a" (its first token minus the trailing "a"; else both 'Ġ' and
  '▁': vocab_mapping.py:10-32); every token string of `get_vocab()` whose start is a prefix is
  normalized to " " + the rest (:35-39); per normalized string the first id met is kept
  (:91-101); the strings both sides keep are mapped both ways, ids past either vocab size left out
  (:103-114). An id outside the intersection maps to the other side's unk_token_id, else its
  eos_token_id, else vLLM fails to start (:42-64, :129-137).
- Drafting (v1/spec_decode/llm_base_proposer.py): every target token the draft model reads, the
  step's accepted tokens and the token the target sampled, is mapped target -> draft (:820-835)
  and so is each draft fed back (:685-700); a greedy draft is the argmax of the draft's logits with
  every id outside the intersection at -inf, mapped draft -> target (:436-447).
- Only method draft_model, only greedy drafting, not with use_local_argmax_reduction
  (config/speculative.py:1995-2012); the equal-vocab-size check is skipped (:2036-2037). The V2
  model runner lacks it (config/vllm.py:3078-3082), so vLLM runs it on V1, where parallel drafting
  (PARD) maps its inputs and drafts the same way (llm_base_proposer.py:614-626 samples PARD's
  drafts with the same _greedy_sample; its mask id is the draft's own, inserted after the mapping).

Hence teacher-forced at every anchor, exact: draft j at anchor t is verified only while drafts
1..j-1 were the stored tokens x_{t+1} .. x_{t+j-1}; a draft fed back is mapped target -> draft
exactly as the stored token it equals is, and the draft's KV cache holds the mapped accepted tokens
(the next step's first pass rewrites them from the target's tokens, mapped alike). So draft j is
the constrained argmax after map(x_0) .. map(x_{t+j-1}): a function of the stored tokens alone, and
one causal pass over the mapped stored sequence gives every anchor's drafts, as for the plain draft
model (proposer.py, pard.py).

One point the tokenizer files do not fix: where two ids of one side normalize to one string (a
'Ġx' and a literal ' x'), vLLM keeps the one `get_vocab()` lists first, and a fast tokenizer's
`get_vocab()` is a Rust hash map's, in an order that changes from process to process. specreplay
keeps the lowest id and warns when such a string is in the intersection: the replay is then
vLLM's run in which the lowest id came first.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from pipeline.common.errors import UserError

SPACE_PROBE = " a"  # vocab_mapping.py:19
FALLBACK_PREFIXES = ("\u0120", "\u2581")  # 'Ġ' (byte-level BPE), '▁' (SentencePiece): vocab_mapping.py:31
UNMAPPED = -1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def space_prefixes(tokenizer) -> tuple[str, ...]:
    """The space prefix: the first token of " a" less its "a" when it is longer than "a" and starts
    with neither a space nor a tab; else both common ones (vocab_mapping.py:10-32)."""
    try:
        ids = tokenizer.encode(SPACE_PROBE, add_special_tokens=False)
        if ids:
            text = tokenizer.convert_ids_to_tokens(ids[0])
            if isinstance(text, str) and len(text) > 1 and text.endswith("a") and text[0] not in (" ", "\t"):
                return (text[:-1],)
    except Exception:  # noqa: BLE001 - vLLM falls back on any failure of the probe (vocab_mapping.py:29-30)
        pass
    return FALLBACK_PREFIXES


def normalized(token: str, prefixes: tuple[str, ...]) -> str:
    """' ' + the rest of a token that starts with a space prefix (vocab_mapping.py:35-39)."""
    for prefix in prefixes:
        if token.startswith(prefix):
            return " " + token[len(prefix) :]
    return token


def fallback_id(tokenizer, role: str, path: str) -> int:
    """unk_token_id, else eos_token_id (vocab_mapping.py:42-64); vLLM refuses to start without."""
    for name in ("unk_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    raise UserError(
        f"{path}: the {role}'s tokenizer has neither an unk_token nor an eos_token: vLLM's heterogeneous "
        "vocabulary maps the tokens outside the two vocabularies' intersection to one of them and refuses to start "
        "without; set unk_token or eos_token in its tokenizer_config.json"
    )


def first_ids(vocab: dict[str, int], prefixes: tuple[str, ...]) -> tuple[dict[str, int], set[str]]:
    """(normalized string -> its first id, the strings more than one id normalizes to). vLLM's
    "first" is get_vocab()'s order (vocab_mapping.py:91-101); here the lowest id (module docstring)."""
    kept, shared = {}, set()
    for token, index in sorted(vocab.items(), key=lambda item: item[1]):
        norm = normalized(token, prefixes)
        if norm in kept:
            shared.add(norm)
        else:
            kept[norm] = index
    return kept, shared


@dataclass
class VocabMapping:
    """vLLM's VocabMapping (vocab_mapping.py:67-137) of one target and one draft tokenizer."""

    draft_to_target: torch.Tensor  # [draft vocab] target id, UNMAPPED outside the intersection
    target_to_draft: torch.Tensor  # [target vocab] draft id, UNMAPPED outside the intersection
    target_fallback: int  # the target's unk, else eos
    draft_fallback: int  # the draft's unk, else eos
    ambiguous: int = 0  # intersection strings more than one id of a side normalizes to (module docstring)

    @property
    def intersection(self) -> torch.Tensor:
        """[draft vocab] bool: the draft ids whose logits stay finite (vocab_mapping.py:113, :140)."""
        return self.draft_to_target != UNMAPPED

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids as the draft model reads them (vocab_mapping.py:129-132)."""
        table = self.target_to_draft.to(target_ids.device)
        ids = table[target_ids]
        return torch.where(ids == UNMAPPED, torch.full_like(ids, self.draft_fallback), ids)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids as target ids (vocab_mapping.py:134-137)."""
        table = self.draft_to_target.to(draft_ids.device)
        ids = table[draft_ids]
        return torch.where(ids == UNMAPPED, torch.full_like(ids, self.target_fallback), ids)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """[r] target ids: the argmax of [r, draft vocab] logits constrained to the intersection,
        mapped back (llm_base_proposer.py:441-446)."""
        keep = self.intersection.to(logits.device)
        return self.to_target(logits.masked_fill(~keep, float("-inf")).argmax(dim=-1))

    def tensors(self) -> dict[str, torch.Tensor]:
        """For the results' content hash: the drafts depend on the target's tokenizer too."""
        fallbacks = torch.tensor([self.target_fallback, self.draft_fallback])
        return {
            "vocab_mapping.draft_to_target": self.draft_to_target,
            "vocab_mapping.target_to_draft": self.target_to_draft,
            "vocab_mapping.fallbacks": fallbacks,
        }


def load_tokenizer(path: str, role: str, fix: str):
    from transformers import AutoTokenizer

    if path is None or not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise UserError(f"{path}: no tokenizer ({', '.join(TOKENIZER_FILES)}) of the {role}: {fix}")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as error:
        raise UserError(f"{path}: the {role}'s tokenizer does not load in transformers ({error}): {fix}") from None


def build(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int, paths: tuple[str, str]):
    """vLLM's VocabMapping.__init__ (vocab_mapping.py:67-127); `paths` (target's, draft's) name the
    tokenizers in errors."""
    target_fallback = fallback_id(target_tokenizer, "target", paths[0])
    draft_fallback = fallback_id(draft_tokenizer, "draft model", paths[1])
    target_kept, target_shared = first_ids(target_tokenizer.get_vocab(), space_prefixes(target_tokenizer))
    draft_kept, draft_shared = first_ids(draft_tokenizer.get_vocab(), space_prefixes(draft_tokenizer))
    draft_to_target = torch.full((draft_vocab,), UNMAPPED, dtype=torch.long)
    target_to_draft = torch.full((target_vocab,), UNMAPPED, dtype=torch.long)
    common = set(target_kept) & set(draft_kept)
    for norm in common:
        t, d = target_kept[norm], draft_kept[norm]
        if t < target_vocab and d < draft_vocab:
            draft_to_target[d], target_to_draft[t] = t, d
    ambiguous = len(common & (target_shared | draft_shared))
    return VocabMapping(draft_to_target, target_to_draft, target_fallback, draft_fallback, ambiguous)


def vocab_mapping(target_dir: str | None, draft_dir: str, target_vocab: int, draft_vocab: int, where: str):
    """The mapping of the shards' target tokenizer (`target_dir`, <shards>/tokenizer/; None: the
    shards carry none) and the draft model's own; one error line for a missing tokenizer or one
    with neither unk nor eos."""
    target = load_tokenizer(
        target_dir,
        "target",
        "vLLM's heterogeneous vocabulary maps the target's tokens by their text; re-extract the shards with this "
        "specreplay, which stores the target's tokenizer in <shards>/tokenizer/",
    )
    draft = load_tokenizer(
        draft_dir,
        "draft model",
        "vLLM reads a heterogeneous-vocabulary draft model's tokenizer from its own directory; copy the draft "
        "model's tokenizer files beside its config.json",
    )
    mapping = build(target, draft, target_vocab, draft_vocab, (target_dir, draft_dir))
    if not bool(mapping.intersection.any()):
        raise UserError(f"{where}: the two vocabularies share no token: vLLM's heterogeneous vocabulary needs some")
    if mapping.ambiguous:
        warnings.warn(
            f"{where}: {mapping.ambiguous} tokens of the vocabularies' intersection have several ids on one side "
            "(a space prefix and a literal space); vLLM keeps the one its tokenizer's get_vocab() lists first, an "
            "order that changes between processes; the replay keeps the lowest id",
            stacklevel=2,
        )
    return mapping


# The mapping each heterogeneous draft model was last checked against (the score step checks a
# draft model against the shards, then loads it from a config of its own: the target's side reaches
# the proposer here). Keyed by the draft model's path.
_CHECKED: dict[str, VocabMapping] = {}


def remember(model_dir: str, mapping: VocabMapping) -> None:
    _CHECKED[model_dir] = mapping


def checked(model_dir: str) -> VocabMapping:
    mapping = _CHECKED.get(model_dir)
    if mapping is None:
        raise UserError(
            f"{model_dir}: a heterogeneous-vocabulary draft model maps the target's tokens by their text: it is "
            "loaded only after `score` has checked it against the shards' target tokenizer"
        )
    return mapping
