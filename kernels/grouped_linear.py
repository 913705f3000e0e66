"""The attention output's grouped projection (`o_a_proj`, DeepSeek's `wo_a`) with its weight kept FP8.

    out = grouped_linear_triton(x, weight)   # x [T, G, K], weight Fp8Weight [G * R, K] -> [T, G * R] in x's dtype

out[t, g * R + r] = sum_k x[t, g, k] * W[g * R + r, k]: each of the G groups of a token's attention output (K values)
times its own R rows of the weight. DeepSeek dequantizes `wo_a` to bf16 when it converts the checkpoint and runs a
bf16 einsum; the engine did the same at load, so V4-Flash's 43 layers held and read 2.9 GB of it per decode step in
bf16 (67 MB a layer), twice its published FP8 bytes. Here the weight stays FP8 (e4m3, a float32 scale per 128 x 128
block) and each tile is converted in registers, four codes a 32-bit word with integer operations and no conversion
instruction (`quant_formats.e4m3_words_to_values`): the e4m3 value is exact in bf16, the product with the bf16
activations exact in the fp32 accumulator, and each 128-wide K step's sum is multiplied by its block's power-of-two
scale (exact), so the result is the bf16 einsum's up to the order of the sums. A dense weight (weight_format
dequantize) is a plain batched matmul.

Swap-AB: the weight's rows on the MMA's M side (BLOCK_N of them, inside one group), the tokens on its N side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import (aligned_words, compute_dtype, launch, prefetch_weight_rows, rows_per_program,
                            wait_for_previous_kernel, weight_prefetch_lines)
from kernels.fp8_gemm import Fp8Weight
from kernels.quant_formats import FP8_BLOCK, dequantize_fp8, e4m3_words_to_values
from kernels.tuning import tuned


def grouped_linear_reference(x: torch.Tensor, weight) -> torch.Tensor:
    """x [T, G, K] by the G groups of weight [G * R, K] (dense, or an Fp8Weight dequantized to x's dtype)."""
    num_tokens, groups, k = x.shape
    dense = dequantize_fp8(weight.data, weight.scale).to(x.dtype) if isinstance(weight, Fp8Weight) else weight
    w = dense.view(groups, -1, k)  # [G, R, K]
    return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).reshape(num_tokens, -1)


