"""llama-server's `ngram-map-k` and `ngram-map-k4v` (common/ngram-map.cpp, one map per server slot,
never reset), their rule read line by line. Positions are indices into the slot's history H (the
prompt and the response before the last sampled token s, which comes apart: docs/walk-rules.md).

State: `keys` (each an n-gram's first matched position, its statistics start, how many draft calls
matched it, and up to 4 values: where an m-gram after it starts, how often, and the drafts accepted
the last time it was drafted), `key_map` (262144 buckets of one position each: the first position
indexed wins, a colliding n-gram is not found through it), `key_map_last_idx` (positions indexed so
far), `size_last_begin` (the last prompt's length) and `idx_last_check` (the history's length at the
last call).

- begin(P) (121-219): only when |P| is below the last call's history, the entries at or after a cleanup
  point are dropped (a shorter prompt on the same slot); the map otherwise carries over.
- draft(H, s) (221-516): the key is the last n tokens (H's last n-1 and s); found through its bucket, else
  by scanning the prompt's unindexed part and then the new part, latest first; the new positions are
  indexed (descending, first writer wins). k: the m tokens after the match, at most as many as the
  key's last accepted count. k4v: the key must have min-hits calls; its m-grams after each occurrence
  up to the match are counted (4 slots); no draft unless the most frequent one is at least twice the
  others together; then the tokens after the match, at most that value's last accepted count.
- accept(a) (518-536): the drafted key's (or value's) accepted count becomes a: a draft never grows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_VALUES = 4  # common/ngram-map.h:39
HASH_SIZE = 262144  # ngram-map.h:42
MAX_COUNT = 16380  # ngram-map.cpp:119
MASK32 = 0xFFFFFFFF


def bucket(tokens: list[int], start: int, n: int) -> int:
    """The uint32 LCG over n tokens (ngram-map.cpp:10-20), modulo the map's size."""
    h = 0
    for i in range(n):
        h = (h * 2654435761 + tokens[start + i]) & MASK32
    return h % HASH_SIZE


@dataclass
class Value:
    start: int = 0  # where its m-gram starts (0: an empty slot)
    count: int = 0
    accepted: int = 0  # drafts accepted the last time (m until then)


@dataclass
class Key:
    position: int
    m: int
    stat_from: int = 0
    calls: int = 0
    values: list[Value] = field(default_factory=list)

    def __post_init__(self):
        self.values = [Value(0, 0, self.m) for _ in range(MAX_VALUES)]


