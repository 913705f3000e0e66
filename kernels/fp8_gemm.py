"""Block-scaled FP8 GEMM with dynamic per-token activation quantization, as DeepSeek-V4's linears run.

Math, for activations x [T, K] and an FP8 weight W_q [N, K] with block scales S_w [ceil(N/128), ceil(K/128)]
(backend/model/quantization.py; the scale multiplies):
  activation quantization, per token t and 128-wide K group g (DeepSeek's `act_quant`):
      amax[t, g] = max(max_k |x[t, k]|, 1e-4),  s_x[t, g] = 2^ceil(log2(amax / 448)),
      x_q[t, k]  = e4m3(clamp(x[t, k] / s_x[t, g], -448, 448))
  out[t, n] = sum_g s_x[t, g] * S_w[n // 128, g] * sum_{k in g} x_q[t, k] * W_q[n, k]   (fp32 accumulation)

Layouts: x [T, K] (fp32/bf16/fp16, last dimension contiguous), w_q [N, K] float8_e4m3fn, w_scale
[ceil(N/128), ceil(K/128)] float8_e8m0fnu or float32; out [T, N] in x's dtype. N and K need not be
multiples of 128 (partial blocks are masked and their scales still apply).

Kernel (`fp8_gemm_triton`): grid (cdiv(T, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K); each program walks its share of K in
128-wide steps (BLOCK_K = the group), multiplies FP8 by FP8 (wgmma on Hopper) and adds each step's product times s_x
and S_w into an fp32 accumulator, as DeepSeek's own fp8_gemm does. `fp8_gemm_config` picks the variant by shape:
  - SWAP_AB (up to 64 tokens): the product computed transposed, W @ x^T, the weight's columns on wgmma's 64-row
    side and the tokens on its N side (16 tokens on the M side would take mma.sync and an fp16 upcast of the weight);
  - SPLIT_K (too few tiles for the SMs: narrow N at decode): programs share a tile's K steps, the last to finish adds
    their partial sums (split counters, kernels/common.py) and stores, in one launch;
  - PREQUANTIZED (from 17 tokens): x act_quant'ed once by a launch ahead (`plan_act_quant`) and read as e4m3;
    otherwise each step quantizes its x rows in registers (at decode, where x is a few rows);
  - PROLOGUE: the GEMM's input is what a launch before it would have written, computed as x is loaded (in the
    act_quant launch ahead when PREQUANTIZED): the clamped SwiGLU of a gate|up product (the shared expert's w2), or
    x's weighted RMSNorm (q_a's, for q_b and the indexer's q_b).
Under Triton's interpreter, which has no FP8 dot and whose fp32 -> e4m3 cast rounds wrongly (124.8 -> 64, ties away
from even), the rounding to e4m3 is done in fp32 arithmetic (`round_to_e4m3`, round-to-nearest-even as the GPU's
cvt) and the dot in fp32: the same values. The torch reference (`fp8_gemm_reference`) quantizes the same way and
multiplies the dequantized operands in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.common import (DEFAULT_NUM_SMS, SPLIT_COUNTERS, clamped_swiglu_values, is_interpreting, last_to_arrive,
                            launch, num_sms, prefetch_weight_rows, split_counters, wait_for_previous_kernel,
                            weight_prefetch_lines)
from kernels.norm_rope import norm_rope_reference, rms_factor, rms_norm as rms_norm_reference, rope_tail
from kernels.quant_formats import (FP8_BLOCK, dequantize_fp8, e4m3_groups, e4m3_scale_codes, indexer_rounded,
                                   quantize_groups, round_to_e4m3, scale_to_float)
from kernels.tuning import tuned

GROUP = FP8_BLOCK  # K group of the activation scales = the weight's block size


class Fp8Weight(NamedTuple):
    """A linear's weight kept as published: data [N, K] float8_e4m3fn, scale [ceil(N/128), ceil(K/128)] float32."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)


