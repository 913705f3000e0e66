"""Helpers shared by the kernel host wrappers."""

from __future__ import annotations

import os

import torch
import triton.language as tl


def is_interpreting() -> bool:
    """Whether @triton.jit kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def compute_dtype(dtype: torch.dtype):
    """tl dtype fed to tl.dot: the storage dtype on a GPU; fp32 for bf16 under the interpreter,
    whose bf16 arithmetic is wrong (bf16 values are raw bits there; only casts work)."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and is_interpreting()):
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]
