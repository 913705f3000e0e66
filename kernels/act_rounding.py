"""DeepSeek's in-place activation quantizers on the GPU path, one launch each (under `numerics=deepseek`).

    round_activations_triton(x)       # x [..., K]: act_quant(inplace=True), e4m3 per 128 columns
    round_indexer_triton(x)           # x [..., Di]: rotate_activation, then fp4_act_quant(inplace=True) per 32

Each returns x's values as DeepSeek's inference leaves them (quantized and multiplied back by their power-of-two
scales, in x's dtype); the references are `simulate_quantization` and `simulate_indexer_fp4` (kernels/quant_formats.py),
a dozen and about forty torch operators, so a dozen and forty launches on a GPU where one does. Values, not codes:
their readers (the linears dequantized at load, weight_format=dequantize; the indexer's scores) take values. The FP8
GEMMs and the MoE quantize their inputs themselves.

The rotation in registers (`rotate_rows`, kernels/quant_formats.py) takes the reference's butterflies one by one in
float32, the same sums in the same order, so the same bits; the FP4 key store rotates its keys with it too
(kernels/kv_store.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import launch, wait_for_previous_kernel
from kernels.quant_formats import (FP8_ACT_BLOCK, MXFP4_BLOCK, e4m3_groups, indexer_rounded, simulate_indexer_fp4,
                                   simulate_quantization)


def round_activations_reference(x: torch.Tensor) -> torch.Tensor:
    return simulate_quantization(x, FP8_ACT_BLOCK, "e4m3")


def round_indexer_reference(x: torch.Tensor) -> torch.Tensor:
    return simulate_indexer_fp4(x)


@triton.jit(do_not_specialize=["num_rows"])
def _round_kernel(x_ptr, out_ptr, num_rows, num_cols, stride_x, stride_out, BLOCK_R: tl.constexpr,
                  BLOCK_C: tl.constexpr, FP4: tl.constexpr, LOG_C: tl.constexpr, PDL: tl.constexpr = False):
    """Program (BLOCK_R rows, BLOCK_C columns): e4m3 groups of 128 (act_quant), or (FP4) each row of BLOCK_C columns
    rotated, then e2m1 groups of 32, each value times its scale, in out's dtype."""
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if FP4:
        values = indexer_rounded(x, BLOCK_R, BLOCK_C, LOG_C, x_ptr.dtype.element_ty)
    else:
        grid, scale = e4m3_groups(x, BLOCK_R, BLOCK_C)
        values = tl.reshape(tl.reshape(grid, [BLOCK_R, BLOCK_C // 128, 128]) * scale[:, :, None], [BLOCK_R, BLOCK_C])
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], values.to(out_ptr.dtype.element_ty),
             mask=mask)


def plan_round(x: torch.Tensor, fp4: bool):
    """(out like x, launches): `_round_kernel` over x viewed as rows of its last dimension. Activations: tiles of 8 rows
    x 512 columns (fewer where K has fewer); indexer vectors: 16 rows, each whole (its rotation mixes all of it)."""
    cols = x.shape[-1]
    flat = x.reshape(-1, cols)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    if fp4:
        assert cols & (cols - 1) == 0 and cols >= MXFP4_BLOCK, f"indexer width {cols}: a power of two >= 32"
        config = dict(BLOCK_R=16, BLOCK_C=cols, LOG_C=cols.bit_length() - 1, num_warps=4)
    else:
        assert cols % FP8_ACT_BLOCK == 0, f"act_quant's groups of 128 must divide the width, got {cols}"
        config = dict(BLOCK_R=8, BLOCK_C=min(512, triton.next_power_of_2(cols)), LOG_C=0, num_warps=4)
        if cols % config["BLOCK_C"]:
            config["BLOCK_C"] = FP8_ACT_BLOCK
    launches = []
    if flat.shape[0]:
        grid = (triton.cdiv(flat.shape[0], config["BLOCK_R"]), triton.cdiv(cols, config["BLOCK_C"]))
        launches.append((_round_kernel, grid, (flat, out, flat.shape[0], cols, flat.stride(0), out.stride(0)),
                         dict(config, FP4=fp4)))
    return out.view(x.shape), launches


def _run(x: torch.Tensor, fp4: bool) -> torch.Tensor:
    out, launches = plan_round(x, fp4)
    launch(launches)
    return out


def round_activations_triton(x: torch.Tensor) -> torch.Tensor:
    """`round_activations_reference` in one launch."""
    return _run(x, fp4=False)


def round_indexer_triton(x: torch.Tensor) -> torch.Tensor:
    """`round_indexer_reference` in one launch."""
    return _run(x, fp4=True)
