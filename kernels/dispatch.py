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

import importlib
import os

import torch
import torch.nn.functional as F

from kernels.attention import sparse_paged_attention_reference
from kernels.fp8_gemm import Fp8Weight, fp8_gemm_reference
from kernels.indexer import indexer_scores_reference
from kernels.moe import QuantizedExperts, fused_moe_reference

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

    def fused_moe(self, x: torch.Tensor, topk_ids, topk_weights, w_gate_up, w_down, swiglu_limit, *,
                  out_dtype: torch.dtype | None = None, deepseek_order: bool = False,
                  quantize_hidden: bool = False) -> torch.Tensor:
        """Routed experts; out_dtype=torch.float32 returns the kernel's fp32 accumulator (no cast launch);
        deepseek_order / quantize_hidden: DeepSeek's routing-weight order and act_quant of the down projection's
        input (kernels/moe.py)."""
        order = dict(deepseek_order=deepseek_order, quantize_hidden=quantize_hidden)
        if self.use_triton(x):
            from kernels.moe import fused_moe_triton

            return fused_moe_triton(x, topk_ids, topk_weights, w_gate_up, w_down, swiglu_limit, out_dtype=out_dtype,
                                    **order)
        w_gate_up, w_down = (w.dequantize().to(x.dtype) if isinstance(w, QuantizedExperts) else w
                             for w in (w_gate_up, w_down))
        return fused_moe_reference(x, topk_ids, topk_weights, w_gate_up, w_down, swiglu_limit, out_dtype=out_dtype,
                                   **order)

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

    # --- the fused kernels of one layer: `<name>_triton` or `<name>_reference` of kernels/<module>.py --------
    def _fused(self, module: str, name: str, tensor: torch.Tensor, *args, **kwargs):
        implementation = "triton" if self.use_triton(tensor) else "reference"
        return getattr(importlib.import_module(f"kernels.{module}"), f"{name}_{implementation}")(*args, **kwargs)

    def hc_collapse(self, streams, *args, **kwargs):
        """mHC collapse + the block's RMSNorm -> (post, comb, x)."""
        return self._fused("mhc", "hc_collapse", streams, streams, *args, **kwargs)

    def hc_mix(self, streams, *args, **kwargs):
        """mHC mix of one (or the sum of two) block outputs into the streams."""
        return self._fused("mhc", "hc_mix", streams, streams, *args, **kwargs)

    def hc_head(self, streams, *args, **kwargs):
        return self._fused("mhc", "hc_head", streams, streams, *args, **kwargs)

    def norm_rope(self, x, *args, **kwargs):
        """RMSNorm and/or RoPE, optionally stored into a paged pool."""
        return self._fused("norm_rope", "norm_rope", x, x, *args, **kwargs)

    def compress_into_pool(self, kv, *args, **kwargs):
        """Close a compressor's windows into its pool and update its ring."""
        return self._fused("compressor", "compress_into_pool", kv, kv, *args, **kwargs)

    def compress_entries(self, kv, *args, **kwargs):
        """Close a compressor's windows (the entries, for the caller to store) and update its ring."""
        return self._fused("compressor", "compress_entries", kv, kv, *args, **kwargs)

    def store_indexer_fp4(self, keys, pool, rows) -> None:
        """Rotated indexer keys encoded as FP4 pairs with their scales into rows of a uint8 pool."""
        self._fused("kv_store", "store_indexer_fp4", keys, keys, pool, rows)

    def route_topk(self, logits, *args, **kwargs):
        return self._fused("moe", "route_topk", logits, logits, *args, **kwargs)

    def route_hash(self, logits, *args, **kwargs):
        return self._fused("moe", "route_hash", logits, logits, *args, **kwargs)

    def apply_token_bitmask(self, logits, bitmask, rows) -> None:
        """Structured outputs: -inf, in place, at the tokens each masked row's grammar does not allow."""
        self._fused("token_bitmask", "apply_token_bitmask", logits, logits, bitmask, rows)

    def swiglu(self, gate_up, limit: float):
        """The shared expert's clamped SwiGLU on its fused gate|up product."""
        return self._fused("moe", "swiglu", gate_up, gate_up, limit)
