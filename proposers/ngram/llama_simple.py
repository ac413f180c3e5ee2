"""llama-server's `--spec-type ngram-simple` (common/ngram-map.cpp:49-112, common_ngram_simple_draft),
its rule read line by line, at every anchor.

At anchor t the server's history H is x_0 .. x_{t-1} (the prompt and the response before the last
sampled token) and the last sampled token x_t comes separately (tools/server/server-context.cpp:
3005-3014, common/speculative.cpp:1786). With L = t, n = size-n and m = size-m:
  - no draft while L <= n + m + 1;
  - the pattern is x_{t-n+1} .. x_t; the match is the latest j in L-n-1 .. 1 with
    H[j .. j+n-1] equal to it (position 0 is never tried);
  - no draft without a match, nor when fewer than n tokens follow it inside H (no older match is
    tried then);
  - otherwise the drafts are H[j+n .. j+n+min(m, L-j-n)-1].
It keeps no state (begin, accept do nothing), so teacher forcing is exact. The server then cuts the
draft to its budget (walk rule llama.cpp); `--spec-draft-n-max` does not apply.
"""

from __future__ import annotations

import numba


@numba.njit(cache=True, nogil=True)
def _latest_match(ids, start, anchor, n, prev) -> int:
    """The latest j in history - n - 1 .. 1 with H[j .. j+n-1] = x_{t-n+1} .. x_t, or 0: the earlier
    occurrences e of x_t (occurrences.py), latest first, end such a window at e = j + n - 1."""
    pattern, e = start + anchor - n + 1, prev[start + anchor]
    while e != -1 and e - start > anchor - 2:  # a window ending there starts after history - n - 1
        e = prev[e]
    while e != -1:
        j = e - start - n + 1
        if j < 1:  # position 0 is never tried, and every further occurrence is earlier
            return 0
        same = True
        for k in range(n - 1):  # the last tokens are equal: the chain holds x_t's occurrences
            if ids[start + j + k] != ids[pattern + k]:
                same = False
                break
        if same:
            return j
        e = prev[e]
    return 0


@numba.njit(cache=True, nogil=True)
def _simple(ids, start, anchor, n, m, out, prev) -> int:
    """Drafts at `anchor` of the sample starting at ids[start] into out; returns how many."""
    history = anchor  # H = x_0 .. x_{t-1}
    if history <= n + m + 1:
        return 0
    match = _latest_match(ids, start, anchor, n, prev)
    if match == 0:
        return 0
    count = min(m, history - (match + n))
    if count < n:
        return 0
    for j in range(count):
        out[j] = ids[start + match + n + j]
    return count


@numba.njit(cache=True, nogil=True)
def simple_drafts(ids, starts, anchors, n, m, out, counts, prev) -> None:
    """For anchor i (position anchors[i] of the sample starting at starts[i] in ids): its drafts in
    out[i] and their number in counts[i]; prev: the occurrence chain of ids (occurrences.py)."""
    for i in range(anchors.shape[0]):
        counts[i] = _simple(ids, starts[i], anchors[i], n, m, out[i], prev)