class NgramMap:
    """One slot's map (module docstring); `tokens` is the sample, H = tokens[:size]."""

    def __init__(self, n: int, m: int, key_only: bool, min_hits: int):
        self.n, self.m, self.key_only, self.min_hits = n, m, key_only, min_hits
        self.keys: list[Key] = []
        self.key_map = {}  # bucket -> position (an absent bucket is the C++ 0)
        self.indexed_to = 0  # key_map_last_idx
        self.size_last_begin = 0
        self.idx_last_check = 0
        self.last: tuple[int, int] | None = None  # (key, value) of the last draft, for accept

    def begin(self, tokens: list[int], prompt_len: int) -> None:
        """ngram-map.cpp:121-219: a prompt shorter than the last history drops what lies past cleanup."""
        cleanup = self.size_last_begin
        if cleanup > prompt_len:
            cleanup = prompt_len - self.n - self.m if prompt_len > self.n + self.m else 0
        if prompt_len < self.idx_last_check:
            self.key_map = {b: p for b, p in self.key_map.items() if p < cleanup}
            self.indexed_to = cleanup - 1 if cleanup > 0 else 0
            self._drop_keys(cleanup)
        self.idx_last_check = self.size_last_begin = prompt_len

    def _drop_keys(self, cleanup: int) -> None:
        """ngram-map.cpp:171-215: keys at or after cleanup go; a k4v key's values there shift out."""
        kept = []
        for key in self.keys:
            if key.position >= cleanup:
                continue
            if not self.key_only:
                for j in range(MAX_VALUES - 1, -1, -1):
                    if key.values[j].start != 0 and key.values[j].start >= cleanup:
                        last = key.values[MAX_VALUES - 1]
                        key.values[j:] = key.values[j + 1 :] + [Value(0, 0, last.accepted)]
            if key.values[0].start != 0 or self.key_only:
                kept.append(key)
        self.keys = kept

    def draft(self, tokens: list[int], size: int) -> list[int]:
        """ngram-map.cpp:221-516 with H = tokens[:size] and s = tokens[size]."""
        self.last = None
        n, m = self.n, self.m
        if size < 2 * n + m:
            return []
        self.idx_last_check = size
        key = tokens[size - n + 1 : size + 1]
        match = self._find(tokens, size, key)
        self._index(tokens, size)
        if match == 0:
            return []
        offset = self._key_entry(tokens, key, match)
        entry = self.keys[offset]
        entry.calls = min(entry.calls + 1, MAX_COUNT)
        slot = 0 if self.key_only else self._most_frequent(tokens, key, entry, match)
        if slot is None:
            return []
        self.last = (offset, slot)
        return tokens[match + n : match + n + min(m, entry.values[slot].accepted)]

    def _find(self, tokens: list[int], size: int, key: list[int]) -> int:
        """The match position (0: none): the key's bucket, else the prompt's unindexed part, else the
        new part, latest first (ngram-map.cpp:259-312)."""
        n, m, begun = self.n, self.m, self.size_last_begin
        at = self.key_map.get(bucket(key, 0, n), 0)
        if at != 0 and at < size - n - m - 1 and tokens[at : at + n] == key:
            return at
        ranges = [range(begun - n - m - 1, self.indexed_to, -1)] if begun > n + m + 1 else []
        ranges.append(range(size - n - m - 1, max(begun, self.indexed_to), -1))
        for positions in ranges:
            for j in positions:
                if tokens[j : j + n] == key:
                    return j
        return 0

    def _index(self, tokens: list[int], size: int) -> None:
        """ngram-map.cpp:318-340: the new positions, descending, into empty buckets only."""
        n, m, begun = self.n, self.m, self.size_last_begin
        ranges = [range(begun - n - m - 1, self.indexed_to, -1)] if begun > n + m + 1 else []
        ranges.append(range(size - n - m - 1, max(begun, self.indexed_to), -1))
        for positions in ranges:
            for j in positions:
                self.key_map.setdefault(bucket(tokens, j, n), j)
        self.indexed_to = max(size - n - m - 1, self.indexed_to)

    def _key_entry(self, tokens: list[int], key: list[int], match: int) -> int:
        """ngram-map.cpp:347-373: the first key whose n-gram (read in H now) is this one, else a new one."""
        n = self.n
        for offset, entry in enumerate(self.keys):
            if tokens[entry.position : entry.position + n] == key:
                return offset
        self.keys.append(Key(match, self.m))
        return len(self.keys) - 1

    def _most_frequent(self, tokens: list[int], key: list[int], entry: Key, match: int) -> int | None:
        """k4v (ngram-map.cpp:401-499): the value slot to draft from, or None (too few calls, no clear winner)."""
        if entry.calls < self.min_hits:
            return None
        self._count_values(tokens, key, entry, match)
        counts = [v.count for v in entry.values]
        best = max(range(MAX_VALUES), key=lambda v: (counts[v], -v)) if max(counts) > 0 else 0
        others = sum(counts) - counts[best]
        return None if others > 0 and counts[best] < 2 * others else best

    def _count_values(self, tokens: list[int], key: list[int], entry: Key, match: int) -> None:
        """ngram-map.cpp:411-458: the m-gram after every occurrence from stat_from to match, inclusive."""
        n, m = self.n, self.m
        for i in range(entry.stat_from, match + 1):
            if tokens[i : i + n] != key:
                continue
            after = i + n
            for value in entry.values:
                if value.start == 0:
                    value.start, value.count, value.accepted = after, 0, m
                elif tokens[after : after + m] != tokens[value.start : value.start + m]:
                    continue
                value.count = min(value.count + 1, MAX_COUNT)
                break
        entry.stat_from = match

    def accept(self, accepted: int) -> None:
        """ngram-map.cpp:518-536: the drafted key's (value's) count becomes the accepted drafts."""
        if self.last is not None:
            offset, slot = self.last
            self.keys[offset].values[slot].accepted = accepted
