"""llama-server's `ngram-mod` (common/ngram-mod.cpp; its glue common/speculative.cpp:1849-2022), the
rule read line by line.

State: ONE table of 4,194,304 next tokens shared by every slot and request, keyed by a 64-bit LCG
hash of n tokens modulo its size: `add` always overwrites (the last writer wins), `get` returns the
entry without checking the key (a collision or another request's entry drafts a wrong token, which
verification rejects). Per slot: `i_last` (the next window to insert), `n_draft_last` (the last
draft's length before the server's cut) and `n_low` (poor steps in a row, kept across requests).

- begin(P) (1894-1920): i_last = 0, n_draft_last = 0; every window of P added in order; i_last = |P| - n;
  then the whole table is emptied when more than a quarter of it is used (after the prompt went in).
- draft(H, s) (1922-1976): when more than 32 windows wait, they are added (H's windows only: none holds
  s); then from the last n tokens (H's last n-1 and s), up to n_max tokens chained through the table;
  a missing entry before n_min tokens drops the draft, after it ends it.
- accept(a) (1996-2021): after a draft, a / its length below 0.25 is a poor step; the fifth in a row
  empties the table (for every slot) and restarts this slot's i_last at 0.
"""

from __future__ import annotations

SIZE = 4 * 1024 * 1024  # common/ngram-mod.h:16
MULTIPLIER = 6364136223846793005
MASK64 = (1 << 64) - 1
BATCH = 32  # windows waiting before draft() adds them (speculative.cpp:1935)
POOR = 0.25  # accepted / drafted below it is a poor step (speculative.cpp:2003; its comment says 0.5)
POOR_STEPS = 5  # poor steps in a row that reset the table


class Table:
    """The shared table, held sparse: a dict of the used entries."""

    def __init__(self, n: int):
        self.n, self.entries = n, {}

    def index(self, tokens: list[int], start: int) -> int:
        h = 0
        for i in range(self.n):
            h = (h * MULTIPLIER + tokens[start + i]) & MASK64
        return h % SIZE

    def add(self, tokens: list[int], start: int) -> None:
        self.entries[self.index(tokens, start)] = tokens[start + self.n]

    def get(self, tokens: list[int], start: int) -> int | None:
        return self.entries.get(self.index(tokens, start))

    def reset(self) -> None:
        self.entries.clear()


class NgramMod:
    """The table and one slot's state (module docstring); `tokens` is the sample, H = tokens[:size]."""

    def __init__(self, n: int, n_min: int, n_max: int):
        self.table, self.n_min, self.n_max = Table(n), n_min, n_max
        self.i_last = self.n_draft_last = self.n_low = 0

    def begin(self, tokens: list[int], prompt_len: int) -> None:
        self.i_last = self.n_draft_last = 0
        n = self.table.n
        if prompt_len < n:
            return
        for i in range(prompt_len - n):
            self.table.add(tokens, i)
        self.i_last = prompt_len - n
        if len(self.table.entries) > SIZE // 4:
            self.table.reset()

    def draft(self, tokens: list[int], size: int) -> list[int]:
        self.n_draft_last = 0
        n = self.table.n
        if size < n:
            return []
        if self.i_last + BATCH < size:
            for i in range(self.i_last, size - n):
                self.table.add(tokens, i)
            self.i_last = size - n
        chain = tokens[size - n + 1 : size + 1]  # H's last n - 1 tokens and s
        drafts = []
        for i in range(self.n_max):
            token = self.table.get(chain, i)
            if token is None:
                if i < self.n_min:
                    return []
                break
            chain.append(token)
            drafts.append(token)
        self.n_draft_last = len(drafts)
        return drafts

    def accept(self, accepted: int) -> None:
        if self.n_draft_last == 0:
            return
        if accepted / self.n_draft_last < POOR:
            self.n_low += 1
            if self.n_low >= POOR_STEPS:
                self.table.reset()
                self.n_low = self.i_last = 0
        else:
            self.n_low = 0
