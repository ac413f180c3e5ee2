"""Measuring what a computation holds: the bytes of tensors alive at once, counted at every aten op
(a TorchDispatchMode), so memory bounds are tested against what really runs, not against the
product's own size arithmetic."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensors alive at once while active (`peak`): a tensor an aten op allocates
    counts from then until the last tensor sharing its storage (itself or a view) is freed;
    tensors from before (inputs, weights) and views of them never count."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [bytes, tensors alive on it]

    def _release(self, ptr: int) -> None:
        entry = self._storages[ptr]
        entry[1] -= 1
        if not entry[1]:
            self.live -= entry[0]
            del self._storages[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or not t.untyped_storage().nbytes():
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._storages:
                if ptr in inputs:  # a view of (or a write into) a tensor from before
                    continue
                self._storages[ptr] = [t.untyped_storage().nbytes(), 0]
                self.live += t.untyped_storage().nbytes()
                self.peak = max(self.peak, self.live)
            self._storages[ptr][1] += 1
            weakref.finalize(t, self._release, ptr)
        return out