@triton.jit(do_not_specialize=["num_tokens"])
def _grouped_fp8_kernel(x_ptr, w_ptr, s_ptr, out_ptr, num_tokens, rows_per_group, k, stride_xt, stride_xg,
                        stride_wn, stride_sn, stride_ot, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, PREFETCH_LINES: tl.constexpr = 0,
                        PDL: tl.constexpr = False):
    """Program (BLOCK_N rows of one group, BLOCK_T tokens): acc [BLOCK_N, BLOCK_T] = W_g x_g^T, a 128-wide K step at a
    time times its block scale."""
    tiles_per_group = tl.cdiv(rows_per_group, BLOCK_N)
    group = tl.program_id(0) // tiles_per_group
    local = (tl.program_id(0) % tiles_per_group) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = group * rows_per_group + local
    prefetch_weight_rows(PDL, w_ptr, rows, (group + 1) * rows_per_group, stride_wn, 0, k, PREFETCH_LINES)
    wait_for_previous_kernel(PDL)
    tokens = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask, token_mask = local < rows_per_group, tokens < num_tokens
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    word_rows = (w_ptr + rows[:, None].to(tl.int64) * stride_wn).to(tl.pointer_type(tl.int32))
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        words = k0 // 4 + tl.arange(0, BLOCK_K // 4)  # four codes a word (k % 4 == 0): no conversion instruction
        w = tl.load(word_rows + words[None, :], mask=row_mask[:, None] & (words < k // 4)[None, :], other=0)
        x = tl.load(x_ptr + tokens[None, :].to(tl.int64) * stride_xt + group * stride_xg + ks[:, None],
                    mask=k_mask[:, None] & token_mask[None, :], other=0.0)
        product = tl.dot(e4m3_words_to_values(w, COMPUTE_DTYPE), x.to(COMPUTE_DTYPE))
        scale = tl.load(s_ptr + (rows // 128) * stride_sn + k0 // 128, mask=row_mask, other=0.0)
        acc += product * scale[:, None]
    tl.store(out_ptr + tokens[None, :].to(tl.int64) * stride_ot + rows[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & token_mask[None, :])


def grouped_fp8_config(num_tokens: int, num_rows: int, k: int, device: torch.device) -> dict:
    """128-wide K steps (the scale blocks), up to 64 tokens, 64 weight rows (fewer when the tiles are too few to give
    every SM a program: V4-Flash's 8 groups of 1,024 rows at one token are 256 tiles of 32).

    A weight tile is decoded in the registers of the warps that multiply it, so warps side by side along the tokens
    would each decode it again (Triton's mma.sync layout puts the 4 warps of a 32 x 16 tile 2 by 2: every code
    decoded twice, read in SASS). 64 rows take a wgmma, one warpgroup over all of them; 32 rows (16 tokens only) two
    warps, one per 16 rows."""
    block_t = min(64, max(16, triton.next_power_of_2(num_tokens)))
    block_n = rows_per_program(num_rows, triton.cdiv(num_tokens, block_t), 64, device,
                               smallest=32 if block_t == 16 else 64)
    return tuned("grouped_fp8", dict(rows=num_rows, k=k, tokens=num_tokens),  # tuned per device (kernels/tuning.py)
                 dict(BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=FP8_BLOCK, num_warps=4 if block_n >= 64 else 2,
                      num_stages=3))


def plan_grouped_linear(x: torch.Tensor, weight: Fp8Weight, config: dict | None = None):
    """(out [T, G * R] in x's dtype, launches) of `grouped_linear_triton`."""
    num_tokens, groups, k = x.shape
    num_rows = weight.shape[0]
    assert isinstance(weight, Fp8Weight) and weight.shape[1] == k and num_rows % groups == 0, \
        f"weight [G * R, {k}] FP8 for x [T, {groups}, {k}], got {weight.shape}"
    rows_per_group = num_rows // groups  # (any count: each row reads its own block's scale)
    assert x.stride(2) == 1 and weight.data.stride(1) == 1, "contiguous last dimensions"
    assert k % 4 == 0 and weight.data.stride(0) % 4 == 0 and aligned_words(weight.data), \
        f"the kernel reads the weight's rows as int32 words: K={k}"
    out = torch.empty((num_tokens, num_rows), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out, []
    cfg = dict(config or grouped_fp8_config(num_tokens, num_rows, k, x.device), COMPUTE_DTYPE=compute_dtype(x.dtype))
    assert FP8_BLOCK % cfg["BLOCK_K"] == 0, \
        f"grouped fp8: K steps within one {FP8_BLOCK}-wide block of the scales (each step reads one), got {cfg}"
    cfg["PREFETCH_LINES"] = weight_prefetch_lines(cfg["BLOCK_N"], k)
    grid = (groups * triton.cdiv(rows_per_group, cfg["BLOCK_N"]), triton.cdiv(num_tokens, cfg["BLOCK_T"]))
    args = (x, weight.data, weight.scale, out, num_tokens, rows_per_group, k, x.stride(0), x.stride(1),
            weight.data.stride(0), weight.scale.stride(0), out.stride(0))
    return out, [(_grouped_fp8_kernel, grid, args, cfg)]


def grouped_linear_triton(x: torch.Tensor, weight) -> torch.Tensor:
    """`grouped_linear_reference` in one launch for an Fp8Weight (a dense weight: the batched matmul)."""
    if not isinstance(weight, Fp8Weight):
        return grouped_linear_reference(x, weight)
    out, launches = plan_grouped_linear(x, weight)
    launch(launches)
    return out