@triton.jit
def _fp8_gemm_kernel(
    # pointers
    x_ptr, xs_ptr, w_ptr, w_scale_ptr, out_ptr, partial_ptr, counter_ptr, norm_w_ptr, cos_ptr, sin_ptr,
    # sizes, and the input prologue's scalar (SwiGLU's limit, RMSNorm's eps)
    num_tokens, n, k, prologue_scalar,
    # strides (the last dimension of every tensor is contiguous)
    stride_xt, stride_xs, stride_wn, stride_sn, stride_ot, stride_ct, stride_st,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr, PREQUANTIZED: tl.constexpr, NATIVE_FP8_DOT: tl.constexpr, PROLOGUE: tl.constexpr,
    ROPE: tl.constexpr, ROUND_INDEXER: tl.constexpr, LOG_N: tl.constexpr,  # the epilogue (`head_rope`)
    PREFETCH_LINES: tl.constexpr = 0,  # each weight row's lines asked of L2 while it waits (`weight_prefetch_lines`)
    PDL: tl.constexpr = False,  # launched to wait for the kernel before it (common.launch)
):
    """Program (token tile m, column tile n, K split s): out[rows, cols] = the sum over its K groups of the scaled FP8
    products; with SPLIT_K > 1 the last split of a tile to finish adds the others' partial sums and stores.

    SWAP_AB: the product is computed transposed, W [BLOCK_N, K] @ x^T, so that the weight's columns fill Hopper's
    64-row wgmma and the few tokens its N side. PREQUANTIZED: x was act_quant'ed ahead (xs its scales); otherwise
    each step quantizes its x tile in registers, after the PROLOGUE (`gemm_input`): the clamped SwiGLU of a gate|up
    x [T, 2K], or x's weighted RMSNorm (each row's factor from a first pass over its K), rounded to x's dtype.
    ROPE > 0: a column tile is one head, roped (and with ROUND_INDEXER rounded) before it is stored (`head_rope`)."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    per_split = tl.cdiv(tl.cdiv(k, BLOCK_K), SPLIT_K) * BLOCK_K
    prefetch_weight_rows(PDL, w_ptr, cols, n, stride_wn, split * per_split, k, PREFETCH_LINES)
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask, col_mask = rows < num_tokens, cols < n
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], tl.float32)
    r = rms_factors_of_rows(x_ptr, rows, row_mask, k, stride_xt, prologue_scalar, BLOCK_M, BLOCK_K, PROLOGUE)
    for k0 in range(split * per_split, tl.minimum(k, (split + 1) * per_split), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_q, x_scale = _activation_step(x_ptr, xs_ptr, norm_w_ptr, rows, row_mask, k0, ks, k, prologue_scalar, r,
                                        stride_xt, stride_xs, SWAP_AB, PREQUANTIZED, NATIVE_FP8_DOT, PROLOGUE)
        w_scale = tl.load(w_scale_ptr + (cols // BLOCK_K) * stride_sn + k0 // BLOCK_K, mask=col_mask, other=0.0)
        if SWAP_AB:
            w_q = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :],
                          mask=col_mask[:, None] & (ks < k)[None, :], other=0.0)
            acc += _fp8_dot(w_q, x_q, NATIVE_FP8_DOT) * w_scale[:, None] * x_scale[None, :]
        else:
            w_q = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                          mask=(ks < k)[:, None] & col_mask[None, :], other=0.0)
            acc += _fp8_dot(x_q, w_q, NATIVE_FP8_DOT) * x_scale[:, None] * w_scale[None, :]
    if SPLIT_K > 1:
        # partials [tiles, splits, tile]; the last split to bump the tile's counter (acq_rel: it sees every other
        # split's partial) adds them in split order (deterministic) and stores
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        TILE: tl.constexpr = BLOCK_M * BLOCK_N
        offsets = tl.reshape(tl.arange(0, TILE), acc.shape)
        tl.store(partial_ptr + (tile * SPLIT_K + split).to(tl.int64) * TILE + offsets, acc)
        if not last_to_arrive(counter_ptr, tile, SPLIT_K):
            return
        acc = tl.zeros(acc.shape, tl.float32)
        for other in range(SPLIT_K):
            acc += tl.load(partial_ptr + (tile * SPLIT_K + other).to(tl.int64) * TILE + offsets, cache_modifier=".cg")
    if SWAP_AB:
        acc = tl.trans(acc)
    out = acc.to(out_ptr.dtype.element_ty)
    if ROPE > 0:
        out = head_rope(out, cos_ptr, sin_ptr, rows, num_tokens, stride_ct, stride_st, BLOCK_M, BLOCK_N, ROPE,
                        ROUND_INDEXER, LOG_N)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + cols[None, :], out,
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def head_rope(y, cos_ptr, sin_ptr, rows, num_tokens, stride_ct, stride_st, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, ROPE: tl.constexpr, ROUND_INDEXER: tl.constexpr, LOG_N: tl.constexpr):
    """The GEMM's output tile y [BLOCK_M, BLOCK_N] (its dtype) as the norm_rope kernel would leave it, a head a row:
    the trailing ROPE channels rotated by the row's token's cos / sin (`rope_tail`, no norm), then with ROUND_INDEXER
    DeepSeek's rounding of an indexer query (`indexer_rounded`: rotated, FP4 per 32)."""
    token = tl.minimum(rows, num_tokens - 1).to(tl.int64)[:, None]  # (rows past the tokens are not stored)
    y = rope_tail(y, cos_ptr + token * stride_ct, sin_ptr + token * stride_st, BLOCK_M, BLOCK_N, ROPE, False)
    if ROUND_INDEXER:
        y = indexer_rounded(y.to(tl.float32), BLOCK_M, BLOCK_N, LOG_N, y.dtype).to(y.dtype)
    return y


