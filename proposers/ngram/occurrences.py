"""Where each token occurs in its own sample, as chains the n-gram lookups walk instead of scanning
every earlier position: the same matches, found in time proportional to the occurrences of one
token rather than to the context (long responses stay over a million anchors a second).

For position i (in the samples laid end to end): `prev[i]` / `nxt[i]` the previous / next position
of the same sample holding the same token (-1: none), `first[i]` the first such position (maybe i).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Occurrences:
    prev: np.ndarray  # [sum N] int64
    nxt: np.ndarray  # [sum N] int64
    first: np.ndarray  # [sum N] int64


def occurrences(ids: np.ndarray, lengths: np.ndarray) -> Occurrences:
    """The chains of `ids` [sum N], samples of `lengths` [S] laid end to end."""
    n = ids.shape[0]
    sample = np.repeat(np.arange(lengths.shape[0]), lengths)
    order = np.lexsort((np.arange(n), ids, sample))  # by sample, then token, then position
    same = (sample[order][1:] == sample[order][:-1]) & (ids[order][1:] == ids[order][:-1])
    prev, nxt = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
    prev[order[1:][same]] = order[:-1][same]
    nxt[order[:-1][same]] = order[1:][same]
    heads = np.flatnonzero(np.concatenate([[True], ~same]))  # where each (sample, token) group starts
    group = np.cumsum(np.concatenate([[True], ~same])) - 1
    first = np.empty(n, dtype=np.int64)
    first[order] = order[heads][group]
    return Occurrences(prev, nxt, first)
