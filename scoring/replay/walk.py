"""The simulated decoding walk: the path an online speculative-decoding loop takes.

Offline replay is exact because, for a response that is the target's own greedy output, the
target's argmax after any prefix is the next stored token: the step taken at anchor t produces
`produced(t)` tokens (computed for every anchor by the replay), and the online loop visits
t0 = prompt_len, t1 = t0 + produced(t0), ... until the response is complete.

The semantics, in words: docs/walk.md.
"""

from __future__ import annotations

from typing import Callable, Hashable

import numpy as np
import torch


def stop_mask(input_ids: torch.Tensor, stop_token_ids: list[int]) -> torch.Tensor:
    """[N] bool: where the sequence holds a stop token."""
    return torch.isin(input_ids, torch.tensor(stop_token_ids, dtype=input_ids.dtype))


def next_stop_positions(is_stop: torch.Tensor) -> torch.Tensor:
    """next_stop[t] = the first position > t holding a stop token, or N + 1 if none. [N] int64."""
    n = is_stop.numel()
    positions = torch.where(is_stop, torch.arange(n), torch.full((n,), n + 1))
    # suffix minimum over positions > t
    shifted = torch.cat([positions[1:], torch.tensor([n + 1])])
    return torch.flip(torch.cummin(torch.flip(shifted, [0]), dim=0).values, [0])


def walk_finished(position: int, is_stop: torch.Tensor) -> bool:
    """The online loop stops once the response is complete or its last token is a stop token."""
    return position >= is_stop.numel() - 1 or bool(is_stop[position])


def walk(produced: torch.Tensor, prompt_len: int, is_stop: torch.Tensor) -> list[tuple[int, int]]:
    """Steps (anchor, produced) the online loop takes. `produced[i]` belongs to anchor
    prompt_len + i (anchors prompt_len .. N - 2); is_stop [N] marks stop tokens. No step when
    the first response token is already a stop token; the walk ends when the response is
    complete or a step ended on a stop token (`produced` is already cut there)."""
    values = produced.tolist()
    steps = []
    start = prompt_len
    while not walk_finished(start, is_stop):
        step = values[start - prompt_len]
        steps.append((start, step))
        start += step
    return steps


def walk_in_rounds(
    starts: dict[Hashable, int],
    finished: Callable[[Hashable, int], bool],
    score: Callable[[list[tuple[Hashable, int]]], None],
    produced: Callable[[Hashable, int], int],
) -> dict[Hashable, int]:
    """Advance many walks together, as walk-only replay does: each round `score`s the current
    anchor of every unfinished walk in one call, then moves each walk on by what its step
    produced there. Walks start at `starts[key]` and end when `finished(key, position)`
    (see walk_finished); returns the final positions. Equal to calling `walk` per key."""
    positions = dict(starts)
    active = {key for key, position in positions.items() if not finished(key, position)}
    while active:
        score(sorted((key, positions[key]) for key in active))
        for key in sorted(active):
            positions[key] += produced(key, positions[key])
            if finished(key, positions[key]):
                active.discard(key)
    return positions


def walk_end(prompt_len: int, is_stop: torch.Tensor) -> int:
    """Where every walk over this response ends, whatever its steps: the first stop token at or
    after prompt_len, else the last position (a step never jumps past either: `produced` is
    capped by the response and cut just after the first stop)."""
    last = is_stop.numel() - 1
    stops = torch.nonzero(is_stop[prompt_len:last]).flatten()
    return prompt_len + int(stops[0]) if stops.numel() else max(prompt_len, last)


def steps_distribution(produced_probs: torch.Tensor, prompt_len: int, end: int) -> torch.Tensor:
    """P(S = s) for s = 0..end - prompt_len: the number of steps the walk takes from prompt_len
    to `end` when the step at anchor prompt_len + i produces n tokens with probability
    produced_probs[i, n]. Backward over positions, f_t(s) = sum_n P_t(n) f_{t+n}(s - 1), keeping
    only the last L + 2 positions' vectors (memory O(L * R), time O(L * R^2) for R tokens)."""
    tokens = end - prompt_len
    width = produced_probs.shape[1]
    window: dict[int, np.ndarray] = {end: np.eye(1, tokens + 1, 0)[0]}  # f_end = delta at 0 steps
    probs = produced_probs.double().numpy()
    for t in range(end - 1, prompt_len - 1, -1):
        f = np.zeros(tokens + 1)
        for n in range(1, width):
            weight = probs[t - prompt_len, n]
            if weight > 0 and t + n <= end:
                f[1:] += weight * window[t + n][:-1]
        window[t] = f
        window.pop(t + width, None)
    return torch.from_numpy(window[prompt_len])


def expected_tau(steps: torch.Tensor, tokens: int) -> tuple[float | None, float]:
    """(E[N/S], E[S]) from P(S = s): the loop reports N/S for a response of N produced tokens,
    so its expected tau is N * sum_s P(S = s) / s, not N / E[S] (Jensen). None when N = 0."""
    s = torch.arange(steps.numel(), dtype=torch.float64)
    expected_steps = float((steps * s).sum())
    if tokens == 0:
        return None, expected_steps
    return float(tokens * (steps[1:] / s[1:]).sum()), expected_steps
