"""torchrun plumbing shared by both stages: which rank am I, and a process group to sync on.

Data parallelism only: each rank takes every world-th item of a deterministic list, and rank 0
merges. NCCL when CUDA is present (one GPU per rank), gloo on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def dist_from_env() -> Dist:
    return Dist(
        int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    )


def init_dist(dist: Dist) -> None:
    if dist.world > 1 and not torch.distributed.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(dist.local_rank)  # NCCL collectives run on the current device
            torch.distributed.init_process_group("nccl")
        else:
            torch.distributed.init_process_group("gloo")


def leave_dist(dist: Dist) -> None:
    """Tear the process group down before exit: left to the interpreter's exit, gloo's threads
    can be destroyed while still joinable, and the rank aborts ("terminate called without an
    active exception") after its work is done."""
    if dist.world > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def barrier(dist: Dist) -> None:
    if dist.world > 1:
        torch.distributed.barrier()


def resolve_device(device: str | None, dist: Dist) -> str:
    """None = cuda when available else cpu; with several ranks, one GPU per rank."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and dist.world > 1:
        device = f"cuda:{dist.local_rank}"
    return device
