"""Routed mixture of experts with DeepSeek-V4's clamped SwiGLU: routing, alignment and the grouped GEMMs.

Math, for token t with chosen experts topk_ids[t, :] and weights topk_weights[t, :]:
  g, u   = split(w_gate_up[e] @ x[t], 2)                 (gate first, then up)
  h      = silu(min(g, limit)) * clamp(u, -limit, limit)
  out[t] = sum_k topk_weights[t, k] * (w_down[e_k] @ h_k)  (accumulated in fp32)

Layouts:
  x            [T, D]
  topk_ids     [T, K] int64 (expert ids; a pair whose id is outside [0, E) is left out: under expert
               parallelism the ids are shifted to the rank's own experts, and another rank's fall outside)
  topk_weights [T, K] fp32
  w_gate_up    [E, 2 * I, D]
  w_down       [E, D, I]

Routing (`route_topk_triton`, `route_hash_triton`; references `route_topk`, `route_hash`), ONE launch each, grid
cdiv(T, BLOCK_T), each program holding BLOCK_T rows of logits [T, E] (fp32/bf16/fp16) in registers:
  scores = sqrt(softplus(logits)) in fp32 (softplus = x above 20, else log1p(exp(x)) computed as
  log(u) * e / (u - 1) with e = exp(x), u = 1 + e: log1p's accuracy without libdevice, which the interpreter lacks)
  top-k: k argmax passes over scores + bias; ties go to the LOWEST expert index, a NaN score counts as -inf;
  the picks come out in pass order (descending score), the reference's torch.topk(sorted=False) in its own order.
  hash: experts = tid2eid[input_ids[t]], scores gathered at those k experts only.
  weights = chosen scores / (their sum + 1e-20) * routed_scaling_factor.

Kernel (`fused_moe_triton`), three launches: `_moe_align_kernel` (reference `moe_align`; see `plan_moe_align`)
sorts the T * k (token, slot) pairs by expert into row blocks of BLOCK_M (each expert's rows padded to a multiple
of BLOCK_M; an expert with no pair owns no block), its other programs zeroing the atomic accumulator (given a
`Routing` instead of the routes, its program 0 routes up to FUSED_ROUTING_MAX_TOKENS tokens first); then two
grouped GEMMs, the block's expert read from block_expert:
  gate/up  h[row, :]   = clamped SwiGLU of x[token] @ [W_gate; W_up][e]^T, fp32 accumulation, stored in x's dtype
  down     out[token] += topk_weight * (h[row] @ W_down[e]^T), fp32, added with fp32 atomics into a zeroed [T, D]
           buffer (or stored per pair and summed by torch with per_pair_output=True: deterministic); the result is
           cast to x's dtype, or returned as the fp32 accumulator itself with out_dtype=torch.float32.
Both GEMMs run a 1-D grid of max_blocks * column-tile programs in the standard Triton matmul grouping
(GROUP_SIZE_M): consecutive programs take GROUP_SIZE_M row blocks x every column tile, so while a group runs, its
row blocks' gathered activations (GROUP_SIZE_M * BLOCK_M rows of x or h) stay in L2 and are read from DRAM about
once, not once per column tile; an expert's weight tiles are shared by its row blocks inside a group too. Row
blocks past the last used one (block_expert -1) are at the end of the order and exit at once.

Shared expert activation (`swiglu_triton`, reference `clamped_swiglu`): [T, 2I] gate|up product -> [T, I], one
launch, so the shared expert is GEMM -> swiglu -> GEMM.

Quantized experts (`QuantizedExperts`):
  fp8           data [E, N, K] float8_e4m3fn, scale [E, H * ceil(R/128), ceil(K/128)] float32: the 128x128 block
                scales of each of the H halves of R rows (gate_up: H = 2 halves of I rows, w1 then w3; down: H = 1)
  mxfp4         as published: data [E, N, K/2] int8 (two e2m1 codes per byte, low nibble = even k), scale
                [E, N, K/32] e8m0 (float8_e8m0fnu or its uint8 bytes); the references read it
  mxfp4_kernel  the same codes repacked for the kernels (`for_kernels`, once at load; quant_formats.repack_mxfp4):
                data [E, N, Kp/8] int32, scale [E, N, Kp/32] uint8, Kp = K rounded up to 128
Their GEMMs put the weights on the MMA's M side (swap-AB: a decode step's 16 tokens of an expert would fill a
quarter of Hopper's 64-row wgmma; 64 or 128 weight rows fill it) and step K by 128: one fp8 block scale, one mxfp4
chunk. fp8 reads its tile as words of four codes, decodes them to bf16 with integer operations
(quant_formats.e4m3_words_to_values: no conversion instruction) and scales each step's product per weight row; with
quantize_hidden (DeepSeek's numerics) x and h are e4m3 with per-128 scales and the product is e4m3 x e4m3 (wgmma fp8),
scaled per weight row and token: DeepSeek's own fp8_gemm. mxfp4 decodes its words into bf16 operands in registers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.common import (TL_DTYPES, aligned_words, clamped_swiglu_values, compute_dtype, is_interpreting, launch,
                            wait_for_previous_kernel)
from kernels.fp8_gemm import plan_act_quant
from kernels.quant_formats import (FP8_ACT_BLOCK, FP8_BLOCK, MXFP4_CHUNK, dequantize_mxfp4, e4m3_groups,
                                   e4m3_words_to_values, mxfp4_words_to_values, repack_mxfp4, round_to_dtype,
                                   simulate_quantization, unpack_mxfp4)
from kernels.tuning import tuned


def route_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, routed_scaling_factor: float):
    """Reference top-k routing. logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32).

    scores = sqrt(softplus(logits)) in fp32; experts = top-k of scores + bias (the correction bias only picks);
    weights = the chosen scores renormalised to sum 1 (+1e-20), times routed_scaling_factor.
    """
    scores = F.softplus(logits.float()).sqrt()
    topk_ids = torch.topk(scores + bias.float(), k, dim=-1, sorted=False).indices
    return topk_ids, _normalised_weights(scores, topk_ids, routed_scaling_factor)


def route_hash(logits: torch.Tensor, tid2eid: torch.Tensor, input_ids: torch.Tensor, routed_scaling_factor: float):
    """Reference hash routing: experts = tid2eid[input_ids] (a frozen table), weights as in `route_topk`.

    logits [T, E], tid2eid [vocab, k], input_ids [T] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32).
    """
    scores = F.softplus(logits.float()).sqrt()
    topk_ids = tid2eid[input_ids.reshape(-1)].long()
    return topk_ids, _normalised_weights(scores, topk_ids, routed_scaling_factor)


def _normalised_weights(scores, topk_ids, routed_scaling_factor):
    weights = scores.gather(1, topk_ids)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * routed_scaling_factor


# --- routing kernels ------------------------------------------------------------------------------------------
@triton.jit
def _sqrt_softplus(x):
    """sqrt(softplus(x)) in fp32, as torch's F.softplus (threshold 20) then sqrt (IEEE)."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    d = tl.where(u == 1.0, 1.0, u - 1.0)
    softplus = tl.where(u == 1.0, e, tl.log(u) * (e / d))  # log1p(e), accurate also where e << 1
    softplus = tl.where(x > 20.0, x, softplus)
    return tl.sqrt_rn(softplus)


@triton.jit
def _topk_routes(logits_ptr, bias_ptr, rows, row_mask, stride_lt, routed_scaling_factor, NUM_EXPERTS: tl.constexpr,
                 TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """(ids [BLOCK_T, BLOCK_K] int32, weights fp32) of the tokens `rows`: TOP_K argmax passes over scores + bias
    (ties -> lowest expert), normalised weights."""
    experts = tl.arange(0, BLOCK_E)
    e_mask = experts < NUM_EXPERTS
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_lt + experts[None, :],
                mask=row_mask[:, None] & e_mask[None, :], other=0.0).to(tl.float32)
    scores = _sqrt_softplus(x)
    choice = scores + tl.load(bias_ptr + experts, mask=e_mask, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(choice == choice, choice, float("-inf"))  # NaN ranks lowest
    slots = tl.arange(0, BLOCK_K)
    taken = tl.zeros([BLOCK_T, BLOCK_E], tl.int1) | (~e_mask)[None, :]  # padding experts are never free
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(taken, float("-inf"), choice), axis=1)
        pick = tl.min(tl.where(~taken & (choice == best[:, None]), experts[None, :], BLOCK_E), axis=1)
        hit = experts[None, :] == pick[:, None]
        taken = taken | hit
        ids = tl.where(slots[None, :] == j, pick[:, None], ids)
        weights = tl.where(slots[None, :] == j, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], weights)
    weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20) * routed_scaling_factor
    return ids, weights


