"""DeepSeek-V4's manifold-constrained hyper-connections (mHC), fused: the collapse before a block, the mix after it,
and the final head collapse.

Math (what transformers' DeepSeek-V4 hyper-connections compute), for token t, N = hc_mult streams:
  collapse   flat   = s[t] (N * D values, fp32) * rsqrt(mean(s[t]^2) + eps)          (unweighted RMSNorm)
             mixes  = flat @ fn^T                                                  [2N + N*N]: pre | post | comb
             pre    = sigmoid(mixes[:N] * scale[0] + base[:N]) + hc_eps                                [N]
             post   = 2 * sigmoid(mixes[N:2N] * scale[1] + base[N:2N])                                 [N]
             comb   = softmax_j(mixes[2N:].view(N, N) * scale[2] + base[2N:].view(N, N)) + hc_eps      [N, N]
                      then Sinkhorn: comb /= colsum + hc_eps, and (sinkhorn_iters - 1) times
                      comb /= rowsum + hc_eps; comb /= colsum + hc_eps
             c      = (sum_n pre[n] * s[t, n]).to(dtype)                                               [D]
             x      = (norm_weight * c * rsqrt(mean(c^2) + eps)).to(dtype)    (x = c when norm_weight is None)
  mix        y      = (block_out + block_out2).to(dtype)     (summed in fp32; y = block_out.to(dtype) alone)
             new[k] = (post[k].to(dtype) * y).to(dtype) + (sum_j comb[j, k].to(dtype) * s[j]).to(dtype)
                      (the roundings of hyper_mix in streams' dtype: identities in fp32)
  head       pre    = sigmoid((flat @ fn^T) * scale[0] + base) + hc_eps; x = (sum_n pre[n] * s[t, n]).to(dtype),
             optionally followed by the weighted RMSNorm as in the collapse (the model's final norm)

Layouts:
  streams [T, N, D] (last dimension contiguous), fp32 or bf16; block_out, block_out2 [T, D] any float dtype
  fn [2N + N*N, N*D] fp32 (head: [N, N*D]), base [2N + N*N] (head: [N]), scale [3] (head: [1]), norm_weight [D]
  post [T, N] fp32, comb [T, N, N] fp32 (comb[t, j, k]: weight of stream j in new stream k), x [T, D] streams' dtype

Kernels (one launch each):
  `_hc_collapse_kernel`, grid (cdiv(T, BLOCK_T), splits): a program owns BLOCK_T tokens, so its reads of fn
  (1.5 MB fp32 at V4-Flash size) are shared by BLOCK_T tokens. Pass 1 loops over (stream, BLOCK_D tile) steps: the
  sum of squares and two fp32 tl.dot products, the pre/post tile [BLOCK_T, max(16, 2P)] (column g * P + i holds fn
  row g * N + i) and the comb tile [BLOCK_T, P * P] (column i * P + j holds fn row 2N + i * N + j), P = N rounded
  up to a power of two; the RMSNorm factor is applied to the products afterwards (it is one scalar per token).
  With fewer token blocks than SMs (decode) the N * cdiv(D, BLOCK_D) steps are split over `splits` programs per
  block (a run-time argument: no recompilation per batch size): each writes its partial sums to an fp32 scratch
  and bumps the block's counter (an acq_rel atomic); the last to arrive sums the partials, resets the counter to
  zero for the next launch (no memset, CUDA-graph safe) and carries on alone. Sigmoids, the softmax and the
  Sinkhorn iterations then run on [BLOCK_T, P, P] in registers. Pass 2 re-reads the streams, writes the
  pre-weighted collapse c (rounded to the dtype) into x and sums its squares; pass 3 re-reads the program's own x
  (L2-hot) and writes the weighted RMSNorm over it.
  `_hc_mix_kernel`, grid (T, cdiv(D, BLOCK_D)): a program reads the N streams of one token's D tile once, the
  block output(s), post and comb, and writes all N new streams of the tile (safe in place: out may be streams).
  The mix after a block fused into the collapse before the next (`hc_mix_collapse`, up to FUSED_MIX_MAX_TOKENS
  tokens): the collapse kernel with MIX computes each (stream, tile) of pass 1 from the old streams as the mix
  kernel would (`_mixed_tile`), writes it to the new streams and goes on with it; pass 2 reads the new streams back
  (the last split reads the other splits' tiles, written before their counter's release). One launch instead of two.
  quantize_x (DeepSeek's numerics, before the MoE): pass 3 also writes x act_quant'ed, e4m3 values and scales (a
  128-column tile is one act_quant group), which the experts and the FP8 GEMMs reading x take instead of a launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import (DEFAULT_NUM_SMS, SPLIT_COUNTERS, last_to_arrive, launch, num_sms, split_counters,
                            wait_for_previous_kernel)
from kernels.fp8_gemm import plan_act_quant, quantize_activations_reference
from kernels.quant_formats import e4m3_groups


# --- references (the model's math, casts included) ----------------------------------------------------------------
def _unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def hc_collapse_reference(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                          norm_weight: torch.Tensor | None, *, hc_mult: int, eps: float, hc_eps: float,
                          sinkhorn_iters: int):
    """hyper_connection followed by rms_norm(collapsed, norm_weight, eps) (none when norm_weight is None).

    streams [T, N, D] -> (post [T, N] fp32, comb [T, N, N] fp32, x [T, D] in streams' dtype).
    """
    n = hc_mult
    flat = _unweighted_rms_norm(streams.flatten(1).float(), eps)
    mixes = torch.nn.functional.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    x = collapsed if norm_weight is None else _rms_norm(collapsed, norm_weight, eps)
    return post, comb, x


def hc_head_reference(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                      eps: float, hc_eps: float, norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """hyper_head (the final collapse; fn [N, N*D], base [N], scale [1]) -> [T, D] in streams' dtype, followed by
    rms_norm(., norm_weight, eps) when norm_weight is given."""
    flat = _unweighted_rms_norm(streams.flatten(1).float(), eps)
    pre = torch.sigmoid(torch.nn.functional.linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    x = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return x if norm_weight is None else _rms_norm(x, norm_weight, eps)


def hc_mix_reference(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     block_out2: torch.Tensor | None = None, *, fp32_mix: bool = False) -> torch.Tensor:
    """hyper_mix(streams, y, post, comb) with y = (block_out [+ block_out2], summed in fp32).to(streams.dtype).

    new[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * streams[t, j]: [T, N, D] in streams' dtype. As
    transformers computes it, post, comb and each of the two terms in the streams' dtype; fp32_mix (DeepSeek's
    hc_post): the whole mix in fp32 with post and comb as they are, rounded once.
    """
    dtype = streams.dtype
    y = block_out.float() if block_out2 is None else block_out.float() + block_out2.float()
    y = y.to(dtype)
    if fp32_mix:
        return (post.unsqueeze(-1) * y.float().unsqueeze(-2)
                + torch.matmul(comb.transpose(-1, -2), streams.float())).to(dtype)
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def hc_mix_collapse_reference(streams, block_out, post, comb, block_out2, fn, base, scale, norm_weight, *, hc_mult,
                              eps, hc_eps, sinkhorn_iters, fp32_mix=False, quantize_x=False):
    """The mix after a block, then the collapse before the next: (new streams, post, comb, x), and with quantize_x
    x's act_quant (`quantize_activations_reference`: e4m3 values, scales)."""
    new = hc_mix_reference(streams, block_out, post, comb, block_out2, fp32_mix=fp32_mix)
    outputs = (new, *hc_collapse_reference(new, fn, base, scale, norm_weight, hc_mult=hc_mult, eps=eps, hc_eps=hc_eps,
                                           sinkhorn_iters=sinkhorn_iters))
    return (*outputs, quantize_activations_reference(outputs[-1])) if quantize_x else outputs


# --- kernels ------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _hc_collapse_kernel(
    # pointers
    s_ptr, fn_ptr, base_ptr, scale_ptr, w_ptr, post_ptr, comb_ptr, x_ptr, partial_ptr, counter_ptr,
    xq_ptr, xs_ptr,  # QUANTIZE_X: x act_quant'ed, e4m3 values and their scales
    # MIX: the streams before the mix, the block output(s), the mix's post and comb
    old_ptr, y_ptr, y2_ptr, mix_post_ptr, mix_comb_ptr,
    # sizes, strides, scalars
    num_tokens, num_splits, stride_st, stride_sn, stride_xt, stride_old_t, stride_old_n, stride_yt, stride_y2t,
    stride_xqt, stride_xst, eps, hc_eps,
    # model constants and tiles
    N: tl.constexpr, D: tl.constexpr, P: tl.constexpr, SINKHORN_ITERS: tl.constexpr, HEAD: tl.constexpr,
    HAS_NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, WIDTH_PP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MIX: tl.constexpr, HAS_SECOND: tl.constexpr, FP32_MIX: tl.constexpr,
    QUANTIZE_X: tl.constexpr,
    PDL: tl.constexpr = False,  # launched to wait for the kernel before it (common.launch)
):
    """Program (b, split): tokens [b * BLOCK_T, (b + 1) * BLOCK_T), the split's share of the N * D inputs; the
    last split of block b to finish (or the only one) sums the partial products and does the rest. MIX: the
    streams it collapses are first mixed from the ones before the block (`_mixed_tile`, the mix kernel's values),
    each tile as pass 1 reaches it, and written to s_ptr. QUANTIZE_X (with the norm, BLOCK_D = 128): x is also
    written act_quant'ed (DeepSeek's e4m3 per 128 columns) for the experts that read it so."""
    wait_for_previous_kernel(PDL)
    block = tl.program_id(0)
    split = tl.program_id(1)
    tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tokens < num_tokens
    tokens = tokens.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    # fn rows of the two product tiles; a row index of -1 marks a padding column
    cols_pp = tl.arange(0, WIDTH_PP)
    group, lane = cols_pp // P, cols_pp % P
    valid_pp = (lane < N) & (group < (1 if HEAD else 2))
    rows_pp = group * N + lane
    cols_c = tl.arange(0, P * P)
    ci, cj = cols_c // P, cols_c % P
    valid_c = (ci < N) & (cj < N)
    rows_c = 2 * N + ci * N + cj

    # pass 1: sum of squares and the raw products s[t] @ fn^T over this split's (stream, D tile) steps
    TILES_PER_STREAM: tl.constexpr = (D + BLOCK_D - 1) // BLOCK_D
    per_split = (N * TILES_PER_STREAM + num_splits - 1) // num_splits
    sumsq = tl.zeros([BLOCK_T], tl.float32)
    acc_pp = tl.zeros([BLOCK_T, WIDTH_PP], tl.float32)
    acc_c = tl.zeros([BLOCK_T, P * P], tl.float32)
    for step in range(split * per_split, tl.minimum((split + 1) * per_split, N * TILES_PER_STREAM)):
        n = step // TILES_PER_STREAM
        d0 = (step % TILES_PER_STREAM) * BLOCK_D
        d_mask = offs_d < D - d0
        tile = s_ptr + tokens[:, None] * stride_st + n * stride_sn + (d0 + offs_d)[None, :]
        if MIX:
            a = _mixed_tile(old_ptr, y_ptr, y2_ptr, mix_post_ptr, mix_comb_ptr, tokens, t_mask, n, d0 + offs_d,
                            d_mask, stride_old_t, stride_old_n, stride_yt, stride_y2t, N, HAS_SECOND, FP32_MIX,
                            s_ptr.dtype.element_ty)
            tl.store(tile, a.to(s_ptr.dtype.element_ty), mask=t_mask[:, None] & d_mask[None, :])
        else:
            a = tl.load(tile, mask=t_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        sumsq += tl.sum(a * a, 1)
        k = n * D + d0 + offs_d  # column of fn
        f_pp = tl.load(fn_ptr + rows_pp[:, None] * (N * D) + k[None, :],
                       mask=valid_pp[:, None] & d_mask[None, :], other=0.0)
        acc_pp = tl.dot(a, tl.trans(f_pp), acc_pp, input_precision=DOT_PRECISION)
        if not HEAD:
            f_c = tl.load(fn_ptr + rows_c[:, None] * (N * D) + k[None, :],
                          mask=valid_c[:, None] & d_mask[None, :], other=0.0)
            acc_c = tl.dot(a, tl.trans(f_c), acc_c, input_precision=DOT_PRECISION)
    if num_splits > 1:
        # partials [blocks, splits, BLOCK_T, PARTIAL]: sumsq | pre/post tile | comb tile; the last split to bump
        # the block's counter (acq_rel: it sees every other split's partials) reduces them and carries on
        PARTIAL: tl.constexpr = 1 + WIDTH_PP + P * P
        rows = ((block * num_splits + split) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64) * PARTIAL
        tl.store(partial_ptr + rows, sumsq)
        tl.store(partial_ptr + rows[:, None] + 1 + cols_pp[None, :], acc_pp)
        if not HEAD:
            tl.store(partial_ptr + rows[:, None] + 1 + WIDTH_PP + cols_c[None, :], acc_c)
        if not last_to_arrive(counter_ptr, block, num_splits):
            return
        sumsq = tl.zeros([BLOCK_T], tl.float32)
        acc_pp = tl.zeros([BLOCK_T, WIDTH_PP], tl.float32)
        acc_c = tl.zeros([BLOCK_T, P * P], tl.float32)
        for other in range(num_splits):
            rows = ((block * num_splits + other) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64) * PARTIAL
            sumsq += tl.load(partial_ptr + rows, cache_modifier=".cg")
            acc_pp += tl.load(partial_ptr + rows[:, None] + 1 + cols_pp[None, :], cache_modifier=".cg")
            if not HEAD:
                acc_c += tl.load(partial_ptr + rows[:, None] + 1 + WIDTH_PP + cols_c[None, :], cache_modifier=".cg")
    r = tl.rsqrt(sumsq / (N * D) + eps)  # [BLOCK_T]

    # pre (and post): column g * P + i, group 0 = pre, 1 = post
    z = acc_pp * r[:, None] * tl.load(scale_ptr + group, mask=valid_pp, other=0.0)[None, :] \
        + tl.load(base_ptr + rows_pp, mask=valid_pp, other=0.0)[None, :]
    act = tl.where((group == 0)[None, :], tl.sigmoid(z) + hc_eps, 2 * tl.sigmoid(z))
    if not HEAD:
        tl.store(post_ptr + tokens[:, None] * N + lane[None, :], act,
                 mask=t_mask[:, None] & ((group == 1) & (lane < N))[None, :])
        # comb: softmax over j, then Sinkhorn on [BLOCK_T, P, P]
        z_c = acc_c * r[:, None] * tl.load(scale_ptr + 2) + tl.load(base_ptr + rows_c, mask=valid_c, other=0.0)[None, :]
        z_c = tl.reshape(tl.where(valid_c[None, :], z_c, float("-inf")), [BLOCK_T, P, P])
        valid3 = tl.reshape(valid_c, [1, P, P])
        e = tl.exp(z_c - tl.max(z_c, 2)[:, :, None])
        e = tl.where(valid3, e, 0.0)
        row_sum = tl.sum(e, 2)
        comb = e / tl.where(row_sum == 0.0, 1.0, row_sum)[:, :, None]  # padding rows (i >= N) are all zero
        comb = tl.where(valid3, comb + hc_eps, 0.0)
        comb = comb / (tl.sum(comb, 1)[:, None, :] + hc_eps)
        for _ in range(SINKHORN_ITERS - 1):
            comb = comb / (tl.sum(comb, 2)[:, :, None] + hc_eps)
            comb = comb / (tl.sum(comb, 1)[:, None, :] + hc_eps)
        comb_flat = tl.reshape(comb, [BLOCK_T, P * P])
        tl.store(comb_ptr + tokens[:, None] * (N * N) + (ci * N + cj)[None, :], comb_flat,
                 mask=t_mask[:, None] & valid_c[None, :])

    # pass 2: c = sum_n pre[n] * s[t, n], rounded to the dtype, into x; its sum of squares for the norm
    if MIX:
        tl.debug_barrier()  # the mixed streams this program's threads wrote are visible to all of them
    out_ty = x_ptr.dtype.element_ty
    sumsq_c = tl.zeros([BLOCK_T], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d_mask = offs_d < D - d0
        mask = t_mask[:, None] & d_mask[None, :]
        c = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        for n in tl.static_range(N):
            pre_n = tl.sum(tl.where((cols_pp == n)[None, :], act, 0.0), 1)  # [BLOCK_T]
            tile = s_ptr + tokens[:, None] * stride_st + n * stride_sn + (d0 + offs_d)[None, :]
            if MIX:  # (other splits' tiles: written before their counter's release, read past L1)
                a = tl.load(tile, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            else:
                a = tl.load(tile, mask=mask, other=0.0).to(tl.float32)
            c += pre_n[:, None] * a
        c = c.to(out_ty)
        tl.store(x_ptr + tokens[:, None] * stride_xt + (d0 + offs_d)[None, :], c, mask=mask)
        if HAS_NORM:
            cf = c.to(tl.float32)
            sumsq_c += tl.sum(cf * cf, 1)

    # pass 3: x = weight * c * rsqrt(mean(c^2) + eps), over the program's own rows of x
    if HAS_NORM:
        tl.debug_barrier()  # every thread's stores of c are visible before the block reads them back
        r_c = tl.rsqrt(sumsq_c / D + eps)
        for d0 in range(0, D, BLOCK_D):
            d_mask = offs_d < D - d0
            mask = t_mask[:, None] & d_mask[None, :]
            ptrs = x_ptr + tokens[:, None] * stride_xt + (d0 + offs_d)[None, :]
            c = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + d0 + offs_d, mask=d_mask, other=0.0).to(tl.float32)
            x = (w[None, :] * (c * r_c[:, None])).to(out_ty)
            tl.store(ptrs, x, mask=mask)
            if QUANTIZE_X:  # (a partial last group: zeros, as act_quant pads it)
                grid, x_scale = e4m3_groups(tl.where(mask, x.to(tl.float32), 0.0), BLOCK_T, BLOCK_D)
                tl.store(xq_ptr + tokens[:, None] * stride_xqt + (d0 + offs_d)[None, :],
                         grid.to(xq_ptr.dtype.element_ty), mask=mask)
                tl.store(xs_ptr + tokens[:, None] * stride_xst + (d0 // 128 + tl.arange(0, 1))[None, :], x_scale,
                         mask=t_mask[:, None])


@triton.jit
def _mixed_tile(old_ptr, y_ptr, y2_ptr, post_ptr, comb_ptr, tokens, t_mask, k, cols, d_mask, stride_ot, stride_on,
                stride_yt, stride_y2t, N: tl.constexpr, HAS_SECOND: tl.constexpr, FP32_MIX: tl.constexpr, ty):
    """New stream k at columns `cols` of tokens [BLOCK_T], float32 holding values of ty: what `_hc_mix_kernel`
    stores there (the same operations in the same order)."""
    mask = t_mask[:, None] & d_mask[None, :]
    y = tl.load(y_ptr + tokens[:, None] * stride_yt + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_SECOND:
        y += tl.load(y2_ptr + tokens[:, None] * stride_y2t + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = y.to(ty).to(tl.float32)
    post = tl.load(post_ptr + tokens * N + k, mask=t_mask, other=0.0)
    if not FP32_MIX:
        post = post.to(ty).to(tl.float32)
    acc = tl.zeros(y.shape, tl.float32)
    for j in tl.static_range(N):
        comb_j = tl.load(comb_ptr + tokens * (N * N) + j * N + k, mask=t_mask, other=0.0)
        if not FP32_MIX:
            comb_j = comb_j.to(ty).to(tl.float32)
        s_j = tl.load(old_ptr + tokens[:, None] * stride_ot + j * stride_on + cols[None, :], mask=mask,
                      other=0.0).to(tl.float32)
        acc += comb_j[:, None] * s_j
    if FP32_MIX:
        new = post[:, None] * y + acc
    else:
        new = (post[:, None] * y).to(ty).to(tl.float32) + acc.to(ty).to(tl.float32)
    return new.to(ty).to(tl.float32)


@triton.jit(do_not_specialize=["num_tokens"])
def _hc_mix_kernel(
    # pointers
    s_ptr, y_ptr, y2_ptr, post_ptr, comb_ptr, out_ptr,
    # sizes, strides
    num_tokens, stride_st, stride_sn, stride_yt, stride_y2t, stride_ot, stride_on,
    # model constants and tiles
    N: tl.constexpr, D: tl.constexpr, P: tl.constexpr, HAS_SECOND: tl.constexpr, BLOCK_D: tl.constexpr,
    FP32_MIX: tl.constexpr,
    PDL: tl.constexpr = False,  # launched to wait for the kernel before it (common.launch)
):
    """Program (t, d tile): new[t, k, tile] = post[t, k] * y[t, tile] + sum_j comb[t, j, k] * s[t, j, tile]."""
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    ks = tl.arange(0, P)
    k_mask = ks < N
    ty = out_ptr.dtype.element_ty
    y = tl.load(y_ptr + t * stride_yt + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    if HAS_SECOND:
        y += tl.load(y2_ptr + t * stride_y2t + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    y = y.to(ty).to(tl.float32)
    post = tl.load(post_ptr + t * N + ks, mask=k_mask, other=0.0)
    if not FP32_MIX:  # transformers' casts: post, comb and both terms in the streams' dtype
        post = post.to(ty).to(tl.float32)
    acc = tl.zeros([P, BLOCK_D], tl.float32)
    for j in tl.static_range(N):
        comb_j = tl.load(comb_ptr + t * (N * N) + j * N + ks, mask=k_mask, other=0.0)
        if not FP32_MIX:
            comb_j = comb_j.to(ty).to(tl.float32)
        s_j = tl.load(s_ptr + t * stride_st + j * stride_sn + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        acc += comb_j[:, None] * s_j[None, :]
    if FP32_MIX:  # DeepSeek's hc_post: one rounding at the store
        new = post[:, None] * y[None, :] + acc
    else:
        new = (post[:, None] * y[None, :]).to(ty).to(tl.float32) + acc.to(ty).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + ks[:, None] * stride_on + offs_d[None, :], new.to(ty),
             mask=k_mask[:, None] & d_mask[None, :])


# --- host wrappers ------------------------------------------------------------------------------------------------
_MAX_BLOCKS_SPLIT = SPLIT_COUNTERS  # token blocks of a launch that splits its inputs: one counter each


def collapse_config(num_tokens: int, hidden: int, hc_mult: int, num_sms: int = DEFAULT_NUM_SMS) -> dict:
    """BLOCK_T tokens per program (tl.dot needs >= 16 rows): 16 up to 2048 tokens, 32 beyond (128 programs at a
    4096-token prefill chunk, fn's L2 reads halved); BLOCK_D = 128 columns of a stream per step.

    Fewer token blocks than SMs (decode): the N * D inputs are split over SPLITS programs per block so that about
    two programs per SM read fn and the streams (one program alone would be latency-bound: 1.5 MB of fn at
    V4-Flash size), and the last of them to finish does the Sinkhorn, the collapse and the norm.
    """
    block_t = 16 if num_tokens <= 2048 else 32
    block_d = min(128, triton.next_power_of_2(hidden))
    blocks = triton.cdiv(num_tokens, block_t)
    steps = hc_mult * triton.cdiv(hidden, block_d)
    splits = 1
    if blocks < num_sms and blocks <= _MAX_BLOCKS_SPLIT:
        splits = min(steps, triton.cdiv(2 * num_sms, blocks))
        splits = triton.cdiv(steps, triton.cdiv(steps, splits))  # no split without a step
    # (under 128 columns, a test model's, ptxas keeps a pointer of the mix fused into the collapse on the stack with 4
    # warps: 8 bytes, at two stages with Triton 3.7.1's, at three with 3.6's; 8 warps spill with neither)
    return dict(BLOCK_T=block_t, BLOCK_D=block_d, SPLITS=splits, num_warps=4 if block_d >= 128 else 8, num_stages=2)


def mix_config(num_tokens: int, hidden: int) -> dict:
    """Smaller D tiles at small T, so a decode step still spreads over many programs."""
    block_d = 256 if num_tokens <= 64 else 1024
    return dict(BLOCK_D=min(block_d, triton.next_power_of_2(hidden)), num_warps=4)


def _check_streams(streams: torch.Tensor, hc_mult: int):
    assert streams.dim() == 3 and streams.shape[1] == hc_mult, f"streams must be [T, {hc_mult}, D]"
    assert streams.dtype in (torch.float32, torch.float16, torch.bfloat16), f"streams dtype {streams.dtype}"
    assert streams.stride(2) == 1, "streams' last dimension must be contiguous"
    assert hc_mult >= 4, "the kernels tile N x N comb as >= 16 columns: hc_mult >= 4"


def _plan_collapse(streams, fn, base, scale, norm_weight, *, hc_mult, eps, hc_eps, sinkhorn_iters, head,
                   config=None, mix=None, quantize_x=False):
    """The collapse's launch; `mix` (old streams, block_out, block_out2, post, comb, fp32_mix): `streams` is where
    the kernel writes the streams it mixes from those (MIX); quantize_x: the outputs end with x act_quant'ed,
    (e4m3 values [T, D], scales [T, ceil(D / 128)]) as `plan_act_quant` gives them."""
    num_tokens, n, hidden = streams.shape
    _check_streams(streams, hc_mult)
    mixes = n if head else 2 * n + n * n
    assert tuple(fn.shape) == (mixes, n * hidden) and fn.dtype == torch.float32 and fn.is_contiguous(), \
        f"fn must be contiguous fp32 [{mixes}, {n * hidden}], got {tuple(fn.shape)} {fn.dtype}"
    assert tuple(base.shape) == (mixes,) and base.dtype == torch.float32 and base.is_contiguous(), \
        f"base must be contiguous fp32 [{mixes}]"
    assert tuple(scale.shape) == ((1,) if head else (3,)) and scale.dtype == torch.float32, \
        f"scale must be fp32 [{1 if head else 3}]"
    if norm_weight is not None:
        assert tuple(norm_weight.shape) == (hidden,) and norm_weight.is_contiguous(), f"norm_weight must be [{hidden}]"
    assert sinkhorn_iters >= 1, "at least one Sinkhorn normalisation"
    device = streams.device
    x = torch.empty((num_tokens, hidden), dtype=streams.dtype, device=device)
    if head:
        post = comb = x  # never written
    else:
        post = torch.empty((num_tokens, n), dtype=torch.float32, device=device)
        comb = torch.empty((num_tokens, n, n), dtype=torch.float32, device=device)
    outputs = x if head else (post, comb, x)
    cfg = (config or collapse_config(num_tokens, hidden, n, num_sms(device))) if num_tokens else None
    x_q = x_s = x  # (unread without QUANTIZE_X)
    in_kernel = quantize_x and (cfg is None or cfg["BLOCK_D"] == 128)  # act_quant's groups: the 128-column tiles
    after = []
    if quantize_x:
        assert not head and norm_weight is not None, "x is quantized after the block's norm"
        if in_kernel:
            x_q = torch.empty((num_tokens, hidden), dtype=torch.float8_e4m3fn, device=device)
            x_s = torch.empty((num_tokens, triton.cdiv(hidden, 128)), dtype=torch.float32, device=device)
            outputs = (*outputs, (x_q, x_s))
        else:  # a hidden size under 128 (test models): the act_quant launch after the collapse
            quantized, after = plan_act_quant(x)
            outputs = (*outputs, quantized)
    if num_tokens == 0:
        return outputs, []
    p = triton.next_power_of_2(n)
    width_pp = max(16, 2 * p)
    blocks, splits = triton.cdiv(num_tokens, cfg["BLOCK_T"]), cfg.get("SPLITS", 1)
    if splits > 1:
        assert blocks <= _MAX_BLOCKS_SPLIT, f"a split launch takes at most {_MAX_BLOCKS_SPLIT} token blocks"
        partial = torch.empty((blocks * splits * cfg["BLOCK_T"], 1 + width_pp + p * p), dtype=torch.float32,
                              device=device)
    else:
        partial = fn  # never touched
    counters = split_counters(device)  # touched only by split launches; passed always: one signature
    old, y, y2, mix_post, mix_comb, fp32_mix = mix or (streams, x, None, base, base, False)  # (unread without MIX)
    second = y2 if y2 is not None else y
    args = (streams, fn, base, scale, norm_weight if norm_weight is not None else base, post, comb, x, partial,
            counters, x_q, x_s, old, y, second, mix_post, mix_comb, num_tokens, splits, streams.stride(0),
            streams.stride(1), x.stride(0), old.stride(0), old.stride(1), y.stride(0), second.stride(0),
            x_q.stride(0), x_s.stride(0), float(eps), float(hc_eps))
    kwargs = dict(N=n, D=hidden, P=p, SINKHORN_ITERS=int(sinkhorn_iters), HEAD=head,
                  HAS_NORM=norm_weight is not None, BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"],
                  WIDTH_PP=width_pp, DOT_PRECISION=cfg.get("DOT_PRECISION", "ieee"), MIX=mix is not None,
                  HAS_SECOND=y2 is not None, FP32_MIX=bool(fp32_mix), QUANTIZE_X=in_kernel,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return outputs, [(_hc_collapse_kernel, (blocks, splits), args, kwargs)] + after


def plan_hc_collapse(streams, fn, base, scale, norm_weight, *, hc_mult, eps, hc_eps, sinkhorn_iters, config=None,
                     quantize_x=False):
    """Check inputs, allocate (post, comb, x); return ((post, comb, x), launches) without launching (one launch;
    none at T = 0); quantize_x: the outputs end with x act_quant'ed, (values, scales)."""
    return _plan_collapse(streams, fn, base, scale, norm_weight, hc_mult=hc_mult, eps=eps, hc_eps=hc_eps,
                          sinkhorn_iters=sinkhorn_iters, head=False, config=config, quantize_x=quantize_x)


def plan_hc_head(streams, fn, base, scale, *, eps, hc_eps, norm_weight=None, config=None):
    """Check inputs, allocate x; return (x, launches) without launching (one launch; none at T = 0)."""
    return _plan_collapse(streams, fn, base, scale, norm_weight, hc_mult=streams.shape[1], eps=eps, hc_eps=hc_eps,
                          sinkhorn_iters=1, head=True, config=config)


def _check_mix_inputs(streams, block_out, post, comb, block_out2):
    num_tokens, n, hidden = streams.shape
    _check_streams(streams, n)
    for name, y in (("block_out", block_out), ("block_out2", block_out2)):
        if y is not None:
            assert tuple(y.shape) == (num_tokens, hidden) and y.stride(1) == 1 and y.is_floating_point(), \
                f"{name} must be [T, D] with a contiguous last dimension"
    assert tuple(post.shape) == (num_tokens, n) and post.dtype == torch.float32 and post.is_contiguous(), \
        "post must be contiguous fp32 [T, N]"
    assert tuple(comb.shape) == (num_tokens, n, n) and comb.dtype == torch.float32 and comb.is_contiguous(), \
        "comb must be contiguous fp32 [T, N, N]"


def plan_hc_mix(streams, block_out, post, comb, block_out2=None, *, out=None, config=None, fp32_mix=False):
    """Check inputs, allocate the new streams (or use out, which may be streams itself); return (new, launches)
    without launching (one launch; none at T = 0)."""
    num_tokens, n, hidden = streams.shape
    _check_mix_inputs(streams, block_out, post, comb, block_out2)
    if out is None:
        out = torch.empty_like(streams, memory_format=torch.contiguous_format)
    assert out.shape == streams.shape and out.dtype == streams.dtype and out.stride(2) == 1, "out like streams"
    if num_tokens == 0:
        return out, []
    cfg = config or mix_config(num_tokens, hidden)
    second = block_out2 if block_out2 is not None else block_out
    args = (streams, block_out, second, post, comb, out, num_tokens, streams.stride(0), streams.stride(1),
            block_out.stride(0), second.stride(0), out.stride(0), out.stride(1))
    kwargs = dict(N=n, D=hidden, P=triton.next_power_of_2(n), HAS_SECOND=block_out2 is not None,
                  BLOCK_D=cfg["BLOCK_D"], FP32_MIX=bool(fp32_mix), num_warps=cfg["num_warps"])
    return out, [(_hc_mix_kernel, (num_tokens, triton.cdiv(hidden, cfg["BLOCK_D"])), args, kwargs)]


# Up to this many tokens the mix is fused into the collapse after it; beyond (a prefill chunk), the fused pass 1 would
# read the N old streams once per stream, and the mix runs as its own launch.
FUSED_MIX_MAX_TOKENS = 256


def plan_hc_mix_collapse(streams, block_out, post, comb, block_out2, fn, base, scale, norm_weight, *, hc_mult, eps,
                         hc_eps, sinkhorn_iters, fp32_mix=False, config=None, quantize_x=False):
    """`plan_hc_mix` then `plan_hc_collapse` of its result: ((new streams, post, comb, x), launches); one launch up to
    FUSED_MIX_MAX_TOKENS tokens (the collapse mixes each tile as it reads it), two beyond. quantize_x: the outputs
    end with x act_quant'ed, (values, scales)."""
    collapse = dict(hc_mult=hc_mult, eps=eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, config=config,
                    quantize_x=quantize_x)
    if streams.shape[0] > FUSED_MIX_MAX_TOKENS:
        new, mix = plan_hc_mix(streams, block_out, post, comb, block_out2, fp32_mix=fp32_mix)
        outputs, launches = plan_hc_collapse(new, fn, base, scale, norm_weight, **collapse)
        return (new, *outputs), mix + launches
    _check_mix_inputs(streams, block_out, post, comb, block_out2)
    new = torch.empty_like(streams, memory_format=torch.contiguous_format)
    outputs, launches = _plan_collapse(new, fn, base, scale, norm_weight, head=False, **collapse,
                                       mix=(streams, block_out, block_out2, post, comb, fp32_mix))
    return (new, *outputs), launches


def _launch(launches):
    launch(launches)


def hc_collapse_triton(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                       norm_weight: torch.Tensor | None, *, hc_mult: int, eps: float, hc_eps: float,
                       sinkhorn_iters: int, config: dict | None = None):
    """Triton version of `hc_collapse_reference` (same arguments and outputs), one launch."""
    outputs, launches = plan_hc_collapse(streams, fn, base, scale, norm_weight, hc_mult=hc_mult, eps=eps,
                                         hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, config=config)
    _launch(launches)
    return outputs


def hc_head_triton(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                   eps: float, hc_eps: float, norm_weight: torch.Tensor | None = None,
                   config: dict | None = None) -> torch.Tensor:
    """Triton version of `hc_head_reference` (same arguments and output), one launch."""
    x, launches = plan_hc_head(streams, fn, base, scale, eps=eps, hc_eps=hc_eps, norm_weight=norm_weight,
                               config=config)
    _launch(launches)
    return x


def hc_mix_triton(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                  block_out2: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                  config: dict | None = None, fp32_mix: bool = False) -> torch.Tensor:
    """Triton version of `hc_mix_reference` (same arguments and output), one launch. out: where to write the new
    streams (may be streams itself: each program reads its tile before writing it); a new tensor by default."""
    new, launches = plan_hc_mix(streams, block_out, post, comb, block_out2, out=out, config=config,
                                fp32_mix=fp32_mix)
    _launch(launches)
    return new


def hc_mix_collapse_triton(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                           block_out2: torch.Tensor | None, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                           norm_weight: torch.Tensor | None, *, hc_mult: int, eps: float, hc_eps: float,
                           sinkhorn_iters: int, fp32_mix: bool = False, config: dict | None = None,
                           quantize_x: bool = False):
    """Triton version of `hc_mix_collapse_reference`: one launch at decode sizes; quantize_x: and x act_quant'ed
    after the outputs, (values, scales)."""
    outputs, launches = plan_hc_mix_collapse(streams, block_out, post, comb, block_out2, fn, base, scale, norm_weight,
                                             hc_mult=hc_mult, eps=eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters,
                                             fp32_mix=fp32_mix, config=config, quantize_x=quantize_x)
    _launch(launches)
    return outputs
