"""One switch between the Triton kernels and the torch references.

By default CUDA tensors go to the Triton kernels and everything else to the references.
`set_mode("reference")` (or DSV4_REFERENCE_KERNELS=1) runs the references on CUDA too, for
comparison; `set_mode("triton")` runs the kernels whatever the device — on CPU tensors that takes
TRITON_INTERPRET=1, which is how the tests check the engine's calls into the kernels without a GPU.
The engine calls only the functions below.
"""

from __future__ import annotations

import os

import torch

from kernels.attention import sparse_paged_attention_reference
from kernels.indexer import indexer_scores_reference
from kernels.moe import fused_moe_reference

MODES = ("auto", "reference", "triton")
_mode = "reference" if os.environ.get("DSV4_REFERENCE_KERNELS", "0") == "1" else "auto"


def set_mode(mode: str) -> None:
    global _mode
    if mode not in MODES:
        raise ValueError(f"kernel dispatch mode must be one of {MODES}, got {mode!r}")
    _mode = mode


def get_mode() -> str:
    return _mode


def set_force_reference(flag: bool) -> None:
    set_mode("reference" if flag else "auto")


def use_triton(tensor: torch.Tensor) -> bool:
    return _mode == "triton" or (_mode == "auto" and tensor.is_cuda)


def sparse_paged_attention(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if use_triton(q):
        from kernels.attention import sparse_paged_attention_triton

        return sparse_paged_attention_triton(q, *args, **kwargs)
    return sparse_paged_attention_reference(q, *args, **kwargs)


def indexer_scores(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if use_triton(q):
        from kernels.indexer import indexer_scores_triton

        return indexer_scores_triton(q, *args, **kwargs)
    return indexer_scores_reference(q, *args, **kwargs)


def fused_moe(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if use_triton(x):
        from kernels.moe import fused_moe_triton

        return fused_moe_triton(x, *args, **kwargs)
    return fused_moe_reference(x, *args, **kwargs)
