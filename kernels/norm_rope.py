"""RMSNorm (weighted or not) and DeepSeek-V4's interleaved partial RoPE, optionally stored into a paged pool.

Uses per layer: q_a_norm (weighted norm); the per-head unweighted norm of q then rope; kv_norm then rope,
stored straight into the window pool at `out_index`; the inverse rope of the attention output (V was rotated
as K); the indexer's query rope (no norm), then under DeepSeek's numerics its rotation and FP4 rounding
(`round_indexer`: `simulate_indexer_fp4` of the rotated row, in the same launch).

Math (`norm_rope_reference`, the model's casts included), per row x of C channels, dtype = x's dtype:
  weighted     y = (weight * (xf * rsqrt(mean(xf^2) + eps))).to(dtype)          xf = x in fp32, weight in fp32
  unweighted   y = x * rsqrt(mean(xf^2) + eps).to(dtype)            (the factor rounded to dtype, product in dtype)
  no norm      y = x
  rope         on the trailing rope_dim = 2 * cos.shape[-1] channels, pair i = channels (2i, 2i + 1) of them:
               even = (y_e * cos_i - y_o * sin_i).to(dtype), odd = (y_o * cos_i + y_e * sin_i).to(dtype), in fp32
               from y (already rounded to dtype); sin_i -> -sin_i when inverse (undoes the rotation)

Layouts: x [T, C] or [T, H, C] (norm over the last dim; the last dimension contiguous, any token / head strides:
x may be a column view of a wider projection), weight [C] any float dtype, cos / sin [T, rope_dim / 2] (one row
per token, shared by its heads; last dimension contiguous) in x's dtype; out [S, ..., C] viewed as [-1, C]
(contiguous rows of C), x's dtype: row out_index[t] receives token t ([T, C] x only), or, without out_index,
row t * H + h receives (t, h). Without out, a new contiguous tensor of x's shape is returned.

Kernel `_norm_rope_kernel`, one launch per call (none at T = 0), grid (T, cdiv(H, BLOCK_H)): a program owns one
token and BLOCK_H of its heads (BLOCK_H = 1 for [T, C]), a [BLOCK_H, BLOCK_C] tile, BLOCK_C =
next_power_of_2(C) (masked), so each row is read once and written once and cos / sin are read once per program.
Tiles hold up to 2048 elements (4096 when C alone needs them), ~4 per thread (8 at 4096, 8 warps); a row wider
than 4096 channels loops over 4096-channel chunks (a sum-of-squares pass, then a re-read). The rope lanes read
their pair partner (channel 2i + 1 for 2i and back) with a second, gather load of the same row (L1-hot) and
normalise it the same way, so nothing moves between lanes. The program count depends only on T and H, and nothing
on the host looks at data (plans work on meta tensors). The configuration depends on (H, C) alone, never on T; T
is not a kernel argument (only the grid's first dimension) and the strides are fixed per call site (column views
of a projection of fixed width, the pool's rows), so they are specialised (16-divisibility: vector loads) and a
new batch size never recompiles.

Rounding: the kernel follows the reference's casts (fp32 math, weight * (x * r) in that order, the unweighted
factor rounded to x's dtype before the product, rope from the rounded y); the mean is sum / C with an IEEE
division and r = 1 / sqrt_rn(.) (torch's CPU rsqrt is 1 / sqrt too). What remains is the order of the fp32 sum of
squares (ulp-level in r) and, on the GPU, the contraction of y_e * cos - y_o * sin into an FMA: fp32 results agree
to ~1e-6 relative; bf16 results to one bf16 rounding where such an fp32 difference straddles a rounding boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import launch, wait_for_previous_kernel
from kernels.kv_store import scale_slots, store_entries_reference, store_fp8_entry
from kernels.quant_formats import indexer_rounded, kv_fp8_entry_bytes, simulate_indexer_fp4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x [T, ..., Dh] pairwise (interleaved)."""
    cos = cos.unsqueeze(-1).expand(*cos.shape, 2).flatten(-2)  # each value twice (repeat_interleave may sync)
    sin = sin.unsqueeze(-1).expand(*sin.shape, 2).flatten(-2)
    for _ in range(x.dim() - 2):  # broadcast over head axes
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated_half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + rotated_half.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def norm_rope_reference(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                        normalize: bool = True, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                        inverse: bool = False, out: torch.Tensor | None = None,
                        out_index: torch.Tensor | None = None, round_indexer: bool = False) -> torch.Tensor:
    """RMSNorm (with `weight`, or unweighted when None; skipped when normalize=False), then RoPE (by -sin when
    inverse), then with `round_indexer` DeepSeek's rounding of an indexer vector (`simulate_indexer_fp4`); stored
    into out.view(-1, C)[out_index] and out returned when out is given, else a new tensor."""
    y = x
    if normalize:
        y = rms_norm(y, weight, eps) if weight is not None else unweighted_rms_norm(y, eps)
    if cos is not None:
        y = apply_rope(y, cos, -sin if inverse else sin)
    if round_indexer:
        y = simulate_indexer_fp4(y)
    if out is None:
        return y
    store_entries_reference(y, out, out_index, 2 * cos.shape[-1] if cos is not None else 0)
    return out