@triton.jit
def _activation_step(x_ptr, xs_ptr, norm_w_ptr, rows, row_mask, k0, ks, k, prologue_scalar, r, stride_xt, stride_xs,
                     SWAP_AB: tl.constexpr, PREQUANTIZED: tl.constexpr, NATIVE_FP8_DOT: tl.constexpr,
                     PROLOGUE: tl.constexpr):
    """The step's e4m3 activations of `rows` at columns ks = k0.. (one 128-wide group), [BLOCK_M, BLOCK_K] or transposed
    (SWAP_AB), and their scales [BLOCK_M]: loaded as act_quant left them (PREQUANTIZED), else quantized here from the
    PROLOGUE's values (`gemm_input`); as float32 values on the e4m3 grid under the interpreter (no FP8 dot there)."""
    if SWAP_AB:
        offsets = rows[None, :].to(tl.int64) * stride_xt + ks[:, None]
        mask = row_mask[None, :] & (ks < k)[:, None]
    else:
        offsets = rows[:, None].to(tl.int64) * stride_xt + ks[None, :]
        mask = row_mask[:, None] & (ks < k)[None, :]
    AXIS: tl.constexpr = 0 if SWAP_AB else 1  # the K axis
    if PREQUANTIZED:
        x_q = tl.load(x_ptr + offsets, mask=mask, other=0.0)
        x_scale = tl.load(xs_ptr + rows * stride_xs + k0 // 128, mask=row_mask, other=0.0)
        if not NATIVE_FP8_DOT:
            x_q = x_q.to(tl.float32)
    else:
        x = gemm_input(x_ptr, norm_w_ptr, offsets, mask, ks, k, prologue_scalar, r, AXIS, PROLOGUE)
        _, x_scale = e4m3_scale_codes(tl.max(tl.abs(x), axis=AXIS))  # DeepSeek's act_quant scales
        x_s = tl.clamp(x / tl.expand_dims(x_scale, AXIS), -448.0, 448.0)
        x_q = x_s.to(tl.float8e4nv) if NATIVE_FP8_DOT else round_to_e4m3(x_s)
    return x_q, x_scale


NO_PROLOGUE, SWIGLU, RMS_NORM = 0, 1, 2  # what the GEMM computes of x as it loads it (PROLOGUE)


@triton.jit
def gemm_input(x_ptr, norm_w_ptr, offsets, mask, ks, k, prologue_scalar, r, AXIS: tl.constexpr,
               PROLOGUE: tl.constexpr):
    """The GEMM's input at `offsets` (columns ks along AXIS) in float32: x's values; or (SWIGLU) the clamped SwiGLU of
    the gate values there and the up values k columns on (prologue_scalar the limit); or (RMS_NORM) x's weighted
    RMSNorm, (w * (x * r)) with r each row's factor (`rms_factors_of_rows`), as the norm_rope kernel computes it;
    each rounded to x's dtype, as the kernel it replaces stores it."""
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if PROLOGUE == 1:  # SWIGLU
        x = clamped_swiglu_values(x, tl.load(x_ptr + offsets + k, mask=mask, other=0.0), prologue_scalar).to(x.dtype)
    elif PROLOGUE == 2:  # RMS_NORM
        w = tl.expand_dims(tl.load(norm_w_ptr + ks, mask=ks < k, other=0.0).to(tl.float32), 1 - AXIS)
        x = (w * (x.to(tl.float32) * tl.expand_dims(r, AXIS))).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def rms_factors_of_rows(x_ptr, rows, row_mask, k, stride_xt, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        PROLOGUE: tl.constexpr):
    """Each row's RMSNorm factor [BLOCK_M] (`rms_factor`) from a pass over its k columns (RMS_NORM; otherwise ones,
    unread)."""
    r = tl.full([BLOCK_M], 1.0, tl.float32)
    if PROLOGUE == 2:  # RMS_NORM
        sumsq = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + ks[None, :],
                        mask=row_mask[:, None] & (ks < k)[None, :], other=0.0).to(tl.float32)
            sumsq += tl.sum(x * x, 1)
        r = rms_factor(sumsq, k, eps)
    return r


