"""One dtype vocabulary for both stages: the names a user may type and what "auto" means."""

from __future__ import annotations

import torch

from pipeline.common.errors import UserError

COMPUTE_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def is_cuda(device) -> bool:
    """True for a CUDA device name; "auto" (a device map over the node's GPUs) when one exists."""
    if str(device) == "auto":
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def resolve_dtype(dtype: str | torch.dtype, device="cpu", option: str = "--dtype") -> torch.dtype:
    """ "auto" = float32 on CPU (exact greedy parity), bfloat16 on CUDA; else a name above."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key == "auto":
        return torch.bfloat16 if is_cuda(device) else torch.float32
    if key not in COMPUTE_DTYPES:
        raise UserError(f"{option} {dtype!r} is not supported; use one of auto, {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """The name run.json and the manifest record: "float32", "bfloat16", ..."""
    return str(dtype).removeprefix("torch.")
