"""Quantize-on-write for the KV cache in DeepSeek's layouts (kv_cache_dtype fp8).

`store_fp8_entry` (Triton) encodes one attention entry where it is stored; the kernels that produce entries inline
it (norm_rope's window write, the compressor's CSA/HCA write), so an entry never exists unquantized in memory;
`store_fp4_key` does the same for an indexer key (the compressor's indexer write).

`store_kv_fp8_*(values, pool, rows, rope_dim)`: attention entries values [N, D] (window or CSA/HCA, after their norm
and rope) encoded as kernels/quant_formats.py's fp8 entry (nope values e4m3 per 64 with ue8m0 scales, rope values
bf16, the scale bytes padded to 8) into rows `rows` [N] of pool.view(-1, entry_bytes).
`store_indexer_fp4_*(keys, pool, rows, rotate)`: indexer keys [N, Di] (rotated first where `rotate`, as
`hadamard_rotate`), encoded as FP4 pairs with a ue8m0 scale per 32 into rows of pool.view(-1, Di / 2 + Di / 32).

The references are pack_kv_fp8 / pack_indexer_fp4 and an index store (several launches, a packed copy of the
batch's entries); the standalone kernels read each entry once and write its bytes where they belong: one program per
entry (an indexer key's may rotate it first, in registers).
Rows of padding entries (static shapes) point at the pools' scratch page like any other row.

The e4m3, e2m1 and bf16 roundings are arithmetic (round to nearest, ties to even), then the exact values are
converted to their codes, so the kernels give the references' bytes on a GPU and under the interpreter (whose
emulated float8 cast mis-rounds values that round up into the next binade, and whose bf16 cast truncates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import launch, wait_for_previous_kernel
from kernels.quant_formats import (KV_FP8_BLOCK, MXFP4_BLOCK, e2m1_groups, e4m3_scale_codes, hadamard_rotate,
                                   indexer_fp4_entry_bytes, kv_fp8_entry_bytes, pack_indexer_fp4, pack_kv_fp8, padded8,
                                   round_to_e4m3, rotate_rows)


def store_kv_fp8_reference(values: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, rope_dim: int) -> None:
    pool.view(-1, pool.shape[-1])[rows] = pack_kv_fp8(values, rope_dim)


def store_entries_reference(values: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, rope_dim: int) -> None:
    """Attention entries [N, D] into rows of a pool as it stores them: as they are, or encoded in the fp8 layout (a
    uint8 pool); what the entry-producing kernels' references (norm_rope's window write, the compressor) end with."""
    if pool.dtype == torch.uint8:
        store_kv_fp8_reference(values, pool, rows, rope_dim)
    else:
        pool.view(-1, pool.shape[-1])[rows] = values


def store_indexer_fp4_reference(keys: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor,
                                rotate: bool = False) -> None:
    pool.view(-1, pool.shape[-1])[rows] = pack_indexer_fp4(hadamard_rotate(keys) if rotate else keys)


def store_keys_reference(keys: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor) -> None:
    """Indexer keys [N, Di] into rows of a pool as it stores them: as they are, or (a uint8 pool, the fp8 layout's)
    rotated and encoded as FP4; what the compressor's reference ends with for the indexer."""
    if pool.dtype == torch.uint8:
        store_indexer_fp4_reference(keys, pool, rows, rotate=True)
    else:
        pool.view(-1, pool.shape[-1])[rows] = keys


@triton.jit
def store_fp8_entry(pool_ptr, rope_ptr, row, x, HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
                    SCALE_SLOTS: tl.constexpr):
    """One attention entry x [HEAD_DIM] (float32 holding its values) encoded in the fp8 layout at byte offset `row`
    of a uint8 pool (rope_ptr: the same memory as bf16): the nope groups quantized, the rope values in bf16, the scale
    bytes and their zero padding. Inlined by the kernels that produce entries (norm_rope, the compressor) too."""
    NOPE: tl.constexpr = HEAD_DIM - ROPE_DIM
    GROUPS: tl.constexpr = HEAD_DIM // 64  # the rope values make whole groups too (HEAD_DIM, NOPE multiples of 64)
    d = tl.arange(0, HEAD_DIM)
    groups = tl.reshape(x, [GROUPS, 64])
    codes, scale = e4m3_scale_codes(tl.max(tl.abs(groups), 1))
    grid = round_to_e4m3(tl.clamp(groups / scale[:, None], -448.0, 448.0))
    e4m3 = tl.reshape(grid, [HEAD_DIM]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    is_nope = d < NOPE
    tl.store(pool_ptr + row + d, e4m3, mask=is_nope)
    tl.store(rope_ptr + row // 2 + NOPE // 2 + (d - NOPE), _round_to_bf16(x).to(tl.bfloat16), mask=~is_nope)
    g = tl.arange(0, GROUPS)
    tl.store(pool_ptr + row + NOPE + 2 * ROPE_DIM + g, codes.to(tl.uint8), mask=g < NOPE // 64)
    PADDED: tl.constexpr = (NOPE // 64 + 7) // 8 * 8
    slot = tl.arange(0, SCALE_SLOTS)  # the padding after the scales: zero, as the reference writes it
    tl.store(pool_ptr + row + NOPE + 2 * ROPE_DIM + slot, tl.zeros([SCALE_SLOTS], tl.uint8),
             mask=(slot >= NOPE // 64) & (slot < PADDED))


@triton.jit
def _store_kv_fp8_kernel(values_ptr, rows_ptr, pool_ptr, rope_ptr, stride_v, stride_row, HEAD_DIM: tl.constexpr,
                         ROPE_DIM: tl.constexpr, SCALE_SLOTS: tl.constexpr, PDL: tl.constexpr = False):
    """Program e: entry e encoded into its row."""
    wait_for_previous_kernel(PDL)
    e = tl.program_id(0).to(tl.int64)
    x = tl.load(values_ptr + e * stride_v + tl.arange(0, HEAD_DIM)).to(tl.float32)
    store_fp8_entry(pool_ptr, rope_ptr, tl.load(rows_ptr + e).to(tl.int64) * stride_row, x, HEAD_DIM, ROPE_DIM,
                    SCALE_SLOTS)


@triton.jit
def _round_to_bf16(x):
    """float32 x rounded to bf16, to nearest, ties to even, on the bits (the interpreter's cast truncates); the result
    is exact in bf16."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def store_fp4_key(pool_ptr, row, x, HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr, LOG_HEAD_DIM: tl.constexpr,
                  DTYPE: tl.constexpr):
    """One indexer key x [1, HEAD_DIM] (float32 holding DTYPE values) encoded at byte offset `row` of a uint8 pool:
    rotated first where ROTATE (hadamard_rotate, rounded to DTYPE), its groups of 32 rounded to e2m1 at their
    power-of-two scale, stored as code pairs + scales. Inlined by the compressor for the keys it closes too."""
    GROUPS: tl.constexpr = HEAD_DIM // 32
    if ROTATE:
        x = rotate_rows(x, 1, HEAD_DIM, LOG_HEAD_DIM, DTYPE)
    rounded, exponent, _ = e2m1_groups(x, 1, HEAD_DIM)
    code = tl.where(rounded < 2.0, rounded * 2.0, tl.where(rounded < 4.0, rounded + 2.0, rounded * 0.5 + 4.0))
    negative = (x.to(tl.int32, bitcast=True) < 0).to(tl.int32)  # the sign bit (-0.0 too, as torch's copysign)
    code = tl.reshape(code.to(tl.int32), [HEAD_DIM]) | (tl.reshape(negative, [HEAD_DIM]) << 3)
    low, high = tl.split(tl.reshape(code, [HEAD_DIM // 2, 2]))
    tl.store(pool_ptr + row + tl.arange(0, HEAD_DIM // 2), (low | (high << 4)).to(tl.uint8))
    tl.store(pool_ptr + row + HEAD_DIM // 2 + tl.arange(0, GROUPS), tl.reshape(exponent, [GROUPS]).to(tl.uint8))


@triton.jit
def _store_indexer_fp4_kernel(keys_ptr, rows_ptr, pool_ptr, stride_k, stride_row, HEAD_DIM: tl.constexpr,
                              ROTATE: tl.constexpr, LOG_HEAD_DIM: tl.constexpr, PDL: tl.constexpr = False):
    """Program e: key e into its row."""
    wait_for_previous_kernel(PDL)
    e = tl.program_id(0).to(tl.int64)
    x = tl.load(keys_ptr + e * stride_k + tl.arange(0, HEAD_DIM)[None, :]).to(tl.float32)  # [1, HEAD_DIM]
    store_fp4_key(pool_ptr, tl.load(rows_ptr + e).to(tl.int64) * stride_row, x, HEAD_DIM, ROTATE, LOG_HEAD_DIM,
                  keys_ptr.dtype.element_ty)


def _check(values, pool, rows, width):
    assert values.dim() == 2 and values.stride(-1) == 1, "values [N, D], last dimension contiguous"
    assert pool.dtype == torch.uint8 and pool.shape[-1] == width and pool.is_contiguous(), \
        f"the pool must be contiguous uint8 [..., {width}], got {pool.dtype} {tuple(pool.shape)}"
    assert rows.shape == (values.shape[0],) and rows.dtype in (torch.int32, torch.int64), "rows [N] int"


def scale_slots(head_dim: int, rope_dim: int) -> int:
    """A power of two at least the scale bytes of an fp8 entry with their padding (what the kernels arange)."""
    return triton.next_power_of_2(padded8((head_dim - rope_dim) // KV_FP8_BLOCK))


def plan_store_kv_fp8(values, pool, rows, rope_dim):
    head_dim = values.shape[-1]
    width = kv_fp8_entry_bytes(head_dim, rope_dim)
    _check(values, pool, rows, width)
    assert head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two, got {head_dim}"
    if values.shape[0] == 0:
        return []
    args = (values, rows.contiguous(), pool, pool.view(torch.bfloat16), values.stride(0), width)
    kwargs = dict(HEAD_DIM=head_dim, ROPE_DIM=rope_dim, SCALE_SLOTS=scale_slots(head_dim, rope_dim),
                  num_warps=4 if head_dim >= 256 else 1)
    return [(_store_kv_fp8_kernel, (values.shape[0],), args, kwargs)]


def plan_store_indexer_fp4(keys, pool, rows, rotate: bool = False):
    head_dim = keys.shape[-1]
    width = indexer_fp4_entry_bytes(head_dim)
    _check(keys, pool, rows, width)
    assert head_dim & (head_dim - 1) == 0 and head_dim >= MXFP4_BLOCK, f"head_dim {head_dim}: a power of two >= 32"
    if keys.shape[0] == 0:
        return []
    args = (keys, rows.contiguous(), pool, keys.stride(0), width)
    return [(_store_indexer_fp4_kernel, (keys.shape[0],), args,
             dict(HEAD_DIM=head_dim, ROTATE=rotate, LOG_HEAD_DIM=head_dim.bit_length() - 1, num_warps=1))]


def store_kv_fp8_triton(values: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, rope_dim: int) -> None:
    """Triton version of `store_kv_fp8_reference`: one launch."""
    launch(plan_store_kv_fp8(values, pool, rows, rope_dim))


def store_indexer_fp4_triton(keys: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor,
                             rotate: bool = False) -> None:
    """Triton version of `store_indexer_fp4_reference`: one launch."""
    launch(plan_store_indexer_fp4(keys, pool, rows, rotate))
