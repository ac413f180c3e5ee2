"""One dtype vocabulary for both stages: the names a user may type (`--dtype`, `--feature-dtype`),
what "auto" means, the names the manifest and run.json record, and safetensors' names."""

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

# Feature storage beyond the compute dtypes: e4m3 with one scale per token and layer (lossy).
FP8 = "float8_e4m3fn"
FP8_NAMES = (FP8, "fp8")

# What the manifest's "tensors" record and the shards store, by name.
STORAGE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    FP8: torch.float8_e4m3fn,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
STORAGE_NAMES = {v: k for k, v in STORAGE_DTYPES.items()}

# safetensors' header names of the dtypes the target head is stored in.
SAFETENSORS_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


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
