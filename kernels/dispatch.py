"""The switch between the Triton kernels and their torch references, one per engine.

    kernels = KernelDispatch("auto")   # Triton on CUDA tensors, the references elsewhere
    kernels.sparse_paged_attention(q, ...)

Modes: `auto` (the default); `reference` runs the references on CUDA too, for comparison (the
`use_reference_kernels` engine parameter, or DSV4_REFERENCE_KERNELS=1 when the mode is not
given); `triton` runs the kernels whatever the device — on CPU tensors that takes
TRITON_INTERPRET=1, which is how the tests check the engine's calls into the kernels without a
GPU. The model calls only the methods below, so every hot path has one seam.
"""

from __future__ import annotations

import os

import torch

import torch.nn.functional as F

from kernels.attention import sparse_paged_attention_reference
from kernels.fp8_gemm import Fp8Weight, fp8_gemm_reference
from kernels.indexer import indexer_scores_reference
from kernels.moe import QuantizedExperts, fused_moe_reference, route_hash, route_topk

MODES = ("auto", "reference", "triton")


def default_mode(use_reference: bool = False) -> str:
    return "reference" if use_reference or os.environ.get("DSV4_REFERENCE_KERNELS", "0") == "1" else "auto"


class KernelDispatch:
    def __init__(self, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"kernel dispatch mode must be one of {MODES}, got {mode!r}")
        self.mode = mode

    def use_triton(self, tensor: torch.Tensor) -> bool:
        return self.mode == "triton" or (self.mode == "auto" and tensor.is_cuda)

    def sparse_paged_attention(self, q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.use_triton(q):
            from kernels.attention import sparse_paged_attention_triton

            return sparse_paged_attention_triton(q, *args, **kwargs)
        return sparse_paged_attention_reference(q, *args, **kwargs)

    def indexer_scores(self, q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.use_triton(q):
            from kernels.indexer import indexer_scores_triton

            return indexer_scores_triton(q, *args, **kwargs)
        return indexer_scores_reference(q, *args, **kwargs)

    def fused_moe(self, x: torch.Tensor, topk_ids, topk_weights, w_gate_up, w_down, swiglu_limit) -> torch.Tensor:
        if self.use_triton(x):
            from kernels.moe import fused_moe_triton

            return fused_moe_triton(x, topk_ids, topk_weights, w_gate_up, w_down, swiglu_limit)
        w_gate_up, w_down = (w.dequantize().to(x.dtype) if isinstance(w, QuantizedExperts) else w
                             for w in (w_gate_up, w_down))
        return fused_moe_reference(x, topk_ids, topk_weights, w_gate_up, w_down, swiglu_limit)

    def linear(self, x: torch.Tensor, weight) -> torch.Tensor:
        """x @ weight^T: F.linear for a dense weight, the block-scaled FP8 GEMM for an Fp8Weight."""
        if not isinstance(weight, Fp8Weight):
            return F.linear(x, weight)
        flat = x.reshape(-1, x.shape[-1])
        if self.use_triton(x):
            from kernels.fp8_gemm import fp8_gemm_triton

            out = fp8_gemm_triton(flat.contiguous(), weight.data, weight.scale)
        else:
            out = fp8_gemm_reference(flat, weight.data, weight.scale)
        return out.view(*x.shape[:-1], weight.shape[0])

    # Routing has one (torch) implementation; it goes through here so that a fused kernel can
    # replace it without the model changing.
    @staticmethod
    def route_topk(logits, bias, k: int, routed_scaling_factor: float):
        return route_topk(logits, bias, k, routed_scaling_factor)

    @staticmethod
    def route_hash(logits, tid2eid, input_ids, routed_scaling_factor: float):
        return route_hash(logits, tid2eid, input_ids, routed_scaling_factor)
