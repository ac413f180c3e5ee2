"""Whether a draft model may draft for the shards' target: llama-server's rule
(common/speculative.cpp:67-127, common_speculative_are_compatible; the server refuses to start
otherwise), read in transformers' terms, before the draft model is loaded:

- the same kind of vocabulary (llama.cpp's vocab type: the fast tokenizer's model, BPE, Unigram ...);
- the same BOS when either adds one, the same EOS when either adds one (:84-98);
- vocabularies (embedding rows: the converter pads the GGUF's token list to them) at most 128 apart
  (:101-113);
- the same text for every token id from 5 to the smaller vocabulary's end (:115-125).

The target's side is the manifest's vocabulary and the tokenizer extract stored with the shards
(<shards>/tokenizer/); shards from before that was stored are checked by size alone, said in a note.
vLLM's `use_heterogeneous_vocab` skips these checks and maps another vocabulary (vocab_mapping.py).
"""

from __future__ import annotations

import os
import warnings

from pipeline.common.errors import UserError

MAX_SIZE_DIFFERENCE = 128  # SPEC_VOCAB_MAX_SIZE_DIFFERENCE
FIRST_CHECKED_ID = 5  # SPEC_VOCAB_CHECK_START_TOKEN_ID
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class VocabularyError(UserError):
    """The draft model's vocabulary is not the target's."""


def _tokenizer(path: str, what: str):
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise VocabularyError(
            f"{path}: no tokenizer ({', '.join(TOKENIZER_FILES)}): {what}'s vocabulary cannot be checked against the "
            "target's; copy the tokenizer files its GGUF was converted with beside its config.json"
        )
    return AutoTokenizer.from_pretrained(path)


def _kind(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(backend.model).__name__ if backend is not None else type(tokenizer).__name__


def _adds(tokenizer) -> tuple[int | None, int | None]:
    """(BOS id if encoding adds one, EOS id if encoding adds one)."""
    ids = tokenizer("a").input_ids
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return (
        bos if bos is not None and ids[:1] == [bos] else None,
        eos if eos is not None and ids[-1:] == [eos] else None,
    )


def _first_different(draft, target, end: int) -> int | None:
    """The first id in FIRST_CHECKED_ID..end-1 whose token text differs (an id only one knows differs)."""
    texts = [t.convert_ids_to_tokens(list(range(FIRST_CHECKED_ID, end))) for t in (draft, target)]
    return next((FIRST_CHECKED_ID + i for i, (a, b) in enumerate(zip(*texts)) if a != b), None)


def check_sizes(draft_vocab: int, target_vocab: int, where: str) -> None:
    if abs(draft_vocab - target_vocab) > MAX_SIZE_DIFFERENCE:
        raise VocabularyError(
            f"{where}: the draft model's vocabulary has {draft_vocab} tokens, the target's {target_vocab}: more than "
            f"{MAX_SIZE_DIFFERENCE} apart, which llama-server refuses; a draft model needs the target's tokenizer"
        )


def check_tokenizers(draft_dir: str, target_dir: str, draft_vocab: int, target_vocab: int, where: str) -> None:
    draft, target = _tokenizer(draft_dir, "the draft model"), _tokenizer(target_dir, "the target")
    if _kind(draft) != _kind(target):
        raise VocabularyError(f"{where}: the draft model's tokenizer is {_kind(draft)}, the target's {_kind(target)}")
    for name, mine, theirs in zip(("BOS", "EOS"), _adds(draft), _adds(target)):
        if mine != theirs:
            raise VocabularyError(
                f"{where}: the draft model's tokenizer adds {name} {mine}, the target's {theirs} (None: adds none)"
            )
    different = _first_different(draft, target, min(draft_vocab, target_vocab))
    if different is not None:
        texts = [t.convert_ids_to_tokens(different) for t in (draft, target)]
        raise VocabularyError(
            f"{where}: token {different} is {texts[0]!r} in the draft model's tokenizer and {texts[1]!r} in the "
            "target's: another tokenizer, which llama-server refuses; a draft model needs the target's tokenizer"
        )


def check_vocabulary(draft_dir: str, draft_vocab: int, target_vocab: int, tokenizer_dir: str | None, where: str):
    """VocabularyError unless the draft model may draft for the target (the module docstring's rule)."""
    check_sizes(draft_vocab, target_vocab, where)
    if tokenizer_dir is None:
        warnings.warn(
            f"{where}: the shards carry no target tokenizer (extracted before specreplay stored one): the draft "
            "model's vocabulary is checked by its size alone",
            stacklevel=2,
        )
        return
    check_tokenizers(draft_dir, tokenizer_dir, draft_vocab, target_vocab, where)