@triton.jit
def _hash_routes(logits_ptr, tid2eid_ptr, input_ids_ptr, rows, row_mask, stride_lt, stride_tid, routed_scaling_factor,
                 TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(ids [BLOCK_T, BLOCK_K], weights fp32) of the tokens `rows`: experts from the table, scores gathered at them,
    normalised weights."""
    slots = tl.arange(0, BLOCK_K)
    mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    token_ids = tl.load(input_ids_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    ids = tl.load(tid2eid_ptr + token_ids[:, None] * stride_tid + slots[None, :], mask=mask, other=0).to(tl.int64)
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_lt + ids, mask=mask, other=0.0).to(tl.float32)
    weights = tl.where(mask, _sqrt_softplus(x), 0.0)
    weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20) * routed_scaling_factor
    return ids, weights


@triton.jit
def _route_rows(logits_ptr, table_ptr, input_ids_ptr, ids_ptr, weights_ptr, rows, num_tokens, stride_lt, stride_tid,
                routed_scaling_factor, ROUTE: tl.constexpr, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Route the tokens `rows` (ROUTE 1: top-k over the logits with the bias `table_ptr`; 2: hash, `table_ptr` the
    tid2eid table) and store their ids [T, TOP_K] int64 and weights fp32."""
    row_mask = rows < num_tokens
    if ROUTE == 1:
        ids, weights = _topk_routes(logits_ptr, table_ptr, rows, row_mask, stride_lt, routed_scaling_factor,
                                    NUM_EXPERTS, TOP_K, BLOCK_T, BLOCK_E, BLOCK_K)
    else:
        ids, weights = _hash_routes(logits_ptr, table_ptr, input_ids_ptr, rows, row_mask, stride_lt, stride_tid,
                                    routed_scaling_factor, TOP_K, BLOCK_K)
    slots = tl.arange(0, BLOCK_K)
    mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    offs = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    tl.store(ids_ptr + offs, ids.to(tl.int64), mask=mask)
    tl.store(weights_ptr + offs, weights, mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(
    logits_ptr, table_ptr, input_ids_ptr, ids_ptr, weights_ptr,
    num_tokens, stride_lt, stride_tid, routed_scaling_factor,
    ROUTE: tl.constexpr, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,  # launched to wait for the kernel before it (common.launch)
):
    """Program (BLOCK_T tokens): their routes (`_route_rows`)."""
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _route_rows(logits_ptr, table_ptr, input_ids_ptr, ids_ptr, weights_ptr, rows, num_tokens, stride_lt, stride_tid,
                routed_scaling_factor, ROUTE, NUM_EXPERTS, TOP_K, BLOCK_T, BLOCK_E, BLOCK_K)


TOPK_ROUTE, HASH_ROUTE = 1, 2  # the routing kernels' ROUTE (0 in the alignment: the ids are given)


def _route_tiles(route: int, num_experts: int, k: int) -> dict:
    """The routing code's tiles (fixed by the model, not by T): top-k holds a [BLOCK_T, BLOCK_E] tile of about 1K
    scores; hash gathers k scores for each of 16 tokens."""
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 1024 // block_e)) if route == TOPK_ROUTE else 16
    return dict(BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k))


def plan_route_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, routed_scaling_factor: float):
    """Check, allocate (ids [T, k] int64, weights [T, k] fp32); return ((ids, weights), launches)."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [T, E] with a contiguous last dimension"
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16), f"logits dtype {logits.dtype}"
    num_tokens, num_experts = logits.shape
    assert tuple(bias.shape) == (num_experts,) and bias.stride(0) == 1, "bias must be [E], contiguous"
    assert 1 <= k <= num_experts, f"top-{k} of {num_experts} experts"
    ids = torch.empty((num_tokens, k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((num_tokens, k), dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return (ids, weights), []
    tiles = _route_tiles(TOPK_ROUTE, num_experts, k)
    args = (logits, bias, logits, ids, weights, num_tokens, logits.stride(0), 0, float(routed_scaling_factor))
    kwargs = dict(ROUTE=TOPK_ROUTE, NUM_EXPERTS=num_experts, TOP_K=k, **tiles, num_warps=4)
    return (ids, weights), [(_route_kernel, (triton.cdiv(num_tokens, tiles["BLOCK_T"]),), args, kwargs)]


def route_topk_triton(logits: torch.Tensor, bias: torch.Tensor, k: int, routed_scaling_factor: float):
    """Triton version of `route_topk` (same arguments and outputs), one launch. The ids of a row come out in
    descending score order (ties: lowest expert index first); the reference's order is torch.topk's."""
    out, launches = plan_route_topk(logits, bias, k, routed_scaling_factor)
    launch(launches)
    return out


def plan_route_hash(logits: torch.Tensor, tid2eid: torch.Tensor, input_ids: torch.Tensor,
                    routed_scaling_factor: float):
    """Check, allocate (ids [T, k] int64, weights [T, k] fp32); return ((ids, weights), launches)."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [T, E] with a contiguous last dimension"
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16), f"logits dtype {logits.dtype}"
    assert tid2eid.dim() == 2 and tid2eid.stride(1) == 1, "tid2eid must be [vocab, k], contiguous rows"
    assert not tid2eid.is_floating_point() and not input_ids.is_floating_point(), "integer tid2eid and input_ids"
    input_ids = input_ids.reshape(-1)
    num_tokens, k = logits.shape[0], tid2eid.shape[1]
    assert input_ids.numel() == num_tokens and input_ids.stride(0) == 1, "input_ids must hold T contiguous ids"
    ids = torch.empty((num_tokens, k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((num_tokens, k), dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return (ids, weights), []
    tiles = _route_tiles(HASH_ROUTE, logits.shape[1], k)
    args = (logits, tid2eid, input_ids, ids, weights, num_tokens, logits.stride(0), tid2eid.stride(0),
            float(routed_scaling_factor))
    kwargs = dict(ROUTE=HASH_ROUTE, NUM_EXPERTS=logits.shape[1], TOP_K=k, **tiles, num_warps=1)
    return (ids, weights), [(_route_kernel, (triton.cdiv(num_tokens, tiles["BLOCK_T"]),), args, kwargs)]


def route_hash_triton(logits: torch.Tensor, tid2eid: torch.Tensor, input_ids: torch.Tensor,
                      routed_scaling_factor: float):
    """Triton version of `route_hash` (same arguments and outputs), one launch."""
    out, launches = plan_route_hash(logits, tid2eid, input_ids, routed_scaling_factor)
    launch(launches)
    return out


REPACK_EXPERTS = 8  # experts repacked a pass (`QuantizedExperts.for_kernels`)


class QuantizedExperts(NamedTuple):
    """Routed expert weights, quantized (see the module docstring); `shape` is the logical [E, N, K]."""

    format: str  # "fp8", "mxfp4" (as published) or "mxfp4_kernel" (`for_kernels`: the layout the kernels read)
    data: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, int, int]
    rows_per_half: int  # R: rows of each half sharing a block-scale grid (fp8); N for mxfp4 and down

    def dequantize(self) -> torch.Tensor:
        """[E, N, K] float32, the reference's view of the weights."""
        num_experts, n, k = self.shape
        if self.format == "mxfp4_kernel":
            return dequantize_mxfp4(*unpack_mxfp4(self.data, self.scale, k))
        if self.format == "mxfp4":
            return dequantize_mxfp4(self.data, self.scale.view(torch.uint8))
        r = self.rows_per_half  # each half has its own grid of 128 x 128 block scales
        blocks = triton.cdiv(r, FP8_BLOCK)
        halves = self.scale.view(num_experts, n // r, blocks, -1).repeat_interleave(FP8_BLOCK, 2)[:, :, :r]
        per_row = halves.reshape(num_experts, n, -1).repeat_interleave(FP8_BLOCK, -1)[..., :k]
        return self.data.float() * per_row

    def for_kernels(self) -> QuantizedExperts:
        """The weights in the layout the kernels read: MXFP4 repacked (`repack_mxfp4`), FP8 as published. Done once,
        when a model that runs the kernels is built: REPACK_EXPERTS experts a pass, into tensors made once (at
        V4-Flash's widths a layer's gate/up is 2 GiB: beside it the new tensor and one pass's temporaries, about 150 MB
        an expert, where a list of every expert's, then their stack, took two more copies; and 8 times fewer
        operations than expert by expert)."""
        if self.format != "mxfp4":
            return self
        num_experts = self.shape[0]
        words, scale = None, None
        for start in range(0, num_experts, REPACK_EXPERTS):
            part_words, part_scale = repack_mxfp4(self.data[start:start + REPACK_EXPERTS],
                                                  self.scale[start:start + REPACK_EXPERTS])
            if words is None:
                words = part_words.new_empty((num_experts, *part_words.shape[1:]))
                scale = part_scale.new_empty((num_experts, *part_scale.shape[1:]))
            words[start:start + REPACK_EXPERTS], scale[start:start + REPACK_EXPERTS] = part_words, part_scale
        return self._replace(format="mxfp4_kernel", data=words, scale=scale)


DENSE, FP8, MXFP4 = 0, 1, 2
QUANTIZED_BLOCK_K = 128  # K step of the quantized experts: one fp8 scale block, one mxfp4 chunk, one act_quant group
GROUP_SIZE_M = 8  # row blocks per launch group (the standard Triton matmul value)
_FORMATS = {"fp8": FP8, "mxfp4_kernel": MXFP4}


@triton.jit
def _activation_tile(ptr, scale_ptr, rows, row_mask, k0, k_size, stride_row, stride_scale, BLOCK_K: tl.constexpr,
                     QUANTIZED: tl.constexpr, KEEP_FP8: tl.constexpr, SWAP_AB: tl.constexpr,
                     COMPUTE_DTYPE: tl.constexpr):
    """The K step's activations of `rows` (int64 row offsets): [BLOCK_M, BLOCK_K], or [BLOCK_K, BLOCK_M] with SWAP_AB;
    and their scales. QUANTIZED: stored as e4m3 with one scale per row and 128 columns (BLOCK_K divides 128), kept as
    e4m3 with the scales [BLOCK_M] for an FP8 dot (KEEP_FP8), else dequantized (exact in bf16); otherwise the values
    (scale 1)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if SWAP_AB:
        a = tl.load(ptr + rows[None, :] * stride_row + ks[:, None], mask=row_mask[None, :] & (ks < k_size)[:, None],
                    other=0.0)
    else:
        a = tl.load(ptr + rows[:, None] * stride_row + ks[None, :], mask=row_mask[:, None] & (ks < k_size)[None, :],
                    other=0.0)
    scale = 1.0
    if QUANTIZED:
        scale = tl.load(scale_ptr + rows * stride_scale + k0 // 128, mask=row_mask, other=0.0)
        if not KEEP_FP8:
            a = a.to(tl.float32) * (scale[None, :] if SWAP_AB else scale[:, None])
            scale = 1.0
    if not KEEP_FP8:
        a = a.to(COMPUTE_DTYPE)
    return a, scale


@triton.jit
def _accumulate(acc, a, a_scale, w_ptr, s_ptr, expert, w_rows, w_row_mask, k0, k_size, rows_per_half, stride_we,
                stride_wn, stride_se, stride_sn, BLOCK_K: tl.constexpr, WEIGHT_FORMAT: tl.constexpr,
                SWAP_AB: tl.constexpr, FP8_DOT: tl.constexpr, NATIVE_FP8: tl.constexpr,
                COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc plus one K step's product of the activation tile `a` and W[expert, w_rows, k0:k0 + BLOCK_K].

    acc [BLOCK_M, BLOCK_N] += a @ W^T, or with SWAP_AB acc [BLOCK_N, BLOCK_M] += W @ a (a [BLOCK_K, BLOCK_M]): the
    weight rows on the MMA's M side, where they fill Hopper's 64-row wgmma and the tokens its narrow N side. fp8: the
    e4m3 tile read as words and decoded to COMPUTE_DTYPE (quant_formats.e4m3_words_to_values) or, FP8_DOT,
    multiplied as e4m3 by e4m3 activations; the product scaled per weight row by its 128 x 128 block scale (and per
    token by the activations' scale a_scale); mxfp4 (SWAP_AB): the repacked tile decoded with its scales
    (quant_formats.mxfp4_words_to_values) straight into the MMA operand."""
    # (one return at the end: Triton compiles the statements after a return in a constexpr branch too)
    if WEIGHT_FORMAT == 2:
        words = tl.load(w_ptr + expert * stride_we + w_rows[:, None] * stride_wn + k0 // 8 + tl.arange(0, 16)[None, :],
                        mask=w_row_mask[:, None], other=0)
        scales = tl.load(s_ptr + expert * stride_se + w_rows * stride_sn + k0 // 128, mask=w_row_mask, other=0)
        acc = tl.dot(mxfp4_words_to_values(words, scales, COMPUTE_DTYPE), a, acc, input_precision=DOT_PRECISION)
    elif WEIGHT_FORMAT == 1 and not FP8_DOT:  # e4m3 weights, activations in COMPUTE_DTYPE
        words = k0 // 4 + tl.arange(0, BLOCK_K // 4)  # four codes a word (K % 4 == 0): no conversion instruction
        rows = (w_ptr + expert * stride_we + w_rows[:, None] * stride_wn).to(tl.pointer_type(tl.int32))
        w = e4m3_words_to_values(tl.load(rows + words[None, :], mask=w_row_mask[:, None] &
                                         (words < k_size // 4)[None, :], other=0), COMPUTE_DTYPE)
        if not SWAP_AB:
            w = tl.trans(w)
        product = _oriented_dot(w, a, None, SWAP_AB, DOT_PRECISION)
        acc += product * _fp8_scales(s_ptr, expert, w_rows, k0, w_row_mask, stride_se, stride_sn, rows_per_half,
                                     a_scale, SWAP_AB, FP8_DOT)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        if SWAP_AB:
            w = tl.load(w_ptr + expert * stride_we + w_rows[:, None] * stride_wn + ks[None, :],
                        mask=w_row_mask[:, None] & (ks < k_size)[None, :], other=0.0)
        else:
            w = tl.load(w_ptr + expert * stride_we + w_rows[None, :] * stride_wn + ks[:, None],
                        mask=(ks < k_size)[:, None] & w_row_mask[None, :], other=0.0)
        if WEIGHT_FORMAT == 0:
            acc = _oriented_dot(w.to(COMPUTE_DTYPE), a, acc, SWAP_AB, DOT_PRECISION)
        else:  # e4m3 by e4m3: an FP8 dot takes the default precision; the interpreter's is an fp32 one (exact)
            if not NATIVE_FP8:
                w, a = w.to(tl.float32), a.to(tl.float32)
            product = _oriented_dot(w, a, None, SWAP_AB, None if NATIVE_FP8 else "ieee")
            acc += product * _fp8_scales(s_ptr, expert, w_rows, k0, w_row_mask, stride_se, stride_sn, rows_per_half,
                                         a_scale, SWAP_AB, FP8_DOT)
    return acc


@triton.jit
def _fp8_scales(s_ptr, expert, w_rows, k0, w_row_mask, stride_se, stride_sn, rows_per_half, a_scale,
                SWAP_AB: tl.constexpr, FP8_DOT: tl.constexpr):
    """What multiplies one K step's fp8 product: each weight row's block scale, times each token's activation scale
    for an FP8 dot; broadcast along the product's tokens."""
    ROWS: tl.constexpr = 1 if SWAP_AB else 0  # the axis along which a weight row's scale broadcasts
    scale = tl.expand_dims(_fp8_row_scales(s_ptr, expert, w_rows, k0, w_row_mask, stride_se, stride_sn,
                                           rows_per_half), ROWS)
    if FP8_DOT:
        scale = scale * tl.expand_dims(a_scale, 1 - ROWS)
    return scale


@triton.jit
def _oriented_dot(w, a, acc, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """w @ a with SWAP_AB (weight rows first), else a @ w."""
    if SWAP_AB:
        acc = tl.dot(w, a, acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _fp8_row_scales(s_ptr, expert, rows, k0, row_mask, stride_se, stride_sn, rows_per_half):
    """The fp8 block scales [len(rows)] of weight rows for the K block at k0: one per 128 x 128 block, the rows of
    each half (w1, w3) on their own grid."""
    blocks = (rows_per_half + 127) // 128
    scale_rows = (rows // rows_per_half) * blocks + (rows % rows_per_half) // 128
    return tl.load(s_ptr + expert * stride_se + scale_rows * stride_sn + k0 // 128, mask=row_mask, other=0.0)


@triton.jit
def _by_rows(acc, SWAP_AB: tl.constexpr):
    """An accumulator as [BLOCK_M, BLOCK_N] (token rows first), whichever side of the MMA the weights took."""
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _grouped_tile(pid, num_row_blocks, num_col_tiles, GROUP_SIZE_M: tl.constexpr):
    """(row block, column tile) of program pid in the standard Triton matmul grouping: GROUP_SIZE_M row blocks
    share each column tile in turn, so their rows of the activation are reused from L2 across column tiles."""
    per_group = GROUP_SIZE_M * num_col_tiles
    first_block = (pid // per_group) * GROUP_SIZE_M
    group_rows = tl.minimum(num_row_blocks - first_block, GROUP_SIZE_M)
    return first_block + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _moe_gate_up_kernel(
    # pointers
    x_ptr, xs_ptr, w_ptr, s_ptr, h_ptr, hs_ptr, sorted_pairs_ptr, block_expert_ptr, topk_weights_ptr,
    # sizes
    num_pairs, max_blocks, top_k, hidden, inter, swiglu_limit, rows_per_half,
    # strides (the last dimension of every tensor is contiguous)
    stride_xt, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_hm, stride_hs,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WEIGHT_FORMAT: tl.constexpr, GROUP_SIZE_M: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr, QUANTIZE_H: tl.constexpr, OUT_DTYPE: tl.constexpr, NATIVE_FP8: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PDL: tl.constexpr = False,  # launched to wait for the kernel before it (common.launch)
):
    """Program (row block b, intermediate columns n): h[rows, n] = SwiGLU(x[tokens] @ W_gate/up[e, n]^T).

    WEIGHT_FIRST (DeepSeek's Expert.forward): the gate and up products rounded to OUT_DTYPE (its linears' outputs),
    SwiGLU and the pair's routing weight in fp32, one rounding to OUT_DTYPE. QUANTIZE_H (DeepSeek's act_quant of both
    GEMMs' inputs): x is read as e4m3 with its scales (xs), and h is stored so, e4m3 per 128 columns (BLOCK_N % 128
    == 0) with its scales in hs."""
    wait_for_previous_kernel(PDL)
    block, col_tile = _grouped_tile(tl.program_id(0), max_blocks, tl.cdiv(inter, BLOCK_N), GROUP_SIZE_M)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:  # past the last used block
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_mask = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    acc_shape: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N)
    acc_gate = tl.zeros(acc_shape, tl.float32)
    acc_up = tl.zeros(acc_shape, tl.float32)
    FP8_DOT: tl.constexpr = WEIGHT_FORMAT == 1 and QUANTIZE_H
    for k0 in range(0, hidden, BLOCK_K):
        a, a_scale = _activation_tile(x_ptr, xs_ptr, tokens, row_mask, k0, hidden, stride_xt, stride_xs, BLOCK_K,
                                      QUANTIZE_H, FP8_DOT, SWAP_AB, COMPUTE_DTYPE)
        acc_gate = _accumulate(acc_gate, a, a_scale, w_ptr, s_ptr, expert, cols, col_mask, k0, hidden, rows_per_half,
                               stride_we, stride_wn, stride_se, stride_sn, BLOCK_K, WEIGHT_FORMAT, SWAP_AB, FP8_DOT,
                               NATIVE_FP8, COMPUTE_DTYPE, DOT_PRECISION)
        acc_up = _accumulate(acc_up, a, a_scale, w_ptr, s_ptr, expert, cols + inter, col_mask, k0, hidden,
                             rows_per_half, stride_we, stride_wn, stride_se, stride_sn, BLOCK_K, WEIGHT_FORMAT, SWAP_AB,
                             FP8_DOT, NATIVE_FP8, COMPUTE_DTYPE, DOT_PRECISION)
    gate, up = _by_rows(acc_gate, SWAP_AB), _by_rows(acc_up, SWAP_AB)
    if WEIGHT_FIRST:
        gate, up = round_to_dtype(gate, OUT_DTYPE), round_to_dtype(up, OUT_DTYPE)
    h = clamped_swiglu_values(gate, up, swiglu_limit)
    if WEIGHT_FIRST:
        h = round_to_dtype(h * tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0)[:, None], OUT_DTYPE)
    h_offsets = rows[:, None].to(tl.int64) * stride_hm + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if QUANTIZE_H:
        grid, scale = e4m3_groups(h, BLOCK_M, BLOCK_N)
        tl.store(h_ptr + h_offsets, grid.to(h_ptr.dtype.element_ty), mask=mask)
        groups = col_tile * (BLOCK_N // 128) + tl.arange(0, BLOCK_N // 128)
        tl.store(hs_ptr + rows[:, None].to(tl.int64) * stride_hs + groups[None, :], scale,
                 mask=row_mask[:, None] & (groups < tl.cdiv(inter, 128))[None, :])
    else:
        tl.store(h_ptr + h_offsets, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _moe_down_kernel(
    # pointers
    h_ptr, hs_ptr, w_ptr, s_ptr, topk_weights_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr,
    # sizes
    num_pairs, max_blocks, top_k, hidden, inter, rows_per_half,
    # strides (the last dimension of every tensor is contiguous)
    stride_hm, stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PER_PAIR_OUTPUT: tl.constexpr, WEIGHT_FORMAT: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, WEIGHT_FIRST: tl.constexpr, QUANTIZE_H: tl.constexpr, OUT_DTYPE: tl.constexpr,
    NATIVE_FP8: tl.constexpr, SWAP_AB: tl.constexpr,
    PDL: tl.constexpr = False,  # launched to wait for the kernel before it (common.launch)
):
    """Program (row block b, hidden columns n): out[token, n] += weight * (h[rows] @ W_down[e, n]^T), in fp32.

    WEIGHT_FIRST: the weight is already in h, and each pair's product is rounded to OUT_DTYPE (DeepSeek's w2 output)
    before the fp32 sum. QUANTIZE_H: h is read as e4m3 with its scales. PER_PAIR_OUTPUT stores row `pair` of a
    [T * k, D] buffer instead of adding into row `token` atomically.
    """
    wait_for_previous_kernel(PDL)
    block, col_tile = _grouped_tile(tl.program_id(0), max_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_SIZE_M)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:  # past the last used block
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_mask = pairs < num_pairs
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), tl.float32)
    FP8_DOT: tl.constexpr = WEIGHT_FORMAT == 1 and QUANTIZE_H
    for k0 in range(0, inter, BLOCK_K):
        a, a_scale = _activation_tile(h_ptr, hs_ptr, rows.to(tl.int64), row_mask, k0, inter, stride_hm, stride_hs,
                                      BLOCK_K, QUANTIZE_H, FP8_DOT, SWAP_AB, COMPUTE_DTYPE)
        acc = _accumulate(acc, a, a_scale, w_ptr, s_ptr, expert, cols, col_mask, k0, inter, rows_per_half, stride_we,
                          stride_wn, stride_se, stride_sn, BLOCK_K, WEIGHT_FORMAT, SWAP_AB, FP8_DOT, NATIVE_FP8,
                          COMPUTE_DTYPE, DOT_PRECISION)
    acc = _by_rows(acc, SWAP_AB)
    if WEIGHT_FIRST:
        acc = round_to_dtype(acc, OUT_DTYPE)
    else:
        acc *= tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    mask = row_mask[:, None] & col_mask[None, :]
    if PER_PAIR_OUTPUT:
        tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_om + cols[None, :], acc, mask=mask)
    else:
        tokens = (pairs // top_k).to(tl.int64)
        tl.atomic_add(out_ptr + tokens[:, None] * stride_om + cols[None, :], acc, mask=mask, sem="relaxed")


def moe_config(num_pairs: int, num_experts: int, hidden: int, inter: int, weight_format: int = DENSE,
               quantize_hidden: bool = False) -> dict:
    """BLOCK_M from the mean (token, slot) pairs per expert; the orientation and tiles of both GEMMs.

    Quantized experts put the weight rows on the MMA's M side (SWAP_AB; BLOCK_N of 64 or 128: one or two 64-row
    wgmma per warpgroup) and the row block's tokens on its N side (BLOCK_M 16 at decode), K steps of 128 (one fp8
    scale block, one mxfp4 chunk): on 16 tokens' rows the MMA would be mma.sync, with fp8 weights upcast to fp16 for
    an e4m3 product, and fp8 converted to bf16 issues fewer instructions per byte swapped too (sm_90 SASS, Triton
    3.7: 4.1 against 4.4 at decode, 4.8 against 9.2 in prefill). Dense experts keep the tokens on the M side.
    """
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else (32 if per_expert <= 48 else 64)
    swap_ab = _weights_on_the_m_side(weight_format)
    if swap_ab:
        wide = block_m > 16 or quantize_hidden  # quantize_hidden: h is act_quant'ed in 128-column groups in a tile
        warps = 4 if block_m == 16 else 8  # from 32 tokens, two warpgroups share the 128 weight rows (no spills)
        gate_up = dict(BLOCK_N=128 if wide else 64, BLOCK_K=QUANTIZED_BLOCK_K, num_warps=warps,
                       num_stages=4 if block_m < 64 else 3)
        down = dict(BLOCK_N=128, BLOCK_K=QUANTIZED_BLOCK_K, num_warps=warps, num_stages=4)
    elif block_m == 16:
        gate_up = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
        down = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    elif block_m == 32:
        gate_up = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
        down = dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
    else:
        gate_up = dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
        down = dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
    # small models: no tile wider than its matrix (rounded up to a power of two >= 16, tl.dot's minimum)
    fit = lambda size: max(16, triton.next_power_of_2(size))  # noqa: E731
    if not swap_ab:
        gate_up["BLOCK_K"], down["BLOCK_K"] = min(gate_up["BLOCK_K"], fit(hidden)), min(down["BLOCK_K"], fit(inter))
    gate_up["BLOCK_N"], down["BLOCK_N"] = min(gate_up["BLOCK_N"], fit(inter)), min(down["BLOCK_N"], fit(hidden))
    if quantize_hidden:  # h is act_quant'ed in groups of 128 columns inside the gate/up tile
        gate_up["BLOCK_N"] = max(gate_up["BLOCK_N"], FP8_ACT_BLOCK)
    shape = dict(experts=num_experts, hidden=hidden, inter=inter, format=("dense", "fp8", "mxfp4")[weight_format],
                 quantize_hidden=quantize_hidden, pairs=num_pairs)  # tuned per device (kernels/tuning.py)
    return tuned("moe", shape, dict(BLOCK_M=block_m, GROUP_SIZE_M=GROUP_SIZE_M, SWAP_AB=swap_ab, gate_up=gate_up,
                                    down=down))


def _weights_on_the_m_side(weight_format: int) -> bool:
    """moe_config's SWAP_AB (see there), also for a config that does not say."""
    return weight_format != DENSE


def max_align_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Row blocks the alignment may use, from shapes only: sum_e cdiv(count_e, block_m) is at most this."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Group the (token, slot) pairs by expert into row blocks of block_m, without a host synchronisation
    (the reference of `_moe_align_kernel`: the same outputs, bit for bit). Pairs whose expert is outside
    [0, num_experts) are left out (expert parallelism: ids shifted to this rank's experts, another rank's
    fall outside), so they contribute nothing.

    Returns sorted_pairs [max_blocks * block_m] int32 (pair index t * k + slot, num_pairs in padding rows) and
    block_expert [max_blocks] int64 (-1 for blocks past the last used one). max_blocks is an upper bound from
    shapes only: sum_e cdiv(count_e, block_m) <= (num_pairs + min(E, num_pairs) * (block_m - 1)) // block_m.
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    max_blocks = max_align_blocks(num_pairs, num_experts, block_m)
    keyed = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # another rank's: sorted last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, keyed, torch.ones_like(keyed))
    blocks = (counts[:num_experts] + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)  # [E]
    order = torch.argsort(keyed, stable=True)  # pairs grouped by expert
    expert_of = keyed[order]
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    first_row = torch.cat([block_end - blocks, block_end.new_full((1,), max_blocks)]) * block_m
    dest = torch.where(expert_of < num_experts, first_row[expert_of] + rank, max_blocks * block_m)  # skipped: past
    sorted_pairs = torch.full((max_blocks * block_m + 1,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    sorted_pairs = sorted_pairs[:-1]
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=flat.device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return sorted_pairs, block_expert


@triton.jit(do_not_specialize=["num_pairs", "max_blocks", "zero_numel", "num_tokens", "first_expert"])
def _moe_align_kernel(
    ids_ptr, sorted_pairs_ptr, block_expert_ptr, zero_ptr, num_pairs, max_blocks, zero_numel, first_expert,
    # ROUTE: the routing, first (its logits, bias or tid2eid table, input ids; weights out)
    logits_ptr, table_ptr, input_ids_ptr, weights_ptr, num_tokens, stride_lt, stride_tid, routed_scaling_factor,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr, ZERO_BLOCK: tl.constexpr, ROUTE: tl.constexpr, ROUTED_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr, ROUTE_BLOCK_T: tl.constexpr, ROUTE_BLOCK_E: tl.constexpr, ROUTE_BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,  # launched to wait for the kernel before it (common.launch)
):
    """Program 0: `moe_align` (see the module docstring) of the ids minus first_expert (this rank's experts are
    0..NUM_EXPERTS - 1), after (ROUTE) routing every token into ids_ptr and weights_ptr itself (`_route_rows`, as the
    routing kernel; ROUTED_EXPERTS: the model's expert count). Programs 1..: zero zero_ptr[:zero_numel] (fp32)."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    if pid > 0:
        offs = (pid - 1).to(tl.int64) * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
        tl.store(zero_ptr + offs, tl.zeros([ZERO_BLOCK], tl.float32), mask=offs < zero_numel)
        return
    if ROUTE != 0:
        for t0 in range(0, num_tokens, ROUTE_BLOCK_T):
            _route_rows(logits_ptr, table_ptr, input_ids_ptr, ids_ptr, weights_ptr, t0 + tl.arange(0, ROUTE_BLOCK_T),
                        num_tokens, stride_lt, stride_tid, routed_scaling_factor, ROUTE, ROUTED_EXPERTS, TOP_K,
                        ROUTE_BLOCK_T, ROUTE_BLOCK_E, ROUTE_BLOCK_K)
        tl.debug_barrier()  # the ids this program's threads stored are visible to all of them
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, BLOCK_P)
    # pass 1: pairs per expert
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        ids = tl.load(ids_ptr + p0 + lanes, mask=p0 + lanes < num_pairs, other=-1).to(tl.int32) - first_expert
        ids = tl.where((ids >= 0) & (ids < NUM_EXPERTS), ids, -1)  # another rank's expert: left out
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)
    block_start = block_end - blocks
    # every row that holds no pair: the expert of its block, its offset in that expert's rows
    total_rows = max_blocks * BLOCK_M
    for r0 in range(0, total_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        expert = tl.sum((block_end[None, :] <= (rows // BLOCK_M)[:, None]).to(tl.int32), axis=1)  # E: past the end
        mine = experts[None, :] == expert[:, None]
        first = tl.sum(tl.where(mine, block_start[None, :], 0), axis=1) * BLOCK_M
        count = tl.sum(tl.where(mine, counts[None, :], 0), axis=1)
        padding = (expert >= NUM_EXPERTS) | (rows - first >= count)
        tl.store(sorted_pairs_ptr + rows, tl.zeros([BLOCK_R], tl.int32) + num_pairs, mask=padding & (rows < total_rows))
        is_first = (rows % BLOCK_M == 0) & (rows < total_rows)  # block_expert: one entry per block
        tl.store(block_expert_ptr + rows // BLOCK_M, tl.where(expert < NUM_EXPERTS, expert, -1).to(tl.int64),
                 mask=is_first)
    # pass 2: each pair's row = its expert's cursor + its rank among the chunk's earlier pairs of that expert
    cursor = block_start * BLOCK_M
    for p0 in range(0, num_pairs, BLOCK_P):
        ids = tl.load(ids_ptr + p0 + lanes, mask=p0 + lanes < num_pairs, other=-1).to(tl.int32) - first_expert
        ids = tl.where((ids >= 0) & (ids < NUM_EXPERTS), ids, -1)
        valid = ids >= 0
        onehot = ids[:, None] == experts[None, :]
        base = tl.sum(tl.where(onehot, cursor[None, :], 0), axis=1)
        earlier = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_pairs_ptr + base + rank, (p0 + lanes).to(tl.int32), mask=valid)
        cursor += tl.sum(onehot.to(tl.int32), axis=0)


ZERO_BLOCK = 1024  # fp32 elements zeroed per extra program of the alignment launch


def plan_moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, zero: torch.Tensor | None = None, *,
                   first_expert: int = 0, routing: "Routing | None" = None, topk_weights: torch.Tensor | None = None):
    """Allocate `moe_align`'s outputs; return ((sorted_pairs, block_expert), launches): ONE launch, program 0
    aligning (one program: the alignment is a few hundred pairs at decode) and, when `zero` (a contiguous fp32
    buffer) is given, more programs zeroing it, so the atomic accumulator costs no launch of its own.

    Program 0 holds [BLOCK_P, BLOCK_E] one-hot tiles of expert ids (about 8K elements): a histogram pass, an
    exclusive cumsum of cdiv(count, BLOCK_M) for each expert's first block, a pass over the rows that writes
    block_expert and the padding rows, and a pass that places each pair at its expert's cursor plus its rank
    among the chunk's earlier pairs of that expert ([BLOCK_P, BLOCK_P] comparisons), so pairs of one expert keep
    increasing pair order, as the reference's stable sort does. Nothing depends on data on the host.

    first_expert: the pairs are aligned by id - first_expert (expert parallelism: this rank's experts are 0..
    num_experts - 1). routing: program 0 first routes every token itself (`_route_rows`, the routing kernel's code),
    writing topk_ids and topk_weights, then aligns them: one launch for both, where a decode step's few tokens would
    keep a routing launch's programs mostly idle."""
    flat = topk_ids.reshape(-1)
    assert flat.stride(0) == 1 or flat.numel() <= 1, "topk_ids must be contiguous"
    num_pairs = flat.numel()
    max_blocks = max_align_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty((max_blocks * block_m,), dtype=torch.int32, device=flat.device)
    block_expert = torch.empty((max_blocks,), dtype=torch.int64, device=flat.device)
    zero_numel = 0 if zero is None else zero.numel()
    assert zero is None or (zero.dtype == torch.float32 and zero.is_contiguous()), "zero must be contiguous fp32"
    if num_pairs == 0:
        return (sorted_pairs, block_expert), []
    block_e = triton.next_power_of_2(num_experts)
    block_p = max(16, min(128, 8192 // block_e))
    kwargs = dict(NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=block_p, BLOCK_R=block_p,
                  ZERO_BLOCK=ZERO_BLOCK, num_warps=8 if block_e >= 256 else 4, **_route_constants(routing))
    args = (flat, sorted_pairs, block_expert, sorted_pairs if zero is None else zero, num_pairs, max_blocks,
            zero_numel, int(first_expert), *_route_args(routing, topk_ids, topk_weights))
    grid = (1 + triton.cdiv(zero_numel, ZERO_BLOCK),)
    return (sorted_pairs, block_expert), [(_moe_align_kernel, grid, args, kwargs)]


class Routing(NamedTuple):
    """A MoE layer's routing of its tokens, over the router's logits [T, E]: top-k (`table`: the correction bias
    [E]) or, with `input_ids` [T], hash (`table`: tid2eid [vocab, k]); `route_topk` / `route_hash`."""

    logits: torch.Tensor
    table: torch.Tensor
    top_k: int
    routed_scaling_factor: float
    input_ids: torch.Tensor | None = None

    @property
    def kind(self) -> int:
        return TOPK_ROUTE if self.input_ids is None else HASH_ROUTE

    def plan(self):
        """((ids, weights), launches) of the routing kernel."""
        if self.kind == TOPK_ROUTE:
            return plan_route_topk(self.logits, self.table, self.top_k, self.routed_scaling_factor)
        return plan_route_hash(self.logits, self.table, self.input_ids, self.routed_scaling_factor)

    def reference(self):
        """(ids, weights) of the reference routing."""
        if self.kind == TOPK_ROUTE:
            return route_topk(self.logits, self.table, self.top_k, self.routed_scaling_factor)
        return route_hash(self.logits, self.table, self.input_ids, self.routed_scaling_factor)


# Up to this many tokens the alignment's one program routes them first (a few passes of 4 to 16 tokens); beyond, the
# routing kernel's parallel launch does.
FUSED_ROUTING_MAX_TOKENS = 64


def _route_constants(routing: Routing | None) -> dict:
    if routing is None:
        return dict(ROUTE=0, ROUTED_EXPERTS=1, TOP_K=1, ROUTE_BLOCK_T=1, ROUTE_BLOCK_E=1, ROUTE_BLOCK_K=1)
    experts = routing.logits.shape[1]
    tiles = _route_tiles(routing.kind, experts, routing.top_k)
    return dict(ROUTE=routing.kind, ROUTED_EXPERTS=experts, TOP_K=routing.top_k,
                **{f"ROUTE_{name}": size for name, size in tiles.items()})


def _route_args(routing: Routing | None, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None) -> tuple:
    """The alignment kernel's routing arguments (logits, table, input ids, weights out, T, strides, scaling); unread
    without routing."""
    if routing is None:
        return topk_ids, topk_ids, topk_ids, topk_ids, 0, 0, 0, 0.0
    logits, table = routing.logits, routing.table
    assert logits.dim() == 2 and logits.stride(1) == 1 and tuple(topk_ids.shape) == (logits.shape[0], routing.top_k)
    assert topk_weights is not None and topk_weights.shape == topk_ids.shape and topk_weights.dtype == torch.float32
    input_ids = routing.input_ids.reshape(-1) if routing.input_ids is not None else topk_ids
    return (logits, table, input_ids, topk_weights, logits.shape[0], logits.stride(0),
            table.stride(0) if routing.kind == HASH_ROUTE else 0, float(routing.routed_scaling_factor))


def plan_routed_alignment(routing: Routing, num_experts: int, block_m: int, zero: torch.Tensor | None = None, *,
                          first_expert: int = 0):
    """The tokens routed and their pairs aligned: ((topk_ids, topk_weights, sorted_pairs, block_expert), launches):
    one launch up to FUSED_ROUTING_MAX_TOKENS tokens (the alignment routes them first), else the routing kernel's
    then the alignment's."""
    num_tokens = routing.logits.shape[0]
    if num_tokens > FUSED_ROUTING_MAX_TOKENS:
        (ids, weights), route = routing.plan()
        aligned, align = plan_moe_align(ids, num_experts, block_m, zero, first_expert=first_expert)
        return (ids, weights, *aligned), route + align
    device = routing.logits.device
    ids = torch.empty((num_tokens, routing.top_k), dtype=torch.int64, device=device)
    weights = torch.empty((num_tokens, routing.top_k), dtype=torch.float32, device=device)
    aligned, launches = plan_moe_align(ids, num_experts, block_m, zero, first_expert=first_expert, routing=routing,
                                       topk_weights=weights)
    return (ids, weights, *aligned), launches


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Triton version of `moe_align` (same outputs), one launch."""
    out, launches = plan_moe_align(topk_ids, num_experts, block_m)
    launch(launches)
    return out


def plan_fused_moe(x, topk_ids, topk_weights, w_gate_up, w_down, swiglu_limit, *, per_pair_output=False,
                   config=None, out_dtype=None, deepseek_order=False, quantize_hidden=False, x_quantized=None,
                   routing=None, first_expert=0):
    """Check the inputs, align the pairs, allocate buffers; return (finish, launches) without launching.

    After the launches run, finish() returns the [T, D] output in x's dtype. config overrides `moe_config`.
    deepseek_order / quantize_hidden: as in `fused_moe_reference`; quantize_hidden adds one launch ahead, x's
    act_quant to e4m3 and its scales (kernels/fp8_gemm.py), and h is kept so between the two GEMMs; x_quantized:
    that act_quant already done (e4m3 values, scales: the mHC collapse that wrote x wrote them), no launch.
    routing (a `Routing`; topk_ids and topk_weights None): the tokens are routed here too, by the alignment's launch
    at decode sizes (`plan_routed_alignment`). first_expert: the experts' ids are shifted by it (expert parallelism:
    this rank's are 0.., another rank's fall outside and are left out).
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    _check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, routing)
    top_k = routing.top_k if routing is not None else topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return (lambda: torch.zeros_like(x, dtype=out_dtype or x.dtype)), []
    weight_format = _weight_format(w_gate_up)
    cfg = {"SWAP_AB": _weights_on_the_m_side(weight_format),
           **(config or moe_config(num_pairs, num_experts, hidden, inter, weight_format=weight_format,
                                   quantize_hidden=quantize_hidden))}
    _check_tiles(cfg, weight_format, hidden, inter, deepseek_order, quantize_hidden)
    block_m, group_size_m = cfg["BLOCK_M"], cfg.get("GROUP_SIZE_M", GROUP_SIZE_M)
    out_rows = num_pairs if per_pair_output else num_tokens
    # per-pair rows of left-out pairs (another rank's experts) are never written: zeroed up front
    out = (torch.zeros if per_pair_output else torch.empty)((out_rows, hidden), dtype=torch.float32, device=x.device)
    zero = None if per_pair_output else out
    if routing is not None:
        (topk_ids, topk_weights, sorted_pairs, block_expert), align = plan_routed_alignment(
            routing, num_experts, block_m, zero, first_expert=first_expert)
    else:
        (sorted_pairs, block_expert), align = plan_moe_align(topk_ids.contiguous(), num_experts, block_m, zero,
                                                             first_expert=first_expert)
    max_blocks = block_expert.shape[0]
    (x_in, x_scale), quantize = ((x, x), []) if not quantize_hidden else (
        (x_quantized, []) if x_quantized is not None else plan_act_quant(x))
    h_dtype = torch.float8_e4m3fn if quantize_hidden else x.dtype
    h = torch.empty((max_blocks * block_m, inter), dtype=h_dtype, device=x.device)
    h_scale = torch.empty((h.shape[0], triton.cdiv(inter, FP8_ACT_BLOCK)), dtype=torch.float32, device=x.device) \
        if quantize_hidden else h  # (unread without quantize_hidden)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    dot_dtype = compute_dtype(x.dtype)
    common = dict(BLOCK_M=block_m, COMPUTE_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
                  WEIGHT_FORMAT=weight_format, GROUP_SIZE_M=group_size_m, WEIGHT_FIRST=bool(deepseek_order),
                  QUANTIZE_H=bool(quantize_hidden), OUT_DTYPE=TL_DTYPES[x.dtype], NATIVE_FP8=not is_interpreting(),
                  SWAP_AB=bool(cfg["SWAP_AB"]))
    g, d = cfg["gate_up"], cfg["down"]
    (gu_data, gu_scale, gu_rows), (d_data, d_scale, d_rows) = _kernel_weights(w_gate_up), _kernel_weights(w_down)
    gate_up_args = (x_in, x_scale, gu_data, gu_scale, h, h_scale, sorted_pairs, block_expert, weights, num_pairs,
                    max_blocks, top_k, hidden, inter, float(swiglu_limit), gu_rows, x_in.stride(0), x_scale.stride(0),
                    gu_data.stride(0), gu_data.stride(1), gu_scale.stride(0), gu_scale.stride(1), h.stride(0),
                    h_scale.stride(0))
    down_args = (h, h_scale, d_data, d_scale, weights, out, sorted_pairs, block_expert, num_pairs, max_blocks, top_k,
                 hidden, inter, d_rows, h.stride(0), h_scale.stride(0), d_data.stride(0), d_data.stride(1),
                 d_scale.stride(0), d_scale.stride(1), out.stride(0))
    launches = quantize + align + [
        (_moe_gate_up_kernel, (max_blocks * triton.cdiv(inter, g["BLOCK_N"]),), gate_up_args,
         dict(common, **_tiles(g))),
        (_moe_down_kernel, (max_blocks * triton.cdiv(hidden, d["BLOCK_N"]),), down_args,
         dict(common, PER_PAIR_OUTPUT=per_pair_output, **_tiles(d))),
    ]

    def finish():
        summed = out.view(num_tokens, top_k, hidden).sum(dim=1) if per_pair_output else out
        return summed.to(out_dtype or x.dtype)

    return finish, launches


def _tiles(gemm: dict) -> dict:
    return dict(BLOCK_N=gemm["BLOCK_N"], BLOCK_K=gemm["BLOCK_K"], num_warps=gemm["num_warps"],
                num_stages=gemm["num_stages"])


def _check_tiles(cfg: dict, weight_format: int, hidden: int, inter: int, deepseek_order: bool,
                 quantize_hidden: bool) -> None:
    block_ks = [cfg[gemm]["BLOCK_K"] for gemm in ("gate_up", "down")]
    assert weight_format != MXFP4 or (cfg["SWAP_AB"] and block_ks == [QUANTIZED_BLOCK_K] * 2), \
        f"mxfp4 experts: the weights on the MMA's M side (SWAP_AB), K steps of one {QUANTIZED_BLOCK_K}-wide chunk"
    assert weight_format != FP8 or all(QUANTIZED_BLOCK_K % block_k == 0 for block_k in block_ks), \
        f"fp8 experts: K steps within one {QUANTIZED_BLOCK_K}-wide block of their scales"
    assert not quantize_hidden or (deepseek_order and hidden % FP8_ACT_BLOCK == 0 and inter % FP8_ACT_BLOCK == 0
                                   and cfg["gate_up"]["BLOCK_N"] % FP8_ACT_BLOCK == 0
                                   and all(FP8_ACT_BLOCK % block_k == 0 for block_k in block_ks)), \
        f"quantize_hidden: DeepSeek's order, groups of {FP8_ACT_BLOCK} columns of x and h within a tile"


def _weight_format(w) -> int:
    return _FORMATS[w.format] if isinstance(w, QuantizedExperts) else DENSE


def _kernel_weights(w):
    """(data, scale, rows_per_half) as the kernels take them; a dense weight stands in for its own
    scale (the dense kernels never read it). mxfp4's scales are read four at a time, as int32."""
    if not isinstance(w, QuantizedExperts):
        return w, w, w.shape[1]
    if w.format == "mxfp4_kernel":
        return w.data, w.scale.view(torch.int32), w.rows_per_half
    return w.data, w.scale, w.rows_per_half


def _check_quantized(name: str, w: QuantizedExperts) -> None:
    num_experts, n, k = w.shape
    assert w.format != "mxfp4", f"{name}: MXFP4 experts are read in the kernels' layout: QuantizedExperts.for_kernels()"
    assert w.format in _FORMATS, f"{name}: format must be fp8 or mxfp4_kernel, got {w.format!r}"
    assert n % w.rows_per_half == 0, f"{name}: {n} rows are not whole halves of {w.rows_per_half}"
    if w.format == "fp8":
        assert w.data.dtype == torch.float8_e4m3fn and tuple(w.data.shape) == w.shape, f"{name}: fp8 data [E, N, K]"
        blocks = (n // w.rows_per_half) * triton.cdiv(w.rows_per_half, 128)
        assert tuple(w.scale.shape) == (num_experts, blocks, triton.cdiv(k, 128)) and w.scale.dtype == torch.float32, (
            f"{name}: fp8 scales must be float32 [E, {blocks}, {triton.cdiv(k, 128)}], got {tuple(w.scale.shape)}")
        assert k % 4 == 0 and aligned_words(w.data), f"{name}: fp8 rows are read as 4-byte words, K={k}"
    else:
        chunks = triton.cdiv(k, MXFP4_CHUNK)
        assert w.data.dtype == torch.int32 and tuple(w.data.shape) == (num_experts, n, 16 * chunks), \
            f"{name}: mxfp4_kernel words int32 [E, N, {16 * chunks}]"
        assert tuple(w.scale.shape) == (num_experts, n, 4 * chunks), f"{name}: mxfp4_kernel scales [E, N, {4 * chunks}]"
    assert w.data.stride(-1) == 1 and w.scale.stride(-1) == 1, f"{name}: last dimensions contiguous"


def _check_moe_inputs(x, topk_ids, topk_weights, w_gate_up, w_down, routing=None):
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w_gate_up.shape
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x dtype {x.dtype} not supported"
    assert x.stride(1) == 1, "x's last dimension must be contiguous"
    assert tuple(w_gate_up.shape) == (num_experts, two_inter, hidden) and two_inter % 2 == 0, \
        "w_gate_up must be [E, 2I, D]"
    assert tuple(w_down.shape) == (num_experts, hidden, two_inter // 2), "w_down must be [E, D, I]"
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if isinstance(w, QuantizedExperts):
            _check_quantized(name, w)
        else:
            assert w.dtype == x.dtype and w.stride(2) == 1, f"{name}: x's dtype, last dimension contiguous"
    assert _weight_format(w_gate_up) == _weight_format(w_down), "both expert weights in one format"
    if routing is not None:
        assert topk_ids is None and topk_weights is None, "routed here, or given the routes: not both"
        assert routing.logits.shape[0] == num_tokens, "the router's logits must be [T, E]"
        return
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == num_tokens, "topk_ids must be [T, k]"
    assert topk_ids.dtype == torch.int64, f"topk_ids must be int64, got {topk_ids.dtype}"
    assert topk_weights.shape == topk_ids.shape and topk_weights.is_floating_point(), "topk_weights must be [T, k]"


def fused_moe_triton(
    x: torch.Tensor,
    topk_ids: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float,
    *,
    per_pair_output: bool = False,
    config: dict | None = None,
    out_dtype: torch.dtype | None = None,
    deepseek_order: bool = False,
    quantize_hidden: bool = False,
    x_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    routing: Routing | None = None,
    first_expert: int = 0,
) -> torch.Tensor:
    """Triton version of `fused_moe_reference` (same arguments, [T, D] in x's dtype, or in out_dtype:
    torch.float32 returns the fp32 accumulator itself, saving the cast's launch).

    per_pair_output: write each (token, slot) row and sum with torch instead of fp32 atomics into [T, D]:
    deterministic, at the cost of a [T * k, D] fp32 buffer. config: tile override (see `moe_config`). x_quantized:
    with quantize_hidden, x's act_quant as its producer wrote it; routing (topk_ids and topk_weights None) and
    first_expert: `plan_fused_moe`.
    """
    finish, launches = plan_fused_moe(x, topk_ids, topk_weights, w_gate_up, w_down, swiglu_limit,
                                      per_pair_output=per_pair_output, config=config, out_dtype=out_dtype,
                                      deepseek_order=deepseek_order, quantize_hidden=quantize_hidden,
                                      x_quantized=x_quantized, routing=routing, first_expert=first_expert)
    launch(launches)
    return finish()




def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


@triton.jit(do_not_specialize=["num_tokens"])
def _swiglu_kernel(gate_up_ptr, out_ptr, num_tokens, stride_gt, stride_ot, limit,
                   INTER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, PDL: tl.constexpr = False):
    """Program (BLOCK_T tokens, BLOCK_I columns): out = silu(min(g, limit)) * clamp(u, +-limit), fp32 math."""
    wait_for_previous_kernel(PDL)
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < num_tokens)[:, None] & (cols < INTER)[None, :]
    src = gate_up_ptr + rows[:, None] * stride_gt + cols[None, :]
    h = clamped_swiglu_values(tl.load(src, mask=mask, other=0.0), tl.load(src + INTER, mask=mask, other=0.0), limit)
    tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :], h.to(out_ptr.dtype.element_ty), mask=mask)


def plan_swiglu(gate_up: torch.Tensor, limit: float):
    """Check, allocate out [T, I]; return (out, launches): one launch (none at T = 0), grid over token and column
    tiles whose sizes depend on I alone (a new batch size never recompiles)."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0, \
        f"gate_up must be [T, 2I] with a contiguous last dimension, got {tuple(gate_up.shape)}"
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out, []
    block_i = min(1024, triton.next_power_of_2(inter))
    block_t = max(1, 1024 // block_i)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(inter, block_i))
    args = (gate_up, out, num_tokens, gate_up.stride(0), out.stride(0), float(limit))
    return out, [(_swiglu_kernel, grid, args, dict(INTER=inter, BLOCK_T=block_t, BLOCK_I=block_i, num_warps=4))]


def swiglu_triton(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """Triton version of `clamped_swiglu` on a [T, 2I] gate|up product (gate first), one launch. The reference
    rounds silu(g) to the input's dtype before the product; the kernel keeps fp32 until the store."""
    out, launches = plan_swiglu(gate_up, limit)
    launch(launches)
    return out


def fused_moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    swiglu_limit: float,
    *,
    deepseek_order: bool = False,
    quantize_hidden: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The routed experts, [T, D] in x's dtype (or out_dtype), each GEMM's output rounded to x's dtype.

    transformers' order: SwiGLU in x's dtype, the routing weight after the down projection, the pairs summed in fp32
    and the sum rounded to x's dtype (then cast to out_dtype). deepseek_order (DeepSeek's Expert.forward and
    MoE.forward): SwiGLU and the routing weight in fp32, rounded once before the down projection, and the pairs'
    products summed in fp32, returned unrounded with out_dtype=torch.float32 (DeepSeek adds the shared expert to that
    sum before its one rounding). quantize_hidden: DeepSeek's act_quant (e4m3 per 128 columns) of both GEMMs' inputs,
    x and the weighted SwiGLU output, as its FP8/FP4 linears quantize their inputs (the model passes x as it is)."""
    if quantize_hidden:
        x = simulate_quantization(x, FP8_ACT_BLOCK, "e4m3")
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    num_experts = w_gate_up.shape[0]
    flat_ids = topk_ids.reshape(-1)
    flat_ids = torch.where((flat_ids >= 0) & (flat_ids < num_experts), flat_ids, num_experts)  # left out: last
    order = torch.argsort(flat_ids, stable=True)  # group (token, slot) pairs by expert
    counts = torch.bincount(flat_ids, minlength=num_experts + 1)[:num_experts].tolist()
    token_of = order // topk_ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        tokens = token_of[start : start + count]
        start += count
        gate_up = F.linear(x[tokens], w_gate_up[expert])
        weight = topk_weights.reshape(-1)[pairs, None].float()
        if deepseek_order:
            hidden = (clamped_swiglu(gate_up.float(), swiglu_limit) * weight).to(x.dtype)
            if quantize_hidden:
                hidden = simulate_quantization(hidden, FP8_ACT_BLOCK, "e4m3")
            contribution = F.linear(hidden, w_down[expert]).float()
        else:
            contribution = F.linear(clamped_swiglu(gate_up, swiglu_limit), w_down[expert]).float() * weight
        out.index_add_(0, tokens, contribution)
    if not deepseek_order:  # transformers rounds the routed sum before the shared expert is added to it
        out = out.to(x.dtype)
    return out.to(out_dtype or x.dtype)


# The names the engine's KernelDispatch looks up (`<op>_reference`).
route_topk_reference = route_topk
route_hash_reference = route_hash
swiglu_reference = clamped_swiglu
