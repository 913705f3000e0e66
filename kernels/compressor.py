"""DeepSeek-V4's compressors (CSA with overlap, HCA, the CSA indexer keys): close windows into the pools.

Entry w of a compressor with rate m is a gated, softmax-weighted sum of token projections (HCA: the m tokens
of window w, gate + position_bias; CSA: window w-1 through the first half of the projection and window w
through the second half), RMS-normed and rotated (compress rope) at position w * m: see
backend/model/compressor.py, which builds the per-step `CompressionPlan` on the host.

`compress_into_pool_reference` reads the request rings and this batch's projections, updates the rings,
computes the entries the plan closes and stores each at page block_table[entry_row, entry_index // page_size],
slot entry_index % page_size of `pool` [pages, page_size, d]. Entries with entry_row < 0 are padding (static
shapes for CUDA graphs): they go to the pool's last page, the scratch page no request owns
(backend/memory/paged_pool.py), so no mask or data-dependent shape is needed.

Kernel (`compress_into_pool_triton`): one program per closing entry and one per BLOCK_KEEP keep rows (ring updates,
and the prefix cache's snapshots into spare slots: backend/model/compressor.py).
  entry program   resolves its span's sources (a ring slot of its row, or a token of this batch), and over span
                  chunks of BLOCK_S positions x all head_dim channels: pass 1 an online max / sum of exp of
                  gate + position_bias (rounded to the dtype, as the reference adds them), pass 2 the softmax
                  weights rounded to the dtype times kv (the product rounded too), summed in fp32; then the
                  RMSNorm and the interleaved rope of the trailing channels (pairs split in registers) and one
                  store of the entry into its page and slot.
  keep program    copies BLOCK_KEEP (kv, gate) rows of the full projection width into their ring positions.
Launches: ONE when every row of the batch advances by one token (decode; also every padded static step): an entry
reads ring positions start - span + 1 .. start - 1 and the ring update writes position start, whose ring index
is that of start - ring, which no entry reads (span <= ring), so entry and keep programs cannot race. A batch
with longer rows (prefill chunks) may overwrite ring positions its entries read: TWO launches of the same kernel,
the entries first, then the ring updates. Snapshot rows (plan.num_snapshot_keep, first among the keep rows) may read
ring positions too and write only spare slots, which no entry reads: they go in the first launch. The launch shapes
come from the plan's tensor shapes and that count only. Two compressors over one plan (a CSA layer's and its
indexer's) run their launches together, one launch each (`pair_compress_launches`): each program is one of the first
compressor's or one of the second's, which read and write rings and pools of their own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.common import TL_DTYPES, launch, wait_for_previous_kernel
from kernels.kv_store import scale_slots, store_entries_reference, store_fp4_key, store_fp8_entry, store_keys_reference
from kernels.norm_rope import apply_rope, rms_factor, rms_norm
from kernels.quant_formats import indexer_fp4_entry_bytes, kv_fp8_entry_bytes


class CompressorRun(NamedTuple):
    """One compressor's part of a step: `compress_into_pool`'s arguments (`keys`: the indexer's keys)."""

    kv: torch.Tensor
    gate: torch.Tensor
    state_kv: torch.Tensor
    state_gate: torch.Tensor
    plan: object
    position_bias: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    entry_cos: torch.Tensor
    entry_sin: torch.Tensor
    pool: torch.Tensor
    block_table: torch.Tensor
    entry_dtype: torch.dtype | None = None
    keys: bool = False

    def run(self, compress_into_pool):
        """compress_into_pool(its arguments): `compress_into_pool_reference` or `_triton` run it,
        `plan_compress_into_pool` returns its launches."""
        return compress_into_pool(*self[:12], entry_dtype=self.entry_dtype, keys=self.keys)


def compress_into_pool_reference(kv: torch.Tensor, gate: torch.Tensor, state_kv: torch.Tensor,
                                 state_gate: torch.Tensor, plan, position_bias: torch.Tensor,
                                 norm_weight: torch.Tensor, eps: float, entry_cos: torch.Tensor,
                                 entry_sin: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor, *,
                                 entry_dtype: torch.dtype | None = None, keys: bool = False) -> None:
    """kv, gate: this batch's projections [T, width] (may be column views); state_*: one layer's rings
    [slots, ring, width]; entry_cos / entry_sin: the compress rope at plan.entry_pos. entry_dtype: the dtype the
    pooled entry is rounded to before its norm and rope (DeepSeek pools fp32 projections, then normalises in the
    model's dtype); None: kv's. `keys`: the pool holds the indexer's keys (a uint8 pool: rotated, then FP4)."""
    entries = _compress(kv, gate, state_kv, state_gate, plan, position_bias, norm_weight, eps, entry_cos, entry_sin,
                        entry_dtype)
    if not plan.num_entries:
        return
    rows = entry_destinations(plan, pool, block_table)
    if keys:
        store_keys_reference(entries, pool, rows)
    else:
        store_entries_reference(entries, pool, rows, 2 * entry_cos.shape[-1])


def compress_entries_reference(kv, gate, state_kv, state_gate, plan, position_bias, norm_weight, eps, entry_cos,
                               entry_sin, *, entry_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The entries the plan closes [N, head_dim] in entry_dtype, not stored (their values, which a pool of the fp8
    layout keeps only encoded); the rings updated as compress_into_pool_reference updates them."""
    return _compress(kv, gate, state_kv, state_gate, plan, position_bias, norm_weight, eps, entry_cos, entry_sin,
                     entry_dtype)


def entry_destinations(plan, pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The row of pool.view(-1, width) each entry the plan closes is stored at (a padding row: the scratch page's)."""
    page_size, index = pool.shape[1], plan.entry_index
    pages = block_table[plan.entry_row.clamp(min=0), index // page_size].long()
    return torch.where(plan.entry_row >= 0, pages * page_size + index % page_size, (pool.shape[0] - 1) * page_size)


def round_stored_entries(pool: torch.Tensor, plan, block_table: torch.Tensor, rounding) -> None:
    """Replace the entries the plan closed (just stored, by either implementation) by rounding(entries)."""
    if plan.num_entries == 0:
        return
    rows = pool.view(-1, pool.shape[-1])
    dest = entry_destinations(plan, pool, block_table)
    rows[dest] = rounding(rows[dest])


def _compress(kv: torch.Tensor, gate: torch.Tensor, state_kv: torch.Tensor, state_gate: torch.Tensor,
              plan, position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, entry_cos: torch.Tensor,
              entry_sin: torch.Tensor, entry_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Entries closed in this step [N, head_dim]; updates the ring state in place.

    kv, gate: this batch's projections [T, width]; state_*: one layer's rings [slots, ring, width].
    """
    width = kv.shape[-1]
    ring_kv = state_kv[plan.ring_slots[:, None], plan.ring_order].reshape(-1, width)
    ring_gate = state_gate[plan.ring_slots[:, None], plan.ring_order].reshape(-1, width)
    src_kv, src_gate = torch.cat([ring_kv, kv]), torch.cat([ring_gate, gate])
    state_kv[plan.keep_slot, plan.keep_pos] = src_kv[plan.keep_src]
    state_gate[plan.keep_slot, plan.keep_pos] = src_gate[plan.keep_src]
    entry_dtype = entry_dtype or kv.dtype
    if plan.num_entries == 0:
        return kv.new_zeros((0, norm_weight.shape[0]), dtype=entry_dtype)
    win_kv, win_gate = src_kv[plan.entry_src], src_gate[plan.entry_src]  # [N, span, width]
    if plan.overlap:
        head_dim, rate = width // 2, plan.rate
        win_kv = torch.cat([win_kv[:, :rate, :head_dim], win_kv[:, rate:, head_dim:]], dim=1)
        win_gate = torch.cat([win_gate[:, :rate, :head_dim] + position_bias[:, :head_dim],
                              win_gate[:, rate:, head_dim:] + position_bias[:, head_dim:]], dim=1)
    else:
        win_gate = win_gate + position_bias
    valid = plan.entry_valid[..., None]
    win_kv = torch.where(valid, win_kv, torch.zeros_like(win_kv))
    win_gate = win_gate.masked_fill(~valid, float("-inf"))
    weights = win_gate.softmax(dim=1, dtype=torch.float32).to(win_kv.dtype)
    entries = rms_norm((win_kv * weights).sum(dim=1).to(entry_dtype), norm_weight, eps)
    return apply_rope(entries, entry_cos, entry_sin)


# --- kernel -------------------------------------------------------------------------------------------------------
@triton.jit
def _source_rows(src, ring_slots_ptr, ring_order_ptr, num_ring_rows, stride_state_slot, stride_state_pos,
                 stride_kv_t, stride_gate_t, RING: tl.constexpr):
    """(from_ring, state offset, kv offset, gate offset) of source indices `src` (int64): index i < num_ring_rows
    is ring slot i % RING of batch row i // RING, the rest token i - num_ring_rows of this batch."""
    from_ring = src < num_ring_rows
    ring_row = tl.where(from_ring, src // RING, 0)
    slot = tl.load(ring_slots_ptr + ring_row).to(tl.int64)
    ring_pos = tl.load(ring_order_ptr + ring_row * RING + src % RING).to(tl.int64)
    token = tl.where(from_ring, 0, src - num_ring_rows)
    return from_ring, slot * stride_state_slot + ring_pos * stride_state_pos, token * stride_kv_t, token * stride_gate_t


@triton.jit
def _load_source(state_ptr, batch_ptr, from_ring, state_off, batch_off, cols, mask):
    """[rows, cols] values of kv (or gate) at the resolved sources (fp32 math follows the caller)."""
    ring = tl.load(state_ptr + state_off[:, None] + cols, mask=mask & from_ring[:, None], other=0.0)
    batch = tl.load(batch_ptr + batch_off[:, None] + cols, mask=mask & ~from_ring[:, None], other=0.0)
    return tl.where(from_ring[:, None], ring, batch)


@triton.jit
def _span_chunk(s0, e, d, d_mask, entry_src_ptr, entry_valid_ptr, ring_slots_ptr, ring_order_ptr, gate_ptr,
                state_gate_ptr, bias_ptr, num_ring_rows, stride_state_slot, stride_state_pos, stride_kv_t, stride_gate_t,
                stride_bias_s, RATE: tl.constexpr, RING: tl.constexpr, SPAN: tl.constexpr, OVERLAP: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """Span positions s0 .. s0 + BLOCK_S of entry e: (gate + position_bias logits in fp32, rounded to the dtype as
    the reference adds them, -inf where masked; mask [BLOCK_S, BLOCK_D]; the sources' from_ring, state and kv
    offsets; the columns, the Ca half for the first RATE positions of an overlapping span, then the Cb half)."""
    s = s0 + tl.arange(0, BLOCK_S)
    s_mask = s < SPAN
    src = tl.load(entry_src_ptr + e * SPAN + s, mask=s_mask, other=0).to(tl.int64)
    valid = (tl.load(entry_valid_ptr + e * SPAN + s, mask=s_mask, other=0) != 0) & s_mask
    from_ring, state_off, kv_off, gate_off = _source_rows(
        src, ring_slots_ptr, ring_order_ptr, num_ring_rows, stride_state_slot, stride_state_pos, stride_kv_t,
        stride_gate_t, RING)
    cols = d[None, :] + (tl.where(s >= RATE, HEAD_DIM, 0)[:, None] if OVERLAP else 0)
    mask = valid[:, None] & d_mask[None, :]
    gate = _load_source(state_gate_ptr, gate_ptr, from_ring, state_off, gate_off, cols, mask).to(tl.float32)
    bias = tl.load(bias_ptr + (s % RATE)[:, None] * stride_bias_s + cols, mask=mask, other=0.0).to(tl.float32)
    logit = (gate + bias).to(gate_ptr.dtype.element_ty).to(tl.float32)
    return tl.where(mask, logit, float("-inf")), mask, from_ring, state_off, kv_off, cols


@triton.jit
def _compress_program(
    pid,
    # this batch's projections and one layer's rings
    kv_ptr, gate_ptr, state_kv_ptr, state_gate_ptr,
    # the plan
    ring_slots_ptr, ring_order_ptr, entry_src_ptr, entry_valid_ptr, entry_row_ptr, entry_index_ptr,
    keep_src_ptr, keep_slot_ptr, keep_pos_ptr,
    # weights, rope at each entry, the pool (and, for the fp8 layout, the same memory as bf16)
    bias_ptr, norm_w_ptr, cos_ptr, sin_ptr, pool_ptr, pool_rope_ptr, block_table_ptr,
    # sizes
    num_entry_programs, keep_begin, keep_end, num_ring_rows, scratch_page, eps,
    # strides (last dimensions contiguous)
    stride_kv_t, stride_gate_t, stride_state_slot, stride_state_pos, stride_bias_s, stride_cos, stride_sin,
    stride_pool_page, stride_pool_slot, stride_bt,
    # model constants and tiles
    RATE: tl.constexpr, RING: tl.constexpr, SPAN: tl.constexpr, OVERLAP: tl.constexpr, HEAD_DIM: tl.constexpr,
    WIDTH: tl.constexpr, ROPE_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_KEEP: tl.constexpr, BLOCK_W: tl.constexpr,
    ENTRY_DTYPE: tl.constexpr,  # the pooled entry's dtype before its norm and rope (pooling is in kv's)
    FP8_POOL: tl.constexpr, SCALE_SLOTS: tl.constexpr,  # a uint8 pool of the fp8 layout: quantize on write
    FP4_KEYS: tl.constexpr, LOG_HEAD_DIM: tl.constexpr,  # a uint8 pool of indexer keys: rotate, then FP4
):
    """Program `pid` of a compressor's launch: a closing entry (pid < num_entry_programs), else BLOCK_KEEP keep rows."""
    dtype = kv_ptr.dtype.element_ty
    if pid >= num_entry_programs:  # keep rows keep_begin + (pid - num_entry_programs) * BLOCK_KEEP ... < keep_end
        m = keep_begin + (pid - num_entry_programs) * BLOCK_KEEP + tl.arange(0, BLOCK_KEEP)
        m_mask = m < keep_end
        src = tl.load(keep_src_ptr + m, mask=m_mask, other=0).to(tl.int64)
        from_ring, state_off, kv_off, gate_off = _source_rows(
            src, ring_slots_ptr, ring_order_ptr, num_ring_rows, stride_state_slot, stride_state_pos, stride_kv_t,
            stride_gate_t, RING)
        dest = (tl.load(keep_slot_ptr + m, mask=m_mask, other=0).to(tl.int64) * stride_state_slot
                + tl.load(keep_pos_ptr + m, mask=m_mask, other=0).to(tl.int64) * stride_state_pos)
        for w0 in range(0, WIDTH, BLOCK_W):
            cols = w0 + tl.arange(0, BLOCK_W)
            mask = m_mask[:, None] & (cols < WIDTH)[None, :]
            kv = _load_source(state_kv_ptr, kv_ptr, from_ring, state_off, kv_off, cols[None, :], mask)
            gate = _load_source(state_gate_ptr, gate_ptr, from_ring, state_off, gate_off, cols[None, :], mask)
            tl.store(state_kv_ptr + dest[:, None] + cols[None, :], kv, mask=mask)
            tl.store(state_gate_ptr + dest[:, None] + cols[None, :], gate, mask=mask)
        return

    e = pid.to(tl.int64)  # one closing entry
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    # pass 1: per channel, the max and the sum of exp of the gate logits over the span (online)
    m_i = tl.full([BLOCK_D], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, SPAN, BLOCK_S):
        logit, _, _, _, _, _ = _span_chunk(
            s0, e, d, d_mask, entry_src_ptr, entry_valid_ptr, ring_slots_ptr, ring_order_ptr, gate_ptr, state_gate_ptr,
            bias_ptr, num_ring_rows, stride_state_slot, stride_state_pos, stride_kv_t, stride_gate_t, stride_bias_s,
            RATE, RING, SPAN, OVERLAP, HEAD_DIM, BLOCK_S)
        m_new = tl.maximum(m_i, tl.max(logit, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(logit - m_safe[None, :]), 0)
        m_i = m_new
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    # pass 2: sum of kv * softmax weight, each rounded to the dtype as in the reference
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, SPAN, BLOCK_S):
        logit, mask, from_ring, state_off, kv_off, cols = _span_chunk(
            s0, e, d, d_mask, entry_src_ptr, entry_valid_ptr, ring_slots_ptr, ring_order_ptr, gate_ptr, state_gate_ptr,
            bias_ptr, num_ring_rows, stride_state_slot, stride_state_pos, stride_kv_t, stride_gate_t, stride_bias_s,
            RATE, RING, SPAN, OVERLAP, HEAD_DIM, BLOCK_S)
        weight = tl.where(mask, tl.exp(logit - m_safe[None, :]) / l_safe[None, :], 0.0).to(dtype).to(tl.float32)
        kv = _load_source(state_kv_ptr, kv_ptr, from_ring, state_off, kv_off, cols, mask).to(tl.float32)
        acc += tl.sum((kv * weight).to(dtype).to(tl.float32), 0)
    # RMSNorm (weighted), then the rope of the trailing ROPE_DIM channels, pairs (2i, 2i + 1)
    x = acc.to(ENTRY_DTYPE).to(tl.float32)
    r = rms_factor(tl.sum(x * x, 0), HEAD_DIM, eps)
    w = tl.load(norm_w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    y = (w * (x * r)).to(ENTRY_DTYPE).to(tl.float32)
    even, odd = tl.split(tl.reshape(y, [BLOCK_D // 2, 2]))
    pair = tl.arange(0, BLOCK_D // 2)
    j = pair - (HEAD_DIM - ROPE_DIM) // 2  # pair index within the rope section
    is_rope = (j >= 0) & (pair < HEAD_DIM // 2)
    j = tl.where(is_rope, j, 0)
    cos = tl.load(cos_ptr + e * stride_cos + j, mask=is_rope, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + e * stride_sin + j, mask=is_rope, other=0.0).to(tl.float32)
    even_r = tl.where(is_rope, (even * cos - odd * sin).to(ENTRY_DTYPE).to(tl.float32), even)
    odd_r = tl.where(is_rope, (odd * cos + even * sin).to(ENTRY_DTYPE).to(tl.float32), odd)
    y = tl.reshape(tl.join(even_r, odd_r), [BLOCK_D])
    # at page block_table[row, index // PAGE_SIZE] (the scratch page for padding), slot index % PAGE_SIZE
    row = tl.load(entry_row_ptr + e).to(tl.int64)
    index = tl.load(entry_index_ptr + e).to(tl.int64)
    page = tl.load(block_table_ptr + tl.maximum(row, 0) * stride_bt + index // PAGE_SIZE).to(tl.int64)
    page = tl.where(row >= 0, page, scratch_page)
    offset = page * stride_pool_page + (index % PAGE_SIZE) * stride_pool_slot
    if FP8_POOL:  # (BLOCK_D == HEAD_DIM)
        store_fp8_entry(pool_ptr, pool_rope_ptr, offset, y.to(ENTRY_DTYPE).to(tl.float32), HEAD_DIM, ROPE_DIM,
                        SCALE_SLOTS)
    elif FP4_KEYS:  # (BLOCK_D == HEAD_DIM)
        store_fp4_key(pool_ptr, offset, tl.reshape(y.to(ENTRY_DTYPE).to(tl.float32), [1, BLOCK_D]), HEAD_DIM,
                      True, LOG_HEAD_DIM, ENTRY_DTYPE)
    else:
        tl.store(pool_ptr + offset + d, y.to(ENTRY_DTYPE), mask=d_mask)


@triton.jit(do_not_specialize=["num_entry_programs", "keep_begin", "keep_end", "num_ring_rows"])
def _compress_kernel(
    # this batch's projections and one layer's rings
    kv_ptr, gate_ptr, state_kv_ptr, state_gate_ptr,
    # the plan
    ring_slots_ptr, ring_order_ptr, entry_src_ptr, entry_valid_ptr, entry_row_ptr, entry_index_ptr,
    keep_src_ptr, keep_slot_ptr, keep_pos_ptr,
    # weights, rope at each entry, the pool (and, for the fp8 layout, the same memory as bf16)
    bias_ptr, norm_w_ptr, cos_ptr, sin_ptr, pool_ptr, pool_rope_ptr, block_table_ptr,
    # sizes
    num_entry_programs, keep_begin, keep_end, num_ring_rows, scratch_page, eps,
    # strides (last dimensions contiguous)
    stride_kv_t, stride_gate_t, stride_state_slot, stride_state_pos, stride_bias_s, stride_cos, stride_sin,
    stride_pool_page, stride_pool_slot, stride_bt,
    # model constants and tiles
    RATE: tl.constexpr, RING: tl.constexpr, SPAN: tl.constexpr, OVERLAP: tl.constexpr, HEAD_DIM: tl.constexpr,
    WIDTH: tl.constexpr, ROPE_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_KEEP: tl.constexpr, BLOCK_W: tl.constexpr,
    ENTRY_DTYPE: tl.constexpr,  # the pooled entry's dtype before its norm and rope (pooling is in kv's)
    FP8_POOL: tl.constexpr, SCALE_SLOTS: tl.constexpr,  # a uint8 pool of the fp8 layout: quantize on write
    FP4_KEYS: tl.constexpr, LOG_HEAD_DIM: tl.constexpr,  # a uint8 pool of indexer keys: rotate, then FP4
    PDL: tl.constexpr = False,  # launched to wait for the kernel before it (common.launch)
):
    """One compressor's launch: its entries' programs, then its keep rows' (`_compress_program`)."""
    wait_for_previous_kernel(PDL)
    _compress_program(
        tl.program_id(0),
        kv_ptr, gate_ptr, state_kv_ptr, state_gate_ptr, ring_slots_ptr, ring_order_ptr, entry_src_ptr,
        entry_valid_ptr, entry_row_ptr, entry_index_ptr, keep_src_ptr, keep_slot_ptr, keep_pos_ptr, bias_ptr,
        norm_w_ptr, cos_ptr, sin_ptr, pool_ptr, pool_rope_ptr, block_table_ptr, num_entry_programs, keep_begin,
        keep_end, num_ring_rows, scratch_page, eps, stride_kv_t, stride_gate_t, stride_state_slot,
        stride_state_pos, stride_bias_s, stride_cos, stride_sin, stride_pool_page, stride_pool_slot, stride_bt,
        RATE, RING, SPAN, OVERLAP, HEAD_DIM, WIDTH, ROPE_DIM, PAGE_SIZE, BLOCK_S, BLOCK_D, BLOCK_KEEP, BLOCK_W,
        ENTRY_DTYPE, FP8_POOL, SCALE_SLOTS, FP4_KEYS, LOG_HEAD_DIM,
    )


@triton.jit(do_not_specialize=["num_entry_programs", "keep_begin", "keep_end", "num_ring_rows", "programs_a",
                            "num_entry_programs_b", "keep_begin_b", "keep_end_b", "num_ring_rows_b"])
def _compress_pair_kernel(
    # the first compressor's arguments as `_compress_kernel` takes them, its program count, the second's (suffix _b)
    kv_ptr, gate_ptr, state_kv_ptr, state_gate_ptr, ring_slots_ptr, ring_order_ptr, entry_src_ptr, entry_valid_ptr,
    entry_row_ptr, entry_index_ptr, keep_src_ptr, keep_slot_ptr, keep_pos_ptr, bias_ptr, norm_w_ptr, cos_ptr,
    sin_ptr, pool_ptr, pool_rope_ptr, block_table_ptr, num_entry_programs, keep_begin, keep_end, num_ring_rows,
    scratch_page, eps, stride_kv_t, stride_gate_t, stride_state_slot, stride_state_pos, stride_bias_s, stride_cos,
    stride_sin, stride_pool_page, stride_pool_slot, stride_bt, programs_a, kv_ptr_b, gate_ptr_b, state_kv_ptr_b,
    state_gate_ptr_b, ring_slots_ptr_b, ring_order_ptr_b, entry_src_ptr_b, entry_valid_ptr_b, entry_row_ptr_b,
    entry_index_ptr_b, keep_src_ptr_b, keep_slot_ptr_b, keep_pos_ptr_b, bias_ptr_b, norm_w_ptr_b, cos_ptr_b,
    sin_ptr_b, pool_ptr_b, pool_rope_ptr_b, block_table_ptr_b, num_entry_programs_b, keep_begin_b, keep_end_b,
    num_ring_rows_b, scratch_page_b, eps_b, stride_kv_t_b, stride_gate_t_b, stride_state_slot_b,
    stride_state_pos_b, stride_bias_s_b, stride_cos_b, stride_sin_b, stride_pool_page_b, stride_pool_slot_b,
    stride_bt_b,
    # the first compressor's constants, the second's
    RATE: tl.constexpr, RING: tl.constexpr, SPAN: tl.constexpr, OVERLAP: tl.constexpr, HEAD_DIM: tl.constexpr,
    WIDTH: tl.constexpr, ROPE_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_KEEP: tl.constexpr, BLOCK_W: tl.constexpr, ENTRY_DTYPE: tl.constexpr,
    FP8_POOL: tl.constexpr, SCALE_SLOTS: tl.constexpr, FP4_KEYS: tl.constexpr, LOG_HEAD_DIM: tl.constexpr,
    RATE_b: tl.constexpr, RING_b: tl.constexpr, SPAN_b: tl.constexpr, OVERLAP_b: tl.constexpr,
    HEAD_DIM_b: tl.constexpr, WIDTH_b: tl.constexpr, ROPE_DIM_b: tl.constexpr, PAGE_SIZE_b: tl.constexpr,
    BLOCK_S_b: tl.constexpr, BLOCK_D_b: tl.constexpr, BLOCK_KEEP_b: tl.constexpr, BLOCK_W_b: tl.constexpr,
    ENTRY_DTYPE_b: tl.constexpr, FP8_POOL_b: tl.constexpr, SCALE_SLOTS_b: tl.constexpr, FP4_KEYS_b: tl.constexpr,
    LOG_HEAD_DIM_b: tl.constexpr,
    PDL: tl.constexpr = False,  # launched to wait for the kernel before it (common.launch)
):
    """Two compressors in one launch (a CSA layer's and its indexer's, over one plan): programs_a programs of the
    first's launch, then the second's."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    if pid < programs_a:
        _compress_program(
            pid,
            kv_ptr, gate_ptr, state_kv_ptr, state_gate_ptr, ring_slots_ptr, ring_order_ptr, entry_src_ptr,
            entry_valid_ptr, entry_row_ptr, entry_index_ptr, keep_src_ptr, keep_slot_ptr, keep_pos_ptr, bias_ptr,
            norm_w_ptr, cos_ptr, sin_ptr, pool_ptr, pool_rope_ptr, block_table_ptr, num_entry_programs, keep_begin,
            keep_end, num_ring_rows, scratch_page, eps, stride_kv_t, stride_gate_t, stride_state_slot,
            stride_state_pos, stride_bias_s, stride_cos, stride_sin, stride_pool_page, stride_pool_slot, stride_bt,
            RATE, RING, SPAN, OVERLAP, HEAD_DIM, WIDTH, ROPE_DIM, PAGE_SIZE, BLOCK_S, BLOCK_D, BLOCK_KEEP, BLOCK_W,
            ENTRY_DTYPE, FP8_POOL, SCALE_SLOTS, FP4_KEYS, LOG_HEAD_DIM,
        )
    else:
        _compress_program(
            pid - programs_a,
            kv_ptr_b, gate_ptr_b, state_kv_ptr_b, state_gate_ptr_b, ring_slots_ptr_b, ring_order_ptr_b,
            entry_src_ptr_b, entry_valid_ptr_b, entry_row_ptr_b, entry_index_ptr_b, keep_src_ptr_b,
            keep_slot_ptr_b, keep_pos_ptr_b, bias_ptr_b, norm_w_ptr_b, cos_ptr_b, sin_ptr_b, pool_ptr_b,
            pool_rope_ptr_b, block_table_ptr_b, num_entry_programs_b, keep_begin_b, keep_end_b, num_ring_rows_b,
            scratch_page_b, eps_b, stride_kv_t_b, stride_gate_t_b, stride_state_slot_b, stride_state_pos_b,
            stride_bias_s_b, stride_cos_b, stride_sin_b, stride_pool_page_b, stride_pool_slot_b, stride_bt_b,
            RATE_b, RING_b, SPAN_b, OVERLAP_b, HEAD_DIM_b, WIDTH_b, ROPE_DIM_b, PAGE_SIZE_b, BLOCK_S_b, BLOCK_D_b,
            BLOCK_KEEP_b, BLOCK_W_b, ENTRY_DTYPE_b, FP8_POOL_b, SCALE_SLOTS_b, FP4_KEYS_b, LOG_HEAD_DIM_b,
        )


def compress_config(span: int, head_dim: int, width: int) -> dict:
    """Tiles from the model's shapes alone: BLOCK_D = the head padded to a power of two, BLOCK_S span positions
    per chunk for about 4K elements a tile; keep rows of BLOCK_W <= 1024 channels, ~4K elements a tile."""
    block_d = max(2, triton.next_power_of_2(head_dim))
    block_s = max(1, min(triton.next_power_of_2(span), 4096 // block_d))
    block_w = min(1024, triton.next_power_of_2(width))
    return dict(BLOCK_S=block_s, BLOCK_D=block_d, BLOCK_W=block_w, BLOCK_KEEP=max(1, 4096 // block_w),
                num_warps=4 if block_d * block_s <= 2048 else 8)


def plan_compress_into_pool(kv, gate, state_kv, state_gate, plan, position_bias, norm_weight, eps, entry_cos,
                            entry_sin, pool, block_table, config: dict | None = None, entry_dtype=None,
                            keys: bool = False):
    """Check shapes; return the launches (kernel, grid, args, kwargs) of `compress_into_pool_triton`: none when
    nothing closes and nothing is kept, one for a batch of one-token rows, else two (entries and snapshots, then
    the rings)."""
    width = kv.shape[-1]
    head_dim = norm_weight.shape[0]
    span, ring = plan.entry_src.shape[1], plan.ring
    num_rows, num_entries, num_keep = plan.ring_slots.shape[0], plan.entry_src.shape[0], plan.keep_src.shape[0]
    assert width == (2 * head_dim if plan.overlap else head_dim), f"projection width {width}, head_dim {head_dim}"
    assert gate.shape == kv.shape and kv.stride(-1) == 1 and gate.stride(-1) == 1, "kv / gate [T, width], last dim contiguous"
    assert state_kv.shape == state_gate.shape and state_kv.shape[1:] == (ring, width) and state_kv.stride(-1) == 1 \
        and state_kv.stride() == state_gate.stride(), f"rings must be [slots, {ring}, {width}]"
    assert tuple(position_bias.shape) == (plan.rate, width) and position_bias.stride(-1) == 1, "position_bias [rate, width]"
    rope_dim = 2 * entry_cos.shape[-1]
    fp4_keys = keys and pool.dtype == torch.uint8
    fp8_pool = pool.dtype == torch.uint8 and not keys
    entry_width = (kv_fp8_entry_bytes(head_dim, rope_dim) if fp8_pool else
                   indexer_fp4_entry_bytes(head_dim) if fp4_keys else head_dim)
    assert pool.dim() == 3 and pool.shape[-1] == entry_width and pool.stride(-1) == 1, \
        f"pool [pages, page_size, {entry_width}]"
    assert entry_cos.shape[0] == num_entries and entry_sin.shape == entry_cos.shape and rope_dim <= head_dim
    assert head_dim % 2 == 0, "the rope pairs channels"
    if num_entries == 0 and num_keep == 0:
        return []
    cfg = config or compress_config(span, head_dim, width)
    assert not (fp8_pool or fp4_keys) or cfg["BLOCK_D"] == head_dim, \
        "the fp8 layout quantizes whole entries: BLOCK_D == head_dim"
    contiguous = lambda t: t if t.is_contiguous() else t.contiguous()  # noqa: E731 (plans are built contiguous)
    entry_cos, entry_sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (entry_cos, entry_sin))
    entry_valid = contiguous(plan.entry_valid)
    entry_valid = entry_valid.view(torch.uint8) if entry_valid.dtype == torch.bool else entry_valid
    tensors = (kv, gate, state_kv, state_gate, contiguous(plan.ring_slots), contiguous(plan.ring_order),
               contiguous(plan.entry_src), entry_valid, contiguous(plan.entry_row), contiguous(plan.entry_index),
               contiguous(plan.keep_src), contiguous(plan.keep_slot), contiguous(plan.keep_pos),
               position_bias, norm_weight, entry_cos, entry_sin, pool,
               pool.view(torch.bfloat16) if fp8_pool else pool, block_table)
    strides = (kv.stride(0), gate.stride(0), state_kv.stride(0), state_kv.stride(1), position_bias.stride(0),
               entry_cos.stride(0), entry_sin.stride(0), pool.stride(0), pool.stride(1), block_table.stride(0))
    kwargs = dict(RATE=plan.rate, RING=ring, SPAN=span, OVERLAP=bool(plan.overlap), HEAD_DIM=head_dim, WIDTH=width,
                  ROPE_DIM=rope_dim, PAGE_SIZE=pool.shape[1],
                  ENTRY_DTYPE=TL_DTYPES[entry_dtype or kv.dtype], FP8_POOL=fp8_pool,
                  SCALE_SLOTS=scale_slots(head_dim, rope_dim) if fp8_pool else 8, FP4_KEYS=fp4_keys,
                  LOG_HEAD_DIM=head_dim.bit_length() - 1, **cfg)
    scratch_page = pool.shape[0] - 1

    def launch(entries, keep_begin, keep_end):  # programs: `entries` entries, then keep rows [keep_begin, keep_end)
        programs = entries + triton.cdiv(keep_end - keep_begin, cfg["BLOCK_KEEP"])
        args = (*tensors, entries, keep_begin, keep_end, num_rows * ring, scratch_page, float(eps), *strides)
        return [(_compress_kernel, (programs,), args, kwargs)] if programs else []

    if num_keep == num_rows:  # every row advances by one token (no snapshots): entries and ring updates cannot race
        return launch(num_entries, 0, num_keep)
    snapshots = plan.num_snapshot_keep
    return launch(num_entries, 0, snapshots) + launch(0, snapshots, num_keep)


LAUNCH_OPTIONS = ("num_warps", "num_stages")


def pair_compress_launches(first: list, second: list) -> list:
    """Two compressors' launches over one plan (`plan_compress_into_pool`'s, a CSA layer's and its indexer's: the
    same entries and keep rows, so the same launches) as one launch each (`_compress_pair_kernel`): the first's
    programs, then the second's, at the larger of their warp counts. Launches that do not pair up stay apart."""
    if len(first) != len(second):
        return first + second
    paired = []
    for (_, (programs_a,), args_a, kwargs_a), (_, (programs_b,), args_b, kwargs_b) in zip(first, second):
        constants = {k: v for k, v in kwargs_a.items() if k not in LAUNCH_OPTIONS}
        constants |= {f"{k}_b": v for k, v in kwargs_b.items() if k not in LAUNCH_OPTIONS}
        options = {k: max(kwargs_a[k], kwargs_b[k]) for k in LAUNCH_OPTIONS if k in kwargs_a and k in kwargs_b}
        paired.append((_compress_pair_kernel, (programs_a + programs_b,), (*args_a, programs_a, *args_b),
                       constants | options))
    return paired


def compress_into_pool_triton(kv, gate, state_kv, state_gate, plan, position_bias, norm_weight, eps, entry_cos,
                              entry_sin, pool, block_table, config: dict | None = None, *, entry_dtype=None,
                              keys: bool = False) -> None:
    """Triton version of `compress_into_pool_reference` (same arguments and effects)."""
    launch(plan_compress_into_pool(kv, gate, state_kv, state_gate, plan, position_bias, norm_weight, eps, entry_cos,
                                   entry_sin, pool, block_table, config, entry_dtype, keys))
