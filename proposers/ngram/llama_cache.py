"""llama-server's `ngram-cache` (common/ngram-cache.cpp; its glue common/speculative.cpp:2024-2161),
the rule read line by line, without the static and dynamic cache files (`-lcs`, `-lcd`: refused by
the layout), so only the slot's context cache drafts.

State, per slot and never reset: the context cache (n-grams of 1 to 4 tokens -> the counts of the
token after them, each in libstdc++'s iteration order: unordered.py) and `cache_size`, the history
length it has seen. begin and accept do nothing.

- draft(H, s) (2096-2139): the tokens since cache_size, and s, are counted as one new chunk: every
  n-gram inside it and its next token (n-grams across the chunk's start are missed; a one-token
  chunk adds nothing); cache_size = |H| + 1. Then up to 8 tokens: for the last 4, 3, 2, 1 tokens of
  H, s and the drafts so far, the first of the most frequent next tokens in container order, when
  the n-gram was seen often enough and that token holds enough of its count (lax thresholds:
  2, 2, 1, 1 samples and 66, 50, 50, 50 percent for 1..4 tokens; ngram-cache.cpp:60-63, 98-144).
"""

from __future__ import annotations

from proposers.ngram.unordered import UnorderedCounts

SIZES = (1, 2, 3, 4)  # LLAMA_NGRAM_MIN .. LLAMA_NGRAM_MAX (common/ngram-cache.h:9-10)
DRAFTS = 8  # n_draft, fixed (speculative.cpp:2191)
MIN_SAMPLES = (2, 2, 1, 1)  # draft_min_sample_size_lax, by n-gram length 1..4
MIN_PERCENT = (66, 50, 50, 50)  # draft_min_percent_lax


class NgramCache:
    """One slot's context cache (module docstring); `tokens` is the sample, H = tokens[:size]."""

    def __init__(self):
        self.context: dict[tuple[int, ...], UnorderedCounts] = {}
        self.cache_size = 0

    def begin(self, tokens: list[int], prompt_len: int) -> None:
        """Nothing: the cache carries over to the next request (speculative.cpp:2091-2093)."""

    def accept(self, accepted: int) -> None:
        """Nothing (speculative.cpp:2158-2160)."""

    def _count(self, chunk: list[int]) -> None:
        """common_ngram_cache_update over a chunk whose every token is new (ngram-cache.cpp:12-52)."""
        for n in SIZES:
            for i in range(n, len(chunk)):
                self.context.setdefault(tuple(chunk[i - n : i]), UnorderedCounts()).add(chunk[i])

    def draft(self, tokens: list[int], size: int) -> list[int]:
        if self.cache_size < size + 1:
            self._count(tokens[self.cache_size : size + 1])
            self.cache_size = size + 1
        sequence = tokens[: size + 1]  # H and s; the drafts are appended
        if len(sequence) < max(SIZES):  # fewer tokens than an n-gram: the server reads out of bounds
            return []
        drafts = []
        while len(drafts) < DRAFTS:
            token = self._next(sequence)
            if token is None:
                break
            sequence.append(token)
            drafts.append(token)
        return drafts

    def _next(self, sequence: list[int]) -> int | None:
        """try_draft over the context cache, the longest n-gram first (ngram-cache.cpp:98-144)."""
        for n in reversed(SIZES):
            counts = self.context.get(tuple(sequence[-n:]))
            if counts is None:
                continue
            best, best_count, total = None, 0, 0
            for token, count in counts.items():  # the first strictly largest wins
                if count > best_count:
                    best, best_count = token, count
                total += count
            if total >= MIN_SAMPLES[n - 1] and 100 * best_count >= MIN_PERCENT[n - 1] * total:
                return best
        return None
