"""The fp32 linears of DeepSeek's numerics (router, LM head, compressors) over weights kept in the model's dtype.

    out = fp32_linear_triton(x, weight)      # x [T, K], weight [N, K]: x.float() @ weight.float()^T, [T, N] fp32

DeepSeek computes these in fp32 (`linear(x.float(), weight.float())`). On a bf16 deployment the reference does
that literally, and on a GPU that costs: `weight.float()` writes an fp32 copy of the weight every step and the GEMM
reads it again, for V4-Flash's LM head (129,280 x 4,096) 1 GB read, 2 GB written and 2 GB read a step where 1 GB
would do, and a cuBLAS fp32 GEMM on CUDA cores at large batches. The kernel reads the weight as it is stored and
multiplies exactly in fp32 on the tensor cores: an fp32 x is split into three bf16 parts (x = hi + mid + lo
exactly; bf16 keeps 8 of float32's 24 significant bits; a bf16 x is one part), each part times the bf16 weight is
exact in the fp32 accumulator, so the result is the fp32 product up to the order of the sums. The same holds for the
compressors' projections, which DeepSeek runs in fp32 over bf16 weights it upcasts at load: here they are read as
published, half the bytes. An fp32 weight (the CPU tests' models) takes fp32 dots.

Swap-AB: the weight's rows fill the MMA's M side (BLOCK_N of them), the few tokens of a decode step its N side, so a
decode step's programs stream the weight at full tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.common import (compute_dtype, launch, prefetch_weight_rows, rows_per_program, wait_for_previous_kernel,
                            weight_prefetch_lines)
from kernels.quant_formats import round_to_dtype
from kernels.tuning import tuned


def fp32_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), weight.float())


@triton.jit(do_not_specialize=["num_tokens"])
def _fp32_linear_kernel(x_ptr, w_ptr, out_ptr, num_tokens, n, k, stride_xt, stride_wn, stride_ot,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_PARTS: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, PREFETCH_LINES: tl.constexpr = 0, PDL: tl.constexpr = False):
    """Program (BLOCK_N weight rows, BLOCK_T tokens): acc [BLOCK_N, BLOCK_T] = W x^T over K. X_PARTS 1 or 3: the
    weight is bf16 and x goes in as that many parts on the bf16 grid (a bf16 x is one), each dot in DOT_DTYPE (bf16;
    float32 holding the same values under the interpreter, whose bf16 dots are wrong); 0: float32 dots."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    prefetch_weight_rows(PDL, w_ptr, rows, n, stride_wn, 0, k, PREFETCH_LINES)
    wait_for_previous_kernel(PDL)
    tokens = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask, token_mask = rows < n, tokens < num_tokens
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < k
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        x = tl.load(x_ptr + tokens[None, :].to(tl.int64) * stride_xt + cols[:, None],
                    mask=col_mask[:, None] & token_mask[None, :], other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_T]
        if X_PARTS == 1:
            acc = tl.dot(w.to(DOT_DTYPE), x.to(DOT_DTYPE), acc)
        elif X_PARTS == 3:
            w = w.to(DOT_DTYPE)
            hi = round_to_dtype(x, tl.bfloat16)  # float32 values on the bf16 grid, rounded to nearest
            rest = x - hi  # exact
            mid = round_to_dtype(rest, tl.bfloat16)
            lo = rest - mid  # exact, and on the bf16 grid: what is left of x's 24 bits fits bf16's 8
            acc = tl.dot(w, hi.to(DOT_DTYPE), acc)
            acc = tl.dot(w, mid.to(DOT_DTYPE), acc)
            acc = tl.dot(w, lo.to(DOT_DTYPE), acc)
        else:
            acc = tl.dot(w.to(tl.float32), x, acc, input_precision="ieee")
    tl.store(out_ptr + tokens[None, :].to(tl.int64) * stride_ot + rows[:, None], acc,
             mask=row_mask[:, None] & token_mask[None, :])


def fp32_linear_config(num_tokens: int, n: int, k: int, device: torch.device) -> dict:
    """Tiles of up to 64 tokens and 128 weight rows (fewer when the tiles are too few to give every SM a program: the
    router's 256 rows, a decode step's compressors) by 128 columns (64 for the widest tiles)."""
    block_t = min(64, max(16, triton.next_power_of_2(num_tokens)))
    block_n = rows_per_program(n, triton.cdiv(num_tokens, block_t), 128, device)
    wide = block_t * block_n > 2048  # 8 warps and narrower K steps: the accumulator and stages without spills
    return tuned("fp32_linear", dict(n=n, k=k, tokens=num_tokens),  # tuned per device (kernels/tuning.py)
                 dict(BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=64 if wide else 128, num_warps=8 if wide else 4,
                      num_stages=3))


def plan_fp32_linear(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None):
    """(out [T, N] float32, launches) of `fp32_linear_triton`."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], "x [T, K], weight [N, K]"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "contiguous last dimensions"
    assert weight.dtype in (torch.bfloat16, torch.float32), f"a bf16 or fp32 weight, got {weight.dtype}"
    num_tokens, k = x.shape
    n = weight.shape[0]
    out = torch.empty((num_tokens, n), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out, []
    x_parts = (1 if x.dtype == torch.bfloat16 else 3) if weight.dtype == torch.bfloat16 else 0
    cfg = dict(config or fp32_linear_config(num_tokens, n, k, x.device), X_PARTS=x_parts,
               DOT_DTYPE=compute_dtype(torch.bfloat16))
    cfg["PREFETCH_LINES"] = weight_prefetch_lines(cfg["BLOCK_N"], k * weight.element_size())
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(num_tokens, cfg["BLOCK_T"]))
    return out, [(_fp32_linear_kernel, grid, (x, weight, out, num_tokens, n, k, x.stride(0), weight.stride(0),
                                              out.stride(0)), cfg)]


def fp32_linear_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`fp32_linear_reference` in one launch, x [..., K]."""
    flat = x.reshape(-1, x.shape[-1])
    out, launches = plan_fp32_linear(flat if flat.stride(-1) == 1 else flat.contiguous(), weight)
    launch(launches)
    return out.view(*x.shape[:-1], weight.shape[0])
