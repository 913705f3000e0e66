"""One switch between the Triton kernels (CUDA tensors) and the torch references (everything else).

`set_force_reference(True)` (or DSV4_REFERENCE_KERNELS=1) runs the references on CUDA too, for
comparison. The engine calls only the functions below.
"""

from __future__ import annotations

import os

import torch

from kernels.attention import sparse_paged_attention_reference
from kernels.indexer import indexer_scores_reference
from kernels.moe import fused_moe_reference

_force_reference = os.environ.get("DSV4_REFERENCE_KERNELS", "0") == "1"


def set_force_reference(flag: bool) -> None:
    global _force_reference
    _force_reference = bool(flag)


def use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and not _force_reference


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
