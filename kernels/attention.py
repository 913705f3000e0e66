"""DeepSeek-V4 sparse attention over paged memory: sliding window + compressed entries + sinks.

Math, for query token t of batch row b = token_seq[t] at absolute position p = token_pos[t], head h:
  window keys   K_w = { kv at positions j in [max(0, p - window + 1), p] }   (read through the page table)
  compressed    K_c = HCA: { entry e : 0 <= e < (p + 1) // compress_rate }   (topk_indices is None)
                      CSA: { entry e = topk_indices[t, i] : 0 <= e < (p + 1) // compress_rate }  (others ignored,
                           so the indexer's raw top-k over -inf-masked scores needs no masking launch)
  logits        s_j = scale * q[t, h] . k_j      for k_j in K_w ∪ K_c, plus one sink logit sinks[h]
  out[t, h]   = sum_j softmax(s ∪ {sink})_j * k_j       (shared K = V; the sink carries mass, no value)
All softmax arithmetic in fp32. As the model calls it (q_norm_eps, rope), q is first normed per head and its trailing
rope channels rotated as it is loaded, and the output's rotated back as it is stored (V = K carries the rotation):
what the norm_rope launches before and after the attention would write.

Layouts (one layer's slice of each pool):
  q                  [T, H, D]
  window_kv          [num_window_pages, page_size, D]
  window_block_table [B, W] int32: column c holds the physical page of logical page window_first_page[b] + c
  window_first_page  [B] int64
  comp_kv            [num_comp_pages, page_size, D]; entry e of row b lives at
                     page comp_block_table[b, e // page_size], slot e % page_size
  comp_block_table   [B, C] int32
  topk_indices       [T, K] int32 / int64 or None
  With kv_cache_dtype fp8 both pools are uint8 [pages, page_size, entry bytes] in DeepSeek's layout (rope_dim
  names its bf16 part; kernels/quant_formats.py); the kernel decodes each key block in registers.

Kernel (`sparse_paged_attention_triton`): one program per (query token, block of BLOCK_H heads, KV split);
grid (T, cdiv(H, BLOCK_H), num_splits). The heads of a token share every key (MQA, K = V), so the query
block q[t, heads] is the M side of both tl.dot calls: S = q K^T [BLOCK_H, BLOCK_N], acc += P K, each over two
halves of the head dim (q, K and acc as two tiles: at V4's 512 the compiled loop issues a fifth fewer instructions
than with whole rows, and the fp8 layout decodes a block of 32 keys without spilling). A token's
keys form a list of BLOCK_N-blocks, window blocks first (positions window_lo .. p through the page table),
then compressed blocks (HCA: entries 0 .. (p+1)//rate - 1; CSA: topk_indices[t], -1 masked); split s takes
a contiguous run of cdiv(num_blocks, num_splits) blocks. Online softmax in base 2 and fp32: with one split the
running max starts at the sink logit (l = 1) and the program writes the normalised output; with several splits
each writes acc / l and log2(sum exp2) to fp32 scratch, and `_split_kv_combine_kernel` (grid (T, H)) merges
them with the sink. Mixed batches need nothing special: every token reads its own row, position and keys.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.common import (compiled_programs_per_sm, compute_dtype, launch, launch_options, num_sms, row_alignment,
                            wait_for_previous_kernel)
from kernels.norm_rope import norm_rope_reference, norm_rope_tile, normed_rows, rms_factor, rope_tail
from kernels.quant_formats import decode_kv_entries, kv_fp8_entry_bytes, load_kv_entries
from kernels.tuning import dtype_name, tuned

_MAX_SPLITS = 32
MODES = ("window", "hca", "csa")  # COMP_MODE 0, 1, 2
# Registers per thread assumed off a GPU (where the kernel is not compiled for a device): about the 138-173 that
# sm_90 gives V4-Flash's configurations (scripts/check_kernels_compile.py), so the interpreter picks GPU-like splits.
_ASSUMED_REGISTERS = 168
_LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(q0, q1, k0, k1, key_mask, m_i, l_i, acc0, acc1, scale_log2,
                         COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One block of keys, every tile in two halves of the head dim: logits in base 2 (q0 k0^T + q1 k1^T), running max
    m_i, running sum l_i, (acc0, acc1) += p @ (k0, k1) (K = V)."""
    s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION)
    s = tl.dot(q1, tl.trans(k1), s, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N]
    s = tl.where(key_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: avoid -inf - -inf
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(COMPUTE_DTYPE)
    acc0 = tl.dot(p, k0, acc0 * alpha[:, None], input_precision=DOT_PRECISION)
    acc1 = tl.dot(p, k1, acc1 * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc0, acc1


@triton.jit
def _attend(q0, q1, m_i, l_i, acc0, acc1, kv_ptr, rope_ptr, page, slot, stride_page, stride_slot, key_mask,
            scale_log2, HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, KV_FP8: tl.constexpr,
            COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr):
    """The online softmax over one block of keys at (page, slot) of a pool, read (and decoded) half by half."""
    HALF: tl.constexpr = HEAD_DIM // 2
    k0 = load_kv_entries(kv_ptr, rope_ptr, page, slot, stride_page, stride_slot, key_mask, HEAD_DIM, ROPE_DIM, KV_FP8,
                         COMPUTE_DTYPE, ALIGN, 0, HALF)
    k1 = load_kv_entries(kv_ptr, rope_ptr, page, slot, stride_page, stride_slot, key_mask, HEAD_DIM, ROPE_DIM, KV_FP8,
                         COMPUTE_DTYPE, ALIGN, HALF, HALF)
    return _online_softmax_step(q0, q1, k0, k1, key_mask, m_i, l_i, acc0, acc1, scale_log2, COMPUTE_DTYPE,
                                DOT_PRECISION)


# Arguments that vary from step to step are not specialised (divisibility by 16, == 1), so that a new batch
# never JIT-compiles a second variant mid-stream.
@triton.jit(do_not_specialize=["num_topk", "num_splits", "stride_topk_t", "stride_ot", "stride_oh", "stride_lse_t",
                             "stride_lse_h"])
def _sparse_paged_attention_kernel(
    # pointers
    q_ptr, sinks_ptr, token_seq_ptr, token_pos_ptr,
    window_kv_ptr, window_rope_ptr, window_table_ptr, window_first_page_ptr,
    comp_kv_ptr, comp_rope_ptr, comp_table_ptr, topk_ptr,
    out_ptr, lse_ptr, cos_ptr, sin_ptr,
    # sizes
    num_heads, window, compress_rate, num_topk, window_page_size, comp_page_size, num_splits, scale_log2, q_norm_eps,
    # strides (the last dimension of every tensor is contiguous)
    stride_qt, stride_qh, stride_ct, stride_st,
    stride_wkv_page, stride_wkv_slot, stride_wtab_b,
    stride_ckv_page, stride_ckv_slot, stride_ctab_b,
    stride_topk_t,
    stride_ot, stride_oh, stride_os,
    stride_lse_t, stride_lse_h,
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    COMP_MODE: tl.constexpr,  # 0: window only, 1: HCA (all causal entries), 2: CSA (topk_indices)
    IS_SPLIT: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, ROPE_DIM: tl.constexpr,  # pools of the fp8 layout's bytes (kernels/quant_formats.py)
    WINDOW_ALIGN: tl.constexpr, COMP_ALIGN: tl.constexpr,  # the pools' entries start at multiples of these elements
    Q_NORM: tl.constexpr, QUERY_ROPE: tl.constexpr,  # q normed per head / roped (and the output un-roped) here
    PDL: tl.constexpr = False,  # launched to wait for the kernel before it (common.launch)
):
    """Program (token t, head block, split): online softmax over its share of the token's key blocks."""
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    head_mask = heads < num_heads
    HALF: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HALF)  # the columns of a half
    seq = tl.load(token_seq_ptr + t).to(tl.int64)
    pos = tl.load(token_pos_ptr + t).to(tl.int32)  # positions, entries, pages and slots fit 32 bits: cheap divisions

    q0, q1 = _queries(q_ptr + t * stride_qt + heads[:, None] * stride_qh, head_mask, cos_ptr + t * stride_ct,
                      sin_ptr + t * stride_st, q_norm_eps, HEAD_DIM, Q_NORM, QUERY_ROPE)
    q0, q1 = q0.to(COMPUTE_DTYPE), q1.to(COMPUTE_DTYPE)  # [BLOCK_H, HALF] each
    if IS_SPLIT:  # the combine kernel adds the sink
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
    else:  # start from the sink: it carries probability mass exp(sink) and no value
        m_i = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc0 = tl.zeros([BLOCK_H, HALF], tl.float32)
    acc1 = tl.zeros([BLOCK_H, HALF], tl.float32)

    # Key blocks of this token: window blocks first, then compressed blocks; a split takes a contiguous run.
    window_lo = tl.maximum(pos - window + 1, 0)
    num_window_blocks = tl.cdiv(pos - window_lo + 1, BLOCK_N)
    num_causal = (pos + 1) // compress_rate  # compressed entries closed by position pos
    if COMP_MODE == 1:
        num_comp = num_causal
    elif COMP_MODE == 2:
        num_comp = num_topk + 0 * pos
    else:
        num_comp = 0 * pos
    num_blocks = num_window_blocks + tl.cdiv(num_comp, BLOCK_N)
    blocks_per_split = tl.cdiv(num_blocks, num_splits)
    block_lo = split * blocks_per_split
    block_hi = tl.minimum(block_lo + blocks_per_split, num_blocks)

    first_page = tl.load(window_first_page_ptr + seq).to(tl.int32)
    for blk in range(block_lo, tl.minimum(block_hi, num_window_blocks)):
        key_pos = window_lo + blk * BLOCK_N + tl.arange(0, BLOCK_N)
        key_mask = key_pos <= pos
        col = key_pos // window_page_size - first_page
        page = tl.load(window_table_ptr + seq * stride_wtab_b + col, mask=key_mask, other=0).to(tl.int64)
        slot = key_pos % window_page_size
        m_i, l_i, acc0, acc1 = _attend(q0, q1, m_i, l_i, acc0, acc1, window_kv_ptr, window_rope_ptr, page, slot,
                                       stride_wkv_page, stride_wkv_slot, key_mask, scale_log2, HEAD_DIM, ROPE_DIM,
                                       KV_FP8, COMPUTE_DTYPE, DOT_PRECISION, WINDOW_ALIGN)
    if COMP_MODE != 0:
        comp_lo = tl.maximum(block_lo, num_window_blocks) - num_window_blocks
        for blk in range(comp_lo, block_hi - num_window_blocks):
            idx = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            if COMP_MODE == 2:
                entry = tl.load(topk_ptr + t * stride_topk_t + idx, mask=idx < num_comp, other=-1).to(tl.int32)
                key_mask = (entry >= 0) & (entry < num_causal)
                entry = tl.where(key_mask, entry, 0)
            else:
                entry = idx
                key_mask = idx < num_comp
            page = tl.load(comp_table_ptr + seq * stride_ctab_b + entry // comp_page_size,
                           mask=key_mask, other=0).to(tl.int64)
            slot = entry % comp_page_size
            m_i, l_i, acc0, acc1 = _attend(q0, q1, m_i, l_i, acc0, acc1, comp_kv_ptr, comp_rope_ptr, page, slot,
                                           stride_ckv_page, stride_ckv_slot, key_mask, scale_log2, HEAD_DIM, ROPE_DIM,
                                           KV_FP8, COMPUTE_DTYPE, DOT_PRECISION, COMP_ALIGN)

    out_ptrs = out_ptr + t * stride_ot + heads[:, None] * stride_oh + split * stride_os + dims[None, :]
    if IS_SPLIT:  # normalised partial output and its log2-sum-exp2; an empty split has lse = -inf
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(out_ptrs, acc0 / l_safe[:, None], mask=head_mask[:, None])
        tl.store(out_ptrs + HALF, acc1 / l_safe[:, None], mask=head_mask[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + t * stride_lse_t + heads * stride_lse_h + split, lse, mask=head_mask)
    else:
        out1 = (acc1 / l_i[:, None]).to(out_ptr.dtype.element_ty)
        if QUERY_ROPE > 0:  # V was rotated as K: the output is rotated back (the rope is in the second half)
            out1 = rope_tail(out1, cos_ptr + t * stride_ct, sin_ptr + t * stride_st, BLOCK_H, HALF, QUERY_ROPE, True)
        tl.store(out_ptrs, (acc0 / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
        tl.store(out_ptrs + HALF, out1, mask=head_mask[:, None])


@triton.jit
def _queries(q_rows, head_mask, cos_row, sin_row, eps, HEAD_DIM: tl.constexpr, Q_NORM: tl.constexpr,
             QUERY_ROPE: tl.constexpr):
    """The block's queries as two halves of the head dim (q's dtype), normed per head (Q_NORM: the unweighted RMSNorm,
    its factor rounded to q's dtype as `unweighted_rms_norm`) and their trailing QUERY_ROPE channels rotated (in the
    second half): what the norm_rope kernel would have written, by its own tile function. The rope lanes read their
    partners with a second load, as there: a tile taken apart in registers would change q's layout, and the compiled
    loop then reshuffles q at every key block (a third more instructions)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HALF)
    q0 = tl.load(q_rows + dims[None, :], mask=head_mask[:, None], other=0.0)
    q1 = tl.load(q_rows + HALF + dims[None, :], mask=head_mask[:, None], other=0.0)
    r = tl.zeros([q0.shape[0]], tl.float32)
    if Q_NORM:
        f0, f1 = q0.to(tl.float32), q1.to(tl.float32)
        sumsq = tl.sum(f0 * f0, 1) + tl.sum(f1 * f1, 1)
        r = rms_factor(sumsq, HEAD_DIM, eps).to(q0.dtype).to(tl.float32)
    q0 = normed_rows(q0, r, r, Q_NORM, False)  # (the weight argument is unread without a weight)
    q1 = norm_rope_tile(q1, q_rows, q_rows, cos_row, sin_row, HALF + dims, head_mask, r, 0, 0, 0, HEAD_DIM,
                        QUERY_ROPE, Q_NORM, False, False)
    return q0, q1


@triton.jit(do_not_specialize=["num_splits", "stride_pt", "stride_ph", "stride_lse_t", "stride_lse_h"])
def _split_kv_combine_kernel(
    partial_ptr, lse_ptr, sinks_ptr, out_ptr, cos_ptr, sin_ptr,
    num_splits,
    stride_pt, stride_ph, stride_ps,
    stride_lse_t, stride_lse_h,
    stride_ot, stride_oh, stride_ct, stride_st,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, QUERY_ROPE: tl.constexpr,
    PDL: tl.constexpr = False,  # launched to wait for the kernel before it (common.launch)
):
    """Program (token t, head h): merge the splits' partial outputs with the sink, in base 2."""
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    lse_row = lse_ptr + t * stride_lse_t + h * stride_lse_h
    lse = tl.load(lse_row + splits, mask=splits < num_splits, other=float("-inf"))
    sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
    m = tl.maximum(tl.max(lse, 0), sink)
    denom = tl.sum(tl.exp2(lse - m), 0) + tl.exp2(sink - m)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s in range(0, num_splits):
        weight = tl.exp2(tl.load(lse_row + s) - m)
        acc += weight * tl.load(partial_ptr + t * stride_pt + h * stride_ph + s * stride_ps + dims)
    out = (acc / denom).to(out_ptr.dtype.element_ty)
    if QUERY_ROPE > 0:  # the output rotated back, as the unsplit kernel does
        out = tl.reshape(rope_tail(tl.reshape(out, [1, HEAD_DIM]), cos_ptr + t * stride_ct, sin_ptr + t * stride_st, 1,
                                   HEAD_DIM, QUERY_ROPE, True), [HEAD_DIM])
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dims, out)


def attention_config(head_dim: int, num_heads: int, kv_fp8: bool = False) -> dict:
    """Tile sizes and launch options for a head_dim / head count (shared with scripts/).

    At head_dim 512 a [64, 512] fp32 accumulator spills on sm_90 (checked with scripts/check_kernels_compile.py),
    so heads go in blocks of at most 32 there (mma.sync, not wgmma) and each key block is read once per head block.
    Decoding the fp8 layout in registers holds a key block's codes, rope values and decoded tile at once: one stage
    (the kernel decodes the block half by half: at 32 keys 172 registers and no spill, Triton 3.7.1 and 3.6).
    scripts/tune_kernels.py tunes these per device (kernels/tuning.py).
    """
    block_h = min(32 if head_dim >= 512 else 64, max(16, triton.next_power_of_2(num_heads)))
    if head_dim >= 256:
        cfg = dict(BLOCK_H=block_h, BLOCK_N=32, num_warps=8, num_stages=2)
    else:
        cfg = dict(BLOCK_H=block_h, BLOCK_N=64, num_warps=4, num_stages=2)
    if kv_fp8:
        cfg.update(num_stages=1)
    return cfg


def choose_num_splits(num_programs: int, max_key_blocks: int, num_sms: int, programs_per_sm: int,
                      min_blocks_per_split: int = 2) -> int:
    """Split-KV factor: 1 when the (token, head block) programs already fill every SM to its occupancy (one full
    wave of programs_per_sm * num_sms); otherwise enough splits to fill that wave, each split keeping at least
    min_blocks_per_split key blocks (`min_blocks_per_split` bounds the partials' traffic), at most _MAX_SPLITS."""
    wave = programs_per_sm * num_sms
    most = min(max_key_blocks // max(min_blocks_per_split, 1), _MAX_SPLITS)
    if num_programs >= wave or most < 2:
        return 1
    return max(1, min(triton.cdiv(wave, max(num_programs, 1)), most))


def min_blocks_per_split(block_h: int, block_n: int, head_dim: int, element_bytes: float) -> int:
    """Key blocks a split must read so that its partial output's round trip (BLOCK_H x head_dim fp32 written,
    then read by the combine kernel) moves no more bytes than its keys (BLOCK_N x head_dim each): split-KV then
    at most doubles a step's attention traffic while it multiplies the programs at work. element_bytes: a key's
    bytes per value (1.14 for the fp8 layout's 584-byte entries of 512)."""
    partial_round_trip = 2 * block_h * head_dim * 4
    return max(2, math.ceil(partial_round_trip / (block_n * head_dim * element_bytes)))


def _max_key_blocks(window, comp_kv, comp_block_table, topk_indices, block_n) -> int:
    """Upper bound on a token's key blocks from shapes only (no host synchronisation): the whole window, plus
    the top-k width (CSA) or every entry the compressed block table can address (HCA)."""
    if comp_kv is None:
        max_comp = 0
    elif topk_indices is not None:
        max_comp = topk_indices.shape[1]
    else:
        max_comp = comp_block_table.shape[1] * comp_kv.shape[1]
    return triton.cdiv(window, block_n) + triton.cdiv(max_comp, block_n)


def plan_sparse_paged_attention(
    q, sinks, scale, token_seq, token_pos, window_kv, window_block_table, window_first_page, window,
    comp_kv=None, comp_block_table=None, compress_rate=0, topk_indices=None, *, rope_dim=0, q_norm_eps=None,
    rope=None, num_splits=None, block_n=None,
):
    """Check the inputs, allocate the output and return (out, launches) without launching anything.

    Each launch is (kernel, grid, args, kwargs); `scripts/check_kernels_compile.py` compiles exactly these.
    block_n overrides the key-block size of `attention_config` (tests use it to get several blocks per token).
    """
    num_tokens, num_heads, head_dim = q.shape
    _check_attention_inputs(q, sinks, token_seq, token_pos, window_kv, window_block_table, window_first_page,
                            window, comp_kv, comp_block_table, compress_rate, topk_indices, rope_dim)
    cos, sin = _check_query_rope(q, rope)
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out, []
    kv_fp8 = window_kv.dtype == torch.uint8
    comp_mode = 0 if comp_kv is None else (2 if topk_indices is not None else 1)
    shape = dict(head_dim=head_dim, heads=num_heads, dtype=dtype_name(q.dtype), mode=MODES[comp_mode],
                 kv_cache="fp8" if kv_fp8 else dtype_name(window_kv.dtype), tokens=num_tokens)
    cfg = tuned("attention", shape, attention_config(head_dim, num_heads, kv_fp8))
    block_h, block_n = cfg["BLOCK_H"], block_n or cfg["BLOCK_N"]
    num_head_blocks = triton.cdiv(num_heads, block_h)
    num_topk = topk_indices.shape[1] if topk_indices is not None else 0
    dot_dtype = compute_dtype(q.dtype)
    as_rope = (lambda pool: pool.view(torch.bfloat16)) if kv_fp8 else (lambda pool: pool)  # noqa: E731
    kwargs = dict(HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_N=block_n, COMP_MODE=comp_mode, IS_SPLIT=True,
                  COMPUTE_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
                  KV_FP8=kv_fp8, ROPE_DIM=rope_dim if kv_fp8 else 0,
                  WINDOW_ALIGN=row_alignment(*window_kv.stride()[:2]),
                  COMP_ALIGN=row_alignment(*(comp_kv if comp_kv is not None else window_kv).stride()[:2]),
                  Q_NORM=q_norm_eps is not None, QUERY_ROPE=2 * cos.shape[-1] if rope is not None else 0,
                  **launch_options(cfg))

    def kernel_args(splits: int):
        """(args, partial, lse) of the attention launch with `splits` splits (buffers allocated when split)."""
        comp_kv_arg = comp_kv if comp_kv is not None else window_kv
        comp_table_arg = comp_block_table if comp_block_table is not None else window_block_table
        topk_arg = topk_indices if topk_indices is not None else token_seq
        partial = lse = None
        if splits > 1:
            partial = torch.empty((num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
            lse = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
            dst, dst_strides, lse_strides = partial, partial.stride()[:3], lse.stride()[:2]
        else:
            lse, dst, dst_strides, lse_strides = out, out, (out.stride(0), out.stride(1), 0), (0, 0)
        args = (
            q, sinks, token_seq, token_pos, window_kv, as_rope(window_kv), window_block_table, window_first_page,
            comp_kv_arg, as_rope(comp_kv_arg), comp_table_arg, topk_arg, dst, lse, cos, sin,
            num_heads, window, max(compress_rate, 1), num_topk, window_kv.shape[1], comp_kv_arg.shape[1], splits,
            float(scale) * _LOG2E, float(q_norm_eps or 0.0),
            q.stride(0), q.stride(1), cos.stride(0), sin.stride(0),
            window_kv.stride(0), window_kv.stride(1), window_block_table.stride(0),
            comp_kv_arg.stride(0), comp_kv_arg.stride(1), comp_table_arg.stride(0),
            topk_arg.stride(0) if topk_indices is not None else 0,
            *dst_strides, *lse_strides,
        )
        return args, partial, lse

    if num_splits is None:
        key = ("attention", q.device, q.dtype, head_dim, comp_mode, tuple(sorted(cfg.items())), block_n)
        occupancy = compiled_programs_per_sm(_sparse_paged_attention_kernel, lambda: kernel_args(2)[0], kwargs,
                                             q.device, key, _ASSUMED_REGISTERS)
        max_key_blocks = _max_key_blocks(window, comp_kv, comp_block_table, topk_indices, block_n)
        entry_bytes = window_kv.shape[-1] * window_kv.element_size()
        num_splits = choose_num_splits(num_tokens * num_head_blocks, max_key_blocks, num_sms(q.device), occupancy,
                                       min_blocks_per_split(block_h, block_n, head_dim, entry_bytes / head_dim))
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    is_split = num_splits > 1
    args, partial, lse = kernel_args(num_splits)
    kwargs["IS_SPLIT"] = is_split
    launches = [(_sparse_paged_attention_kernel, (num_tokens, num_head_blocks, num_splits), args, kwargs)]
    if is_split:
        combine_args = (partial, lse, sinks, out, cos, sin, num_splits, *partial.stride()[:3], *lse.stride()[:2],
                        out.stride(0), out.stride(1), cos.stride(0), sin.stride(0))
        combine_kwargs = dict(HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
                              QUERY_ROPE=kwargs["QUERY_ROPE"], num_warps=4, num_stages=1)
        launches.append((_split_kv_combine_kernel, (num_tokens, num_heads), combine_args, combine_kwargs))
    return out, launches


def _check_attention_inputs(q, sinks, token_seq, token_pos, window_kv, window_block_table, window_first_page,
                            window, comp_kv, comp_block_table, compress_rate, topk_indices, rope_dim):
    num_tokens, num_heads, head_dim = q.shape
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"q dtype {q.dtype} not supported"
    # (the kernel works on two halves of the head dim, each at least a dot's 16 columns)
    assert head_dim >= 32 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 32, got {head_dim}"
    assert q.stride(2) == 1, "q's last dimension must be contiguous"
    assert sinks.shape == (num_heads,) and sinks.is_floating_point() and sinks.stride(0) == 1
    for name, ids in (("token_seq", token_seq), ("token_pos", token_pos)):
        assert ids.shape == (num_tokens,), f"{name} must be [T], got {tuple(ids.shape)}"
        assert ids.dtype in (torch.int32, torch.int64) and ids.stride(0) == 1, f"{name}: int32/int64 contiguous"
    assert window >= 1, f"window must be >= 1, got {window}"
    _check_pool("window", window_kv, window_block_table, q, rope_dim)
    assert window_first_page.dim() == 1 and window_first_page.shape[0] == window_block_table.shape[0]
    assert window_first_page.dtype in (torch.int32, torch.int64) and window_first_page.stride(0) == 1
    if comp_kv is None:
        assert topk_indices is None, "topk_indices needs comp_kv"
        return
    assert comp_kv.dtype == window_kv.dtype, "the window and compressed pools store one format"
    _check_pool("comp", comp_kv, comp_block_table, q, rope_dim)
    if topk_indices is None:
        assert compress_rate >= 1, f"HCA needs compress_rate >= 1, got {compress_rate}"
    else:
        assert topk_indices.dim() == 2 and topk_indices.shape[0] == num_tokens, "topk_indices must be [T, K]"
        assert topk_indices.dtype in (torch.int32, torch.int64) and topk_indices.stride(1) == 1


def _check_query_rope(q, rope):
    """(cos, sin) of the queries' rope, [T, rope / 2] each, its channels within the second half of the head dim
    (where the kernel holds them); without rope, q itself twice (never read)."""
    if rope is None:
        return q, q
    cos, sin = rope
    num_tokens, head_dim = q.shape[0], q.shape[2]
    for name, table in (("cos", cos), ("sin", sin)):
        assert table.dim() == 2 and table.shape == (num_tokens, cos.shape[1]) and table.stride(1) == 1 \
            and table.is_floating_point(), f"rope {name} must be [T={num_tokens}, rope / 2], last dim contiguous"
    assert 0 < 2 * cos.shape[1] <= head_dim // 2, f"the rope's {2 * cos.shape[1]} channels: at most half of {head_dim}"
    return cos, sin


def _check_pool(name, pool, block_table, q, rope_dim):
    """A pool of q's dtype with entries of q's width, or of the fp8 layout's bytes (uint8)."""
    head_dim = q.shape[2]
    if pool.dtype == torch.uint8:
        width = kv_fp8_entry_bytes(head_dim, rope_dim)
        assert pool.dim() == 3 and pool.shape[2] == width, \
            f"an fp8 {name}_kv must be [pages, page_size, {width}] bytes (D {head_dim}, rope {rope_dim})"
        assert head_dim % 128 == 0, f"the fp8 layout's halves are whole 64-column groups: D {head_dim}"
    else:
        assert pool.dim() == 3 and pool.shape[2] == head_dim, f"{name}_kv must be [pages, page_size, D]"
        assert pool.dtype == q.dtype, f"{name}_kv dtype {pool.dtype} != q dtype {q.dtype}"
    assert pool.stride(2) == 1, f"{name}_kv's last dimension must be contiguous"
    assert block_table is not None and block_table.dim() == 2, f"{name}_block_table must be [B, pages]"
    assert block_table.dtype in (torch.int32, torch.int64) and block_table.stride(1) == 1


def _launch(launches) -> None:
    launch(launches)


def sparse_paged_attention_triton(
    q: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    token_seq: torch.Tensor,
    token_pos: torch.Tensor,
    window_kv: torch.Tensor,
    window_block_table: torch.Tensor,
    window_first_page: torch.Tensor,
    window: int,
    comp_kv: torch.Tensor | None = None,
    comp_block_table: torch.Tensor | None = None,
    compress_rate: int = 0,
    topk_indices: torch.Tensor | None = None,
    *,
    rope_dim: int = 0,
    q_norm_eps: float | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton version of `sparse_paged_attention_reference` (same arguments, [T, H, D] in q's dtype).

    num_splits: split-KV factor; None picks it with `choose_num_splits` (no host synchronisation), 1 never splits.
    block_n: key-block size override, for tests; None uses `attention_config`.
    """
    out, launches = plan_sparse_paged_attention(
        q, sinks, scale, token_seq, token_pos, window_kv, window_block_table, window_first_page, window,
        comp_kv, comp_block_table, compress_rate, topk_indices, rope_dim=rope_dim, q_norm_eps=q_norm_eps, rope=rope,
        num_splits=num_splits, block_n=block_n)
    _launch(launches)
    return out



# Queries per tile in the reference, to bound the gathered [tile, keys, D] tensors.
_REFERENCE_TILE = 256


def _gather_rows(pool: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
    """pool[block_table[rows, cols], slots] for broadcastable index tensors."""
    pages = block_table[rows, cols].long()
    return pool[pages, slots]


def _window_keys(window_kv, window_block_table, window_first_page, seq, pos, window):
    """Window keys [t, window, D] and their validity [t, window] for a tile of queries."""
    page_size = window_kv.shape[1]
    offsets = torch.arange(-(window - 1), 1, device=pos.device)  # oldest first
    key_pos = pos[:, None] + offsets[None, :]  # [t, window]
    valid = key_pos >= 0
    key_pos = key_pos.clamp(min=0)
    cols = key_pos // page_size - window_first_page[seq][:, None]
    cols = torch.where(valid, cols, torch.zeros_like(cols))
    keys = _gather_rows(window_kv, window_block_table, seq[:, None], cols, key_pos % page_size)
    return keys, valid


def _compressed_keys(comp_kv, comp_block_table, seq, pos, compress_rate, topk_indices):
    """Compressed keys [t, n, D] and validity [t, n]: all causal entries (HCA) or the top-k (CSA)."""
    page_size = comp_kv.shape[1]
    if topk_indices is None:
        num_causal = (pos + 1) // compress_rate  # [t]
        max_entries = int(num_causal.max().item()) if pos.numel() else 0
        entries = torch.arange(max_entries, device=pos.device)[None, :].expand(pos.shape[0], -1)
        valid = entries < num_causal[:, None]
    else:
        entries = topk_indices.long()
        valid = (entries >= 0) & (entries < ((pos + 1) // compress_rate)[:, None])
    entries = torch.where(valid, entries, torch.zeros_like(entries))
    keys = _gather_rows(comp_kv, comp_block_table, seq[:, None], entries // page_size, entries % page_size)
    return keys, valid


def sparse_paged_attention_reference(
    q: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    token_seq: torch.Tensor,
    token_pos: torch.Tensor,
    window_kv: torch.Tensor,
    window_block_table: torch.Tensor,
    window_first_page: torch.Tensor,
    window: int,
    comp_kv: torch.Tensor | None = None,
    comp_block_table: torch.Tensor | None = None,
    compress_rate: int = 0,
    topk_indices: torch.Tensor | None = None,
    *,
    rope_dim: int = 0,
    q_norm_eps: float | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Plain-torch definition of the kernel (see the module docstring). Returns [T, H, D] in q's dtype.

    rope_dim: the entries' trailing rope dims, which the fp8 layout keeps in bf16 (uint8 pools only).
    q_norm_eps: q is first normed per head (the unweighted RMSNorm); rope (cos, sin) [T, rope / 2]: then its trailing
    channels rotated, and the output's rotated back (V = K carries the rotation), each step rounded to q's dtype."""
    cos, sin = rope if rope is not None else (None, None)
    if q_norm_eps is not None or rope is not None:
        q = norm_rope_reference(q, None, q_norm_eps or 0.0, normalize=q_norm_eps is not None, cos=cos, sin=sin)
    out = _attention_reference(q, sinks, scale, token_seq, token_pos, window_kv, window_block_table,
                               window_first_page, window, comp_kv, comp_block_table, compress_rate, topk_indices,
                               rope_dim)
    if rope is not None:
        out = norm_rope_reference(out, normalize=False, cos=cos, sin=sin, inverse=True)
    return out


def _attention_reference(q, sinks, scale, token_seq, token_pos, window_kv, window_block_table, window_first_page,
                         window, comp_kv, comp_block_table, compress_rate, topk_indices, rope_dim):
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    seq_all, pos_all = token_seq.long(), token_pos.long()
    for start in range(0, num_tokens, _REFERENCE_TILE):
        tile = slice(start, start + _REFERENCE_TILE)
        seq, pos, qt = seq_all[tile], pos_all[tile], q[tile].float()
        keys, valid = _window_keys(window_kv, window_block_table, window_first_page, seq, pos, window)
        keys = decode_kv_entries(keys, head_dim, rope_dim)
        if comp_kv is not None:
            topk = topk_indices[tile] if topk_indices is not None else None
            ckeys, cvalid = _compressed_keys(comp_kv, comp_block_table, seq, pos, compress_rate, topk)
            ckeys = decode_kv_entries(ckeys, head_dim, rope_dim)
            keys, valid = torch.cat([keys, ckeys], dim=1), torch.cat([valid, cvalid], dim=1)
        keys = torch.where(valid[..., None], keys, torch.zeros_like(keys))  # [t, n, D] fp32
        logits = torch.einsum("thd,tnd->thn", qt, keys) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        sink = sinks.float()[None, :, None].expand(qt.shape[0], num_heads, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        out[tile] = torch.einsum("thn,tnd->thd", probs, keys).to(q.dtype)
    return out
