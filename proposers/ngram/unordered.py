"""The iteration order of libstdc++'s `std::unordered_map<int32_t, int32_t>` (GCC 12, the compiler of
the llama-server binary this project builds), which decides llama-server's ngram-cache drafts on
ties: its counts are scanned in container order and the first of equal candidates wins
(common/ngram-cache.cpp:98-144). Keys are token ids; only what ngram-cache does is modelled: insert
one key at a time (never erase), increment, iterate, copy (a copy keeps the order).

libstdc++ (bits/hashtable.h, bits/hashtable_policy.h): the hash of an int is itself, its bucket the
hash modulo the bucket count; the nodes form one singly linked list, each bucket pointing at the node
before its first one. A new key goes to the front of its bucket, or to the front of the whole list
when its bucket is empty (_M_insert_bucket_begin). With max_load_factor 1, an insert that would make
the size exceed the bucket count first rehashes (_M_need_rehash, _M_next_bkt): 1 bucket, then 13 at
the first insert, then the first prime of libstdc++'s table at least twice the current count
(BUCKETS); a rehash walks the list in order and re-links each node to the front of the list when
its new bucket is empty, else after that bucket's before-node (_M_rehash_aux).
"""

from __future__ import annotations

# The bucket counts a map growing one insert at a time goes through: after 1, the first __prime_list
# entry (src/shared/hashtable-aux.cc) >= twice the current count.
BUCKETS = (
    13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229, 172933, 351061,
    712697, 1447153, 2938679, 5967347, 12117689, 24607243, 49969847, 101473717, 206062531,
)  # fmt: skip
BEFORE = None  # the list head's sentinel (_M_before_begin) as a bucket's before-node


class UnorderedCounts:
    """token -> count, iterated in libstdc++'s order."""

    def __init__(self):
        self.counts: dict[int, int] = {}
        self.next: dict[int, int | None] = {}  # the node after each key
        self.head: int | None = None
        self.before: dict[int, int | None] = {}  # bucket -> the node before its first one (BEFORE: the head)
        self.buckets = 1

    def __contains__(self, token: int) -> bool:
        return token in self.counts

    def get(self, token: int) -> int | None:
        return self.counts.get(token)

    def items(self):
        node = self.head
        while node is not None:
            yield node, self.counts[node]
            node = self.next[node]

    def add(self, token: int, count: int = 1) -> None:
        """count more of `token`, inserting it when new."""
        if token in self.counts:
            self.counts[token] += count
            return
        if len(self.counts) + 1 > (self.buckets if self.buckets > 1 else 0):
            self._rehash(BUCKETS[0] if self.buckets == 1 else next(b for b in BUCKETS if b >= 2 * self.buckets))
        self._link(token, token % self.buckets)
        self.counts[token] = count

    def _after(self, node: int | None) -> int | None:
        return self.head if node is BEFORE else self.next[node]

    def _set_after(self, node: int | None, value: int | None) -> None:
        if node is BEFORE:
            self.head = value
        else:
            self.next[node] = value

    def _link(self, token: int, bucket: int) -> None:
        """_M_insert_bucket_begin."""
        if bucket in self.before:
            previous = self.before[bucket]
            self.next[token] = self._after(previous)
            self._set_after(previous, token)
            return
        self.next[token], self.head = self.head, token
        if self.next[token] is not None:
            self.before[self.next[token] % self.buckets] = token
        self.before[bucket] = BEFORE

    def _rehash(self, buckets: int) -> None:
        """_M_rehash_aux for unique keys."""
        node, self.head, self.before, first_bucket = self.head, None, {}, 0
        while node is not None:
            following, bucket = self.next[node], node % buckets
            if bucket not in self.before:
                self.next[node], self.head = self.head, node
                self.before[bucket] = BEFORE
                if self.next[node] is not None:
                    self.before[first_bucket] = node
                first_bucket = bucket
            else:
                previous = self.before[bucket]
                self.next[node] = self._after(previous)
                self._set_after(previous, node)
            node = following
        self.buckets = buckets