# --- kernel -------------------------------------------------------------------------------------------------------
@triton.jit
def rms_factor(sumsq, n, eps):
    """An RMSNorm's factor 1 / sqrt(sumsq / n + eps) in fp32, from a row's sum of squares over n values: IEEE division
    and square root, as torch's CPU rsqrt (1 / sqrt). Every kernel that norms a row takes it from here."""
    return tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(sumsq, n * 1.0) + eps))


@triton.jit
def normed_rows(x, w, r, NORMALIZE: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """y in x's dtype from x [BLOCK_H, BLOCK_C] (x's dtype), w [BLOCK_C] fp32, r [BLOCK_H] fp32 (already rounded to
    x's dtype when unweighted)."""
    y = x
    if NORMALIZE:
        if HAS_WEIGHT:
            y = (w[None, :] * (x.to(tl.float32) * r[:, None])).to(x.dtype)
        else:
            y = (x.to(tl.float32) * r[:, None]).to(x.dtype)
    return y


@triton.jit
def norm_rope_tile(x, x_row, w_ptr, cos_ptr, sin_ptr, offs, h_mask, r, t, stride_ct, stride_st,
                    C: tl.constexpr, ROPE_DIM: tl.constexpr, NORMALIZE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                    INVERSE: tl.constexpr):
    """The output tile (x's dtype) of channels `offs` [BLOCK_C] from their input tile x [BLOCK_H, BLOCK_C]."""
    c_mask = offs < C
    w = offs.to(tl.float32)  # unused unless HAS_WEIGHT
    if NORMALIZE and HAS_WEIGHT:
        w = tl.load(w_ptr + offs, mask=c_mask, other=0.0).to(tl.float32)
    y = normed_rows(x, w, r, NORMALIZE, HAS_WEIGHT)
    if ROPE_DIM > 0:
        j = offs - (C - ROPE_DIM)  # channel within the rope section
        is_rope = (j >= 0) & c_mask
        j = tl.where(is_rope, j, 0)
        partner = offs + 1 - 2 * (j % 2)  # 2i <-> 2i + 1 (masked off outside the section)
        xp = tl.load(x_row + partner[None, :], mask=h_mask[:, None] & is_rope[None, :], other=0.0)
        wp = w
        if NORMALIZE and HAS_WEIGHT:
            wp = tl.load(w_ptr + partner, mask=is_rope, other=0.0).to(tl.float32)
        yp = normed_rows(xp, wp, r, NORMALIZE, HAS_WEIGHT).to(tl.float32)
        pair = j // 2
        cos = tl.load(cos_ptr + t * stride_ct + pair, mask=is_rope, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * stride_st + pair, mask=is_rope, other=0.0).to(tl.float32)
        if INVERSE:
            sin = -sin
        sin = tl.where(j % 2 == 0, -sin, sin)  # even: y_e cos - y_o sin; odd: y_o cos + y_e sin
        rotated = (y.to(tl.float32) * cos[None, :] + yp * sin[None, :]).to(y.dtype)
        y = tl.where(is_rope[None, :], rotated, y)
    return y


@triton.jit
def rope_tail(y, cos_row, sin_row, ROWS: tl.constexpr, COLS: tl.constexpr, ROPE: tl.constexpr,
              INVERSE: tl.constexpr):
    """y [ROWS, COLS] (its dtype) with its trailing ROPE channels rotated pairwise by a token's cos / sin rows
    (pointers to its [ROPE / 2] table entries: one for every row of y, or [ROWS, 1] of them, one a row), by -sin when
    INVERSE: the reference's `apply_rope`, fp32 math from y, each result rounded to y's dtype. The pairs are taken
    apart in registers (reshape and split), for a tile that lives in a program that also computes it (the attention's
    query and output, the indexer queries an FP8 GEMM writes)."""
    pair = tl.arange(0, COLS // 2)
    j = pair - (COLS - ROPE) // 2  # pair index within the rope section
    is_rope = j >= 0
    j = tl.where(is_rope, j, 0)[None, :]
    cos = tl.load(cos_row + j, mask=is_rope[None, :], other=1.0).to(tl.float32)
    sin = tl.load(sin_row + j, mask=is_rope[None, :], other=0.0).to(tl.float32)
    if INVERSE:
        sin = -sin
    even, odd = tl.split(tl.reshape(y, [ROWS, COLS // 2, 2]))
    even_f, odd_f = even.to(tl.float32), odd.to(tl.float32)
    even_r = tl.where(is_rope[None, :], (even_f * cos - odd_f * sin).to(y.dtype), even)
    odd_r = tl.where(is_rope[None, :], (odd_f * cos + even_f * sin).to(y.dtype), odd)
    return tl.reshape(tl.join(even_r, odd_r), [ROWS, COLS])


@triton.jit
def _norm_rope_kernel(
    # pointers
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, out_rope_ptr, index_ptr,
    # strides (fixed per model and call site: specialised) and eps
    stride_xt, stride_xh, stride_ct, stride_st, stride_o, eps,
    # model constants and tiles
    H: tl.constexpr, C: tl.constexpr, ROPE_DIM: tl.constexpr, NORMALIZE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    INVERSE: tl.constexpr, HAS_INDEX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    FP8_OUT: tl.constexpr, SCALE_SLOTS: tl.constexpr,  # out: a uint8 pool of the fp8 layout (H = 1, one chunk)
    ROUND_INDEXER: tl.constexpr, LOG_C: tl.constexpr,  # then rotated and FP4-rounded (indexer queries; one chunk)
    PDL: tl.constexpr = False,  # launched to wait for the kernel before it (common.launch)
):
    """Program (t, head block): rows (t, h) for the block's BLOCK_H heads, all C channels, written to out row
    index[t] (HAS_INDEX, H = 1) or t * H + h."""
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < H
    heads = heads.to(tl.int64)
    x_row = x_ptr + t * stride_xt + heads[:, None] * stride_xh  # [BLOCK_H, 1]
    if HAS_INDEX:
        o_rows = tl.load(index_ptr + t).to(tl.int64) + heads  # H = 1
    else:
        o_rows = t * H + heads
    o_row = out_ptr + o_rows[:, None] * stride_o
    offs_c = tl.arange(0, BLOCK_C)

    r = tl.zeros([BLOCK_H], tl.float32)
    if NUM_CHUNKS == 1:
        mask = h_mask[:, None] & (offs_c < C)[None, :]
        x = tl.load(x_row + offs_c[None, :], mask=mask, other=0.0)
        if NORMALIZE:
            xf = x.to(tl.float32)
            r = rms_factor(tl.sum(xf * xf, 1), C, eps)
            if not HAS_WEIGHT:
                r = r.to(x.dtype).to(tl.float32)
        y = norm_rope_tile(x, x_row, w_ptr, cos_ptr, sin_ptr, offs_c, h_mask, r, t, stride_ct, stride_st, C,
                            ROPE_DIM, NORMALIZE, HAS_WEIGHT, INVERSE)
        if ROUND_INDEXER:  # (BLOCK_C == C, a power of two)
            y = indexer_rounded(y.to(tl.float32), BLOCK_H, BLOCK_C, LOG_C, x_ptr.dtype.element_ty).to(y.dtype)
        if FP8_OUT:  # the entry quantized where it is stored (BLOCK_C == C, BLOCK_H == 1)
            store_fp8_entry(out_ptr, out_rope_ptr, tl.load(index_ptr + t).to(tl.int64) * stride_o,
                            tl.reshape(y.to(tl.float32), [BLOCK_C]), C, ROPE_DIM, SCALE_SLOTS)
        else:
            tl.store(o_row + offs_c[None, :], y, mask=mask)
    else:  # wide rows: a sum-of-squares pass, then a second read of each chunk
        if NORMALIZE:
            sumsq = tl.zeros([BLOCK_H], tl.float32)
            for chunk in range(NUM_CHUNKS):
                offs = chunk * BLOCK_C + offs_c
                xf = tl.load(x_row + offs[None, :], mask=h_mask[:, None] & (offs < C)[None, :],
                             other=0.0).to(tl.float32)
                sumsq += tl.sum(xf * xf, 1)
            r = rms_factor(sumsq, C, eps)
            if not HAS_WEIGHT:
                r = r.to(x_ptr.dtype.element_ty).to(tl.float32)
        for chunk in range(NUM_CHUNKS):
            offs = chunk * BLOCK_C + offs_c
            mask = h_mask[:, None] & (offs < C)[None, :]
            x = tl.load(x_row + offs[None, :], mask=mask, other=0.0)
            y = norm_rope_tile(x, x_row, w_ptr, cos_ptr, sin_ptr, offs, h_mask, r, t, stride_ct, stride_st, C,
                                ROPE_DIM, NORMALIZE, HAS_WEIGHT, INVERSE)
            tl.store(o_row + offs[None, :], y, mask=mask)


# --- host wrappers ------------------------------------------------------------------------------------------------
MAX_BLOCK_C = 4096  # channels of one tile; wider rows loop over chunks of this many
_TILE = 2048  # elements a program's tile aims at (BLOCK_H heads of BLOCK_C channels)


def norm_rope_config(num_heads: int, channels: int) -> dict:
    """BLOCK_C = next_power_of_2(C) up to MAX_BLOCK_C (wider rows: chunks); BLOCK_H heads per program so that a
    tile holds about _TILE elements; num_warps for ~4 elements per thread (1 to 8 warps, so 8 per thread in a
    4096-channel tile): with 8 per thread, the pool store's tile of 512 channels spilled for sm_90
    (scripts/check_kernels_compile.py), as each lane also holds its rope partner and fp32 copies. From (H, C) alone: the same compiled kernel serves every batch
    size."""
    block_c = min(triton.next_power_of_2(channels), MAX_BLOCK_C)
    block_h = max(1, min(triton.next_power_of_2(num_heads), _TILE // block_c))
    num_warps = max(1, min(8, block_h * block_c // 128))
    return dict(BLOCK_H=block_h, BLOCK_C=block_c, num_warps=num_warps)


def plan_norm_rope(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *, normalize: bool = True,
                   cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, inverse: bool = False,
                   out: torch.Tensor | None = None, out_index: torch.Tensor | None = None,
                   round_indexer: bool = False, config: dict | None = None):
    """Check inputs, allocate the result (or take out); return (result, launches) without launching: one launch
    (none at T = 0), launches as (kernel, grid, args, kwargs). Shape checks only: works on meta tensors."""
    assert x.dim() in (2, 3), f"x must be [T, C] or [T, H, C], got {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x dtype {x.dtype}"
    assert x.stride(-1) == 1, "x's last dimension must be contiguous"
    num_tokens, channels = x.shape[0], x.shape[-1]
    num_heads = x.shape[1] if x.dim() == 3 else 1
    stride_xh = x.stride(1) if x.dim() == 3 else channels
    has_weight = normalize and weight is not None
    if has_weight:
        assert tuple(weight.shape) == (channels,) and weight.stride(0) == 1 and weight.is_floating_point(), \
            f"weight must be a contiguous float [{channels}], got {tuple(weight.shape)}"
    rope_dim = 0
    if cos is not None:
        assert sin is not None, "cos and sin go together"
        half = cos.shape[-1]
        rope_dim = 2 * half
        for name, table in (("cos", cos), ("sin", sin)):
            assert tuple(table.shape) == (num_tokens, half) and table.stride(-1) == 1 and table.is_floating_point(), \
                f"{name} must be [T={num_tokens}, {half}] with a contiguous last dimension, got {tuple(table.shape)}"
        assert 0 < rope_dim <= channels, f"rope_dim {rope_dim} must be in (0, C={channels}]"
    fp8_out = out is not None and out.dtype == torch.uint8  # a pool of the fp8 layout (kv_cache_dtype fp8)
    if out is None:
        assert out_index is None, "out_index needs out"
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif fp8_out:
        width = kv_fp8_entry_bytes(channels, rope_dim)
        assert out.shape[-1] == width and out.is_contiguous() and out_index is not None and x.dim() == 2, \
            f"an fp8 out must be a contiguous uint8 pool [..., {width}] written at out_index"
    else:
        assert out.dtype == x.dtype and out.shape[-1] == channels, \
            f"out must be [..., {channels}] in {x.dtype}, got {tuple(out.shape)} {out.dtype}"
    flat = out.view(-1, out.shape[-1])  # the rows the kernel writes (raises if out's rows are not uniformly strided)
    if out_index is not None:
        assert x.dim() == 2, "out_index stores rows of a [T, C] x"
        assert tuple(out_index.shape) == (num_tokens,) and out_index.dtype in (torch.int64, torch.int32), \
            f"out_index must be int64 / int32 [T={num_tokens}], got {tuple(out_index.shape)} {out_index.dtype}"
        assert out_index.stride(0) == 1 or num_tokens <= 1, "out_index must be contiguous"
    else:
        assert flat.shape[0] == num_tokens * num_heads, \
            f"without out_index, out must have T * H = {num_tokens * num_heads} rows of C, got {tuple(out.shape)}"
    if num_tokens == 0 or num_heads == 0:
        return out, []
    cfg = config or norm_rope_config(num_heads, channels)
    assert not fp8_out or cfg["BLOCK_C"] == channels, "the fp8 layout quantizes whole entries: one chunk"
    assert not round_indexer or (cfg["BLOCK_C"] == channels and not fp8_out), \
        "the indexer's rounding rotates whole rows: one chunk of a power-of-two width, returned as values"
    cos_arg = cos if cos is not None else x  # never read without rope (one signature)
    sin_arg = sin if sin is not None else x
    args = (x, weight if has_weight else x, cos_arg, sin_arg, flat, flat.view(torch.bfloat16) if fp8_out else flat,
            out_index if out_index is not None else flat, x.stride(0), stride_xh,
            cos_arg.stride(0), sin_arg.stride(0), flat.stride(0), float(eps))
    kwargs = dict(H=num_heads, C=channels, ROPE_DIM=rope_dim, NORMALIZE=bool(normalize), HAS_WEIGHT=has_weight,
                  INVERSE=bool(inverse) and rope_dim > 0, HAS_INDEX=out_index is not None, BLOCK_H=cfg["BLOCK_H"],
                  BLOCK_C=cfg["BLOCK_C"], NUM_CHUNKS=triton.cdiv(channels, cfg["BLOCK_C"]),
                  FP8_OUT=fp8_out, SCALE_SLOTS=scale_slots(channels, rope_dim) if fp8_out else 8,
                  ROUND_INDEXER=bool(round_indexer), LOG_C=channels.bit_length() - 1, num_warps=cfg["num_warps"])
    grid = (num_tokens, triton.cdiv(num_heads, cfg["BLOCK_H"]))
    return out, [(_norm_rope_kernel, grid, args, kwargs)]


def norm_rope_triton(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                     normalize: bool = True, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                     inverse: bool = False, out: torch.Tensor | None = None, out_index: torch.Tensor | None = None,
                     round_indexer: bool = False, config: dict | None = None) -> torch.Tensor:
    """Triton version of `norm_rope_reference` (same arguments and result), one launch. config: tiles
    (BLOCK_H, BLOCK_C, num_warps) instead of `norm_rope_config`'s."""
    result, launches = plan_norm_rope(x, weight, eps, normalize=normalize, cos=cos, sin=sin, inverse=inverse,
                                      out=out, out_index=out_index, round_indexer=round_indexer, config=config)
    launch(launches)
    return result