@triton.jit
def _fp8_dot(a, b, NATIVE_FP8_DOT: tl.constexpr):
    """a @ b of e4m3 operands: wgmma fp8 on Hopper; under the interpreter their float32 values, exactly."""
    if NATIVE_FP8_DOT:
        product = tl.dot(a, b)
    else:
        product = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return product


SWAP_AB_MAX_TOKENS = 64  # up to here the tokens take the MMA's N side (wgmma's M is 64 rows: 16 tokens waste 3/4)
QUANTIZE_AHEAD_MIN_TOKENS = 17  # from here x is act_quant'ed once ahead: each column tile would quantize it again


def fp8_gemm_config(num_tokens: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS,
                    head_dim: int | None = None) -> dict:
    """Tiles and variant of one FP8 GEMM, by shape.

    Up to 64 tokens the product is computed transposed (SWAP_AB): 128 weight columns on the MMA's M side (two
    64-row wgmma), the tokens on its N side (16, 32 or 64); more tokens take 64 or 128 rows a tile. With fewer
    tiles than half the SMs (a narrow N at decode: wkv, wq_a), SPLIT_K programs share each tile's K steps (at least
    two each), so that enough SMs stream the weight; the last to finish adds the partial sums. From 17 tokens x is
    act_quant'ed once ahead (one launch) rather than in every column tile's registers. `head_dim`: a column tile is
    one head of that width, whatever the tuned tiles (the output's heads roped as they are stored: `head_rope`).
    """
    fit = lambda size: max(16, triton.next_power_of_2(size))  # noqa: E731 (tl.dot needs >= 16)
    swap = num_tokens <= SWAP_AB_MAX_TOKENS
    block_m = min(fit(num_tokens), 64) if swap else (64 if num_tokens <= 256 else 128)
    block_n = min(128, fit(n))
    tiles = triton.cdiv(num_tokens, block_m) * triton.cdiv(n, block_n)
    steps = triton.cdiv(k, GROUP)
    split_k = 1
    if tiles < num_sms // 2 and tiles <= SPLIT_COUNTERS:
        split_k = max(1, min(steps // 2, triton.cdiv(num_sms, tiles)))
    config = tuned("fp8_gemm", dict(n=n, k=k, tokens=num_tokens),  # tuned per device (kernels/tuning.py)
                   dict(BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split_k, SWAP_AB=swap,
                        PREQUANTIZED=num_tokens >= QUANTIZE_AHEAD_MIN_TOKENS, num_warps=4 if block_m <= 64 else 8,
                        num_stages=3))
    if head_dim is not None and config["BLOCK_N"] != head_dim:
        config = dict(config, BLOCK_N=head_dim)
    # (split-K's counters take at most SPLIT_COUNTERS tiles: the tiles a tuned change or a head's width leaves may be
    # more than those the default split for, at this count)
    tiles = triton.cdiv(num_tokens, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
    if config["SPLIT_K"] > 1 and tiles > SPLIT_COUNTERS:
        config = dict(config, SPLIT_K=1)
    return config


def plan_fp8_gemm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, *, config: dict | None = None,
                  swiglu_limit: float | None = None, rms_norm: tuple[torch.Tensor, float] | None = None,
                  x_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
                  rope: tuple[torch.Tensor, torch.Tensor, int] | None = None, round_indexer: bool = False):
    """Check the inputs, allocate the output; return (out, launches) without launching. The GEMM's input may be what a
    launch before it would have written, computed as x is loaded: swiglu_limit: x is a gate|up product [T, 2K], the
    input its clamped SwiGLU (`swiglu_values_reference`); rms_norm (weight [K], eps): x's weighted RMSNorm.
    x_quantized: the act_quant (e4m3 values, scales) of the GEMM's input (x, or what the prologue computes of it) as
    its producer wrote it, read where the GEMM would act_quant ahead (no launch; x itself, and the prologue, where it
    quantizes in registers). Its output may be what a launch after it would write (the epilogue): rope (cos, sin
    [T, R / 2], head_dim): the output's heads of head_dim channels (a power of two, 16 to 128) each with their
    trailing R channels rotated by their token's row, and with round_indexer rounded as DeepSeek rounds an indexer
    query: the norm_rope kernel's `normalize=False` output of the product viewed [T, N / head_dim, head_dim] (the
    indexer's queries)."""
    _check_fp8_gemm_inputs(x, w_q, w_scale, swiglu_limit is not None)
    prologue, norm_w, scalar = _prologue(x, w_q.shape[1], swiglu_limit, rms_norm)
    num_tokens, k = x.shape[0], w_q.shape[1]
    n = w_q.shape[0]
    cos, sin, head_dim = _check_head_rope(rope, num_tokens, n, round_indexer, x)
    out = torch.empty((num_tokens, n), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out, []
    cfg = config or fp8_gemm_config(num_tokens, n, k, num_sms(x.device), head_dim)
    assert head_dim is None or cfg["BLOCK_N"] == head_dim, "with a head rope, a column tile is one head"
    if not cfg["PREQUANTIZED"]:
        (x_in, x_scale), quantize = (x, x), []
    elif x_quantized is not None:
        (x_in, x_scale), quantize = x_quantized, []
    else:
        (x_in, x_scale), quantize = plan_act_quant(x, swiglu_limit=swiglu_limit, rms_norm=rms_norm)
    grid = (triton.cdiv(num_tokens, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"])
    split = cfg["SPLIT_K"] > 1
    assert not split or grid[0] * grid[1] <= SPLIT_COUNTERS, f"split-K takes at most {SPLIT_COUNTERS} tiles"
    partial = torch.empty((grid[0] * grid[1] * grid[2] * cfg["BLOCK_M"] * cfg["BLOCK_N"],) if split else (1,),
                          dtype=torch.float32, device=x.device)
    scale_arg = scale_to_float(w_scale).contiguous()
    args = (x_in, x_scale, w_q, scale_arg, out, partial, split_counters(x.device), norm_w, cos, sin, num_tokens, n, k,
            scalar, x_in.stride(0), x_scale.stride(0), w_q.stride(0), scale_arg.stride(0), out.stride(0), cos.stride(0),
            sin.stride(0))
    kwargs = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=GROUP, SPLIT_K=cfg["SPLIT_K"],
                  SWAP_AB=cfg["SWAP_AB"], PREQUANTIZED=cfg["PREQUANTIZED"], NATIVE_FP8_DOT=not is_interpreting(),
                  PROLOGUE=NO_PROLOGUE if cfg["PREQUANTIZED"] else prologue,
                  ROPE=2 * cos.shape[-1] if rope is not None else 0, ROUND_INDEXER=rope is not None and round_indexer,
                  LOG_N=cfg["BLOCK_N"].bit_length() - 1, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                  PREFETCH_LINES=weight_prefetch_lines(cfg["BLOCK_N"], triton.cdiv(k, GROUP * cfg["SPLIT_K"]) * GROUP))
    return out, quantize + [(_fp8_gemm_kernel, grid, args, kwargs)]


def takes_head_rope(head_dim: int, n: int) -> bool:
    """Whether the GEMM's epilogue can rope heads of head_dim channels of an N-column output: a column tile a head."""
    return 16 <= head_dim <= 128 and head_dim & (head_dim - 1) == 0 and n % head_dim == 0


def _check_head_rope(rope, num_tokens: int, n: int, round_indexer: bool, x: torch.Tensor):
    """(cos, sin, head_dim) of a GEMM's epilogue (x, x, None without one: never read)."""
    if rope is None:
        assert not round_indexer, "round_indexer rounds the heads a rope epilogue rotates"
        return x, x, None
    cos, sin, head_dim = rope
    assert takes_head_rope(head_dim, n), \
        f"a head rope needs heads of a power of two from 16 to 128 channels dividing N={n}, got {head_dim}"
    half = cos.shape[-1]
    for name, table in (("cos", cos), ("sin", sin)):
        assert tuple(table.shape) == (num_tokens, half) and table.stride(-1) == 1 and table.is_floating_point(), \
            f"{name} must be [T={num_tokens}, {half}] with a contiguous last dimension, got {tuple(table.shape)}"
    assert 0 < 2 * half <= head_dim, f"rope_dim {2 * half} must be in (0, head_dim={head_dim}]"
    return cos, sin, head_dim


def _prologue(x: torch.Tensor, k: int, swiglu_limit: float | None, rms_norm: tuple[torch.Tensor, float] | None):
    """(PROLOGUE, the norm's weight (x where none: unread), the prologue's scalar) of a GEMM's or act_quant's input."""
    assert swiglu_limit is None or rms_norm is None, "one prologue: a SwiGLU or an RMSNorm"
    if rms_norm is not None:
        weight, eps = rms_norm
        assert tuple(weight.shape) == (k,) and weight.stride(0) == 1 and weight.is_floating_point(), \
            f"the RMSNorm's weight must be a contiguous float [{k}], got {tuple(weight.shape)}"
        return RMS_NORM, weight, float(eps)
    if swiglu_limit is not None:
        return SWIGLU, x, float(swiglu_limit)
    return NO_PROLOGUE, x, 0.0


def _check_fp8_gemm_inputs(x, w_q, w_scale, swiglu: bool = False):
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [T, K] with a contiguous last dimension"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x dtype {x.dtype} not supported"
    n, k = w_q.shape
    width = 2 * k if swiglu else k
    assert x.shape[1] == width, f"x has {x.shape[1]} columns, the weight's K={k} needs {width}" + (
        " (gate|up)" if swiglu else "")
    assert w_q.dtype == torch.float8_e4m3fn and w_q.stride(1) == 1, "w_q must be float8_e4m3fn [N, K], contiguous"
    assert tuple(w_scale.shape) == (triton.cdiv(n, GROUP), triton.cdiv(k, GROUP)), (
        f"w_scale must be [{triton.cdiv(n, GROUP)}, {triton.cdiv(k, GROUP)}], got {tuple(w_scale.shape)}")
    assert w_scale.dtype in (torch.float8_e8m0fnu, torch.float32, torch.uint8), f"w_scale dtype {w_scale.dtype}"


def fp8_gemm_triton(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, *, config: dict | None = None,
                    swiglu_limit: float | None = None, rms_norm: tuple[torch.Tensor, float] | None = None,
                    x_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
                    rope: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                    round_indexer: bool = False) -> torch.Tensor:
    """Triton version of `fp8_gemm_reference` (same arguments, [T, N] in x's dtype; x_quantized: `plan_fp8_gemm`)."""
    out, launches = plan_fp8_gemm(x, w_q, w_scale, config=config, swiglu_limit=swiglu_limit, rms_norm=rms_norm,
                                  x_quantized=x_quantized, rope=rope, round_indexer=round_indexer)
    launch(launches)
    return out


@triton.jit(do_not_specialize=["num_tokens"])
def _act_quant_kernel(x_ptr, norm_w_ptr, q_ptr, s_ptr, num_tokens, k, prologue_scalar, stride_xt, stride_qt, stride_st,
                      BLOCK_T: tl.constexpr, GROUPS: tl.constexpr, PROLOGUE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (BLOCK_T rows, GROUPS groups of 128 columns): DeepSeek's act_quant, e4m3 values and their scales, of x
    or of what the PROLOGUE computes of it (`gemm_input`)."""
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * GROUPS * 128 + tl.arange(0, GROUPS * 128)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    row_mask = rows < num_tokens
    mask = row_mask[:, None] & (cols < k)[None, :]  # a partial last group: zeros, which change neither amax nor values
    offsets = rows[:, None].to(tl.int64) * stride_xt + cols[None, :]
    r = rms_factors_of_rows(x_ptr, rows, row_mask, k, stride_xt, prologue_scalar, BLOCK_T, GROUPS * 128,
                            PROLOGUE)
    grid, scale = e4m3_groups(gemm_input(x_ptr, norm_w_ptr, offsets, mask, cols, k, prologue_scalar, r, 1, PROLOGUE),
                              BLOCK_T, GROUPS * 128)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qt + cols[None, :], grid.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows[:, None].to(tl.int64) * stride_st + groups[None, :], scale,
             mask=row_mask[:, None] & (groups < tl.cdiv(k, 128))[None, :])


def act_quant_config(k: int) -> dict:
    """Tiles of 8 rows x 4 groups of 128 columns (fewer groups where K has fewer)."""
    return dict(BLOCK_T=8, GROUPS=min(4, triton.next_power_of_2(triton.cdiv(k, GROUP))), num_warps=4)


def plan_act_quant(x: torch.Tensor, *, config: dict | None = None, swiglu_limit: float | None = None,
                   rms_norm: tuple[torch.Tensor, float] | None = None):
    """`quantize_activations_reference` as one launch: ((x_q [T, K] float8_e4m3fn, s_x [T, ceil(K/128)] fp32),
    launches). For the GEMMs that read x more than once (each column tile of a prefill, each expert column tile of
    the MoE), which then load one byte per value and no amax. config overrides `act_quant_config`. swiglu_limit /
    rms_norm: what is quantized is x's SwiGLU / RMSNorm, as in `plan_fp8_gemm`."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [T, K] with a contiguous last dimension"
    num_tokens, k = x.shape[0], x.shape[1] // (2 if swiglu_limit is not None else 1)
    prologue, norm_w, scalar = _prologue(x, k, swiglu_limit, rms_norm)
    x_q = torch.empty((num_tokens, k), dtype=torch.float8_e4m3fn, device=x.device)
    x_s = torch.empty((num_tokens, triton.cdiv(k, GROUP)), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return (x_q, x_s), []
    cfg = config or act_quant_config(k)
    grid = (triton.cdiv(num_tokens, cfg["BLOCK_T"]), triton.cdiv(x_s.shape[1], cfg["GROUPS"]))
    args = (x, norm_w, x_q, x_s, num_tokens, k, scalar, x.stride(0), x_q.stride(0), x_s.stride(0))
    return (x_q, x_s), [(_act_quant_kernel, grid, args, dict(cfg, PROLOGUE=prologue))]


def act_quant_triton(x: torch.Tensor, *, swiglu_limit: float | None = None,
                     rms_norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`plan_act_quant`'s launch run: (x_q, s_x) of x, or of its SwiGLU / RMSNorm."""
    quantized, launches = plan_act_quant(x, swiglu_limit=swiglu_limit, rms_norm=rms_norm)
    launch(launches)
    return quantized


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [T, K] float8_e4m3fn, s_x [T, ceil(K/128)] fp32): DeepSeek's per-token, per-128-group act_quant."""
    num_tokens, k = x.shape
    padded = torch.zeros(num_tokens, triton.cdiv(k, GROUP) * GROUP, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()  # a partial last group: zeros, which change neither its amax nor its values
    grid, scale = quantize_groups(padded, GROUP, "e4m3")
    return grid[:, :k].to(torch.float8_e4m3fn), scale


def swiglu_values_reference(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """[T, K] in gate_up's dtype: silu(min(g, limit)) * clamp(u, +-limit) of its gate and up halves [T, 2K], in fp32
    and rounded once (as the swiglu kernel and a SwiGLU-fed GEMM compute it; DeepSeek's Expert.forward too)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (gate * torch.sigmoid(gate) * up).to(gate_up.dtype)


def fp8_gemm_reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, *,
                       swiglu_limit: float | None = None, rms_norm: tuple[torch.Tensor, float] | None = None,
                       rope: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                       round_indexer: bool = False) -> torch.Tensor:
    """out [T, N] = dequant(act_quant(x)) @ dequant(W_q, S_w)^T in fp32, cast to x's dtype; swiglu_limit: of
    x's SwiGLU (`swiglu_values_reference`), x a gate|up product [T, 2K]; rms_norm (weight, eps): of x's RMSNorm;
    rope (cos, sin, head_dim) and round_indexer: then its heads roped and rounded (`head_rope_reference`)."""
    if swiglu_limit is not None:
        x = swiglu_values_reference(x, swiglu_limit)
    if rms_norm is not None:
        x = rms_norm_reference(x, *rms_norm)
    x_q, s_x = quantize_activations_reference(x)
    x_deq = x_q.float() * s_x.repeat_interleave(GROUP, -1)[:, : x.shape[1]]
    out = (x_deq @ dequantize_fp8(w_q, w_scale).T).to(x.dtype)
    return out if rope is None else head_rope_reference(out, rope, round_indexer)


def head_rope_reference(out: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, int],
                        round_indexer: bool = False) -> torch.Tensor:
    """A linear's output [T, N] with its heads of head_dim channels roped by (cos, sin) and with round_indexer
    rounded as DeepSeek rounds an indexer query (`norm_rope_reference` without a norm): a GEMM epilogue's values."""
    cos, sin, head_dim = rope
    heads = out.view(out.shape[0], -1, head_dim)
    return norm_rope_reference(heads, normalize=False, cos=cos, sin=sin, round_indexer=round_indexer).view(out.shape)
