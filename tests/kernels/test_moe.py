"""fused_moe_triton against fused_moe_reference on CPU under the interpreter, plus the alignment and routing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.moe import (REPACK_EXPERTS, QuantizedExperts, fused_moe_reference, fused_moe_triton, moe_align, route_hash,
                         route_topk)

# The reference rounds x @ W_gate_up to x's dtype before the SwiGLU; the kernel keeps it in fp32. bf16 compares
# against the reference in fp32 and includes the interpreter's truncating fp32->bf16 store of h and out.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
LIMIT = 3.0  # small enough that the clamps bite at these scales


def make_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, *, skip_experts=(), seed=0):
    """Random routing over the experts not in skip_experts (which then get zero tokens)."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in skip_experts])
    picks = torch.stack([torch.randperm(allowed.numel(), generator=gen)[:top_k] for _ in range(num_tokens)])
    topk_ids = allowed[picks].reshape(num_tokens, top_k).long()
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 2 * hidden**-0.5).to(dtype)
    w_down = (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    return x, topk_ids, topk_weights, w_gate_up, w_down


def _check(inputs, dtype, **kernel_kwargs):
    x, ids, weights, w_gate_up, w_down = inputs
    expected = fused_moe_reference(x.float(), ids, weights, w_gate_up.float(), w_down.float(), LIMIT)
    actual = fused_moe_triton(x, ids, weights, w_gate_up, w_down, LIMIT, **kernel_kwargs)
    assert actual.dtype == dtype and actual.shape == x.shape
    torch.testing.assert_close(actual.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


SMALL_TILES = dict(BLOCK_M=16, gate_up=dict(BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2),
                   down=dict(BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2))
# Quantized experts step K by 128 (one fp8 scale block, one mxfp4 chunk); narrow column tiles make several programs.
QUANTIZED_TILES = dict(BLOCK_M=16, gate_up=dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=2),
                       down=dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference(dtype):
    """Ragged sizes (hidden 40, intermediate 24: partial tiles), experts 2 and 5 with zero tokens,
    experts with more pairs than one row block."""
    inputs = make_inputs(23, 8, 3, hidden=40, inter=24, dtype=dtype, skip_experts=(2, 5), seed=1)
    _check(inputs, dtype, config=SMALL_TILES)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(num_tokens=st.integers(1, 12), num_experts=st.integers(1, 6), top_k=st.integers(1, 3),
       hidden=st.sampled_from([16, 24, 40]), inter=st.sampled_from([8, 16, 20]), seed=st.integers(0, 100))
def test_random_shapes(num_tokens, num_experts, top_k, hidden, inter, seed):
    top_k = min(top_k, num_experts)
    inputs = make_inputs(num_tokens, num_experts, top_k, hidden, inter, torch.float32, seed=seed)
    _check(inputs, torch.float32, config=SMALL_TILES)


def test_per_pair_output_and_default_tiles():
    inputs = make_inputs(5, 6, 2, hidden=64, inter=32, dtype=torch.float32, skip_experts=(0,), seed=2)
    _check(inputs, torch.float32, per_pair_output=True)
    _check(inputs, torch.float32)


def test_every_pair_on_one_expert():
    inputs = make_inputs(20, 4, 1, hidden=32, inter=16, dtype=torch.float32, skip_experts=(0, 1, 3), seed=3)
    _check(inputs, torch.float32, config=SMALL_TILES)


def test_no_tokens():
    x, ids, weights, w_gate_up, w_down = make_inputs(2, 4, 2, hidden=32, inter=16, dtype=torch.float32)
    out = fused_moe_triton(x[:0], ids[:0], weights[:0], w_gate_up, w_down, LIMIT)
    assert out.shape == (0, 32)


@pytest.mark.parametrize("block_m", [4, 16])
def test_align_groups_pairs_by_expert(block_m):
    gen = torch.Generator().manual_seed(4)
    num_experts, topk_ids = 9, torch.randint(0, 7, (13, 3), generator=gen)  # experts 7 and 8 unused
    sorted_pairs, block_expert = moe_align(topk_ids, num_experts, block_m)
    flat, num_pairs = topk_ids.reshape(-1), topk_ids.numel()
    rows = sorted_pairs.view(-1, block_m)
    assert sorted(p for p in sorted_pairs.tolist() if p < num_pairs) == list(range(num_pairs))
    for block, expert in enumerate(block_expert.tolist()):
        pairs = rows[block][rows[block] < num_pairs]
        if expert < 0:
            assert pairs.numel() == 0
        else:
            assert pairs.numel() > 0 and (flat[pairs.long()] == expert).all()
    used = block_expert[block_expert >= 0]
    assert (used[1:] >= used[:-1]).all() and not ((used == 7) | (used == 8)).any()


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [(13, 3, 9, 4), (1, 6, 16, 16), (150, 6, 16, 16),
                                                                  (40, 2, 300, 16), (7, 3, 3, 64)])
def test_align_kernel_equals_the_reference(num_tokens, top_k, num_experts, block_m):
    """The one-launch alignment writes exactly the reference's rows (several pair chunks at 900 pairs, a
    non-power-of-two expert count above 256, unused experts) and zeroes the accumulator it is given."""
    from kernels.moe import plan_moe_align

    gen = torch.Generator().manual_seed(num_tokens * num_experts)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    topk_ids[topk_ids == 1] = 0 if num_experts > top_k else 1  # skew: expert 0 crowded, expert 1 mostly empty
    expected = moe_align(topk_ids, num_experts, block_m)
    accumulator = torch.full((num_tokens, 1500), 7.0)
    (sorted_pairs, block_expert), launches = plan_moe_align(topk_ids, num_experts, block_m, zero=accumulator)
    assert len(launches) == 1
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)
    assert torch.equal(sorted_pairs, expected[0]) and torch.equal(block_expert, expected[1])
    assert not accumulator.any()


def test_align_bound_is_tight():
    """Every expert with block_m + 1 pairs needs exactly the 2 * E blocks the shape-only bound allows."""
    num_experts, block_m = 5, 4
    order = torch.randperm(25, generator=torch.Generator().manual_seed(7))
    topk_ids = torch.arange(num_experts).repeat_interleave(block_m + 1)[order].view(25, 1)
    sorted_pairs, block_expert = moe_align(topk_ids, num_experts, block_m)
    assert block_expert.tolist() == [e for e in range(num_experts) for _ in range(2)]
    assert (sorted_pairs < 25).sum() == 25


def test_route_topk_matches_the_model_definition():
    gen = torch.Generator().manual_seed(5)
    logits, bias = torch.randn(6, 16, generator=gen), torch.randn(16, generator=gen) * 0.1
    ids, weights = route_topk(logits, bias, 4, 1.5)
    scores = F.softplus(logits).sqrt()
    expected_ids = torch.topk(scores + bias, 4, dim=-1).indices
    assert torch.equal(ids.sort(dim=-1).values, expected_ids.sort(dim=-1).values)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    torch.testing.assert_close(weights, scores.gather(1, ids) / scores.gather(1, ids).sum(-1, keepdim=True) * 1.5)


def test_route_hash_takes_experts_from_the_table():
    gen = torch.Generator().manual_seed(6)
    tid2eid = torch.stack([torch.randperm(16, generator=gen)[:3] for _ in range(50)])
    input_ids = torch.randint(0, 50, (7,), generator=gen)
    logits = torch.randn(7, 16, generator=gen)
    ids, weights = route_hash(logits, tid2eid, input_ids, 2.0)
    assert torch.equal(ids, tid2eid[input_ids])
    torch.testing.assert_close(weights.sum(-1), torch.full((7,), 2.0))


# --- experts as published: FP8 with 128x128 block scales per half, MXFP4 with e8m0 per 32 ----------------------


def fp8_experts(w: torch.Tensor, halves: int):
    """Quantize [E, N, K] as DeepSeek stores it (each half — w1, w3 — with its own block grid)."""
    from backend.model.quantization import dequantize_fp8, quantize_fp8

    num_experts, n, k = w.shape
    rows = n // halves
    data, scales, dequantized = [], [], []
    for e in range(num_experts):
        parts = [quantize_fp8(w[e, h * rows:(h + 1) * rows]) for h in range(halves)]
        data.append(torch.cat([q for q, _ in parts]))
        scales.append(torch.cat([s.float() for _, s in parts]))
        dequantized.append(torch.cat([dequantize_fp8(q, s) for q, s in parts]))
    return QuantizedExperts("fp8", torch.stack(data), torch.stack(scales), (num_experts, n, k), rows), \
        torch.stack(dequantized)


def mxfp4_experts(w: torch.Tensor):
    from backend.model.quantization import dequantize_mxfp4, quantize_mxfp4

    parts = [quantize_mxfp4(w[e]) for e in range(w.shape[0])]
    experts = QuantizedExperts("mxfp4", torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts]),
                               tuple(w.shape), w.shape[1])
    return experts, torch.stack([dequantize_mxfp4(q, s) for q, s in parts])


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("hidden, inter", [(96, 64), (160, 96)])  # partial 128-blocks; K multiples of 32 (MXFP4)
def test_quantized_experts_are_dequantized_in_the_kernel(fmt, hidden, inter):
    x, ids, weights, w_gate_up, w_down = make_inputs(19, 5, 2, hidden, inter, torch.float32, skip_experts=(3,),
                                                     seed=hidden)
    (q_gate_up, deq_gate_up), (q_down, deq_down) = quantized_experts(fmt, w_gate_up, 2), quantized_experts(fmt, w_down, 1)
    assert torch.equal(q_gate_up.dequantize(), deq_gate_up) and torch.equal(q_down.dequantize(), deq_down)
    expected = fused_moe_reference(x, ids, weights, deq_gate_up, deq_down, LIMIT)
    actual = fused_moe_triton(x, ids, weights, q_gate_up.for_kernels(), q_down.for_kernels(), LIMIT,
                              config=QUANTIZED_TILES)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def quantized_experts(fmt: str, w: torch.Tensor, halves: int):
    return fp8_experts(w, halves) if fmt == "fp8" else mxfp4_experts(w)


def test_quantized_experts_with_the_wrong_scales_are_refused():
    x, ids, weights, w_gate_up, w_down = make_inputs(4, 2, 1, 64, 32, torch.float32)
    q_gate_up, _ = fp8_experts(w_gate_up, 2)
    q_down, _ = fp8_experts(w_down, 1)
    bad = q_gate_up._replace(scale=q_gate_up.scale[:, :1])
    with pytest.raises(AssertionError, match="fp8 scales must be float32"):
        fused_moe_triton(x, ids, weights, bad, q_down, LIMIT)
    published = mxfp4_experts(w_down)[0]
    with pytest.raises(AssertionError, match="for_kernels"):
        fused_moe_triton(x, ids, weights, q_gate_up, published, LIMIT)
    with pytest.raises(AssertionError, match="one format"):
        fused_moe_triton(x, ids, weights, q_gate_up, published.for_kernels(), LIMIT)


def test_the_kernels_mxfp4_layout_holds_the_published_codes_and_scales():
    """repack_mxfp4 then unpack_mxfp4 gives the published bytes back (K padded to 128 and cut again), so the
    repacked experts dequantize to the same weights; scales the bf16 multiplier cannot hold are refused."""
    from kernels.quant_formats import repack_mxfp4, unpack_mxfp4

    gen = torch.Generator().manual_seed(9)
    codes = torch.randint(0, 256, (3, 5, 80), generator=gen, dtype=torch.uint8)  # K = 160: a partial chunk
    scales = torch.randint(0, 129, (3, 5, 5), generator=gen, dtype=torch.uint8)
    words, padded = repack_mxfp4(codes, scales)
    assert words.dtype == torch.int32 and words.shape == (3, 5, 32) and padded.shape == (3, 5, 8)
    assert all(torch.equal(a, b) for a, b in zip(unpack_mxfp4(words, padded, 160), (codes, scales)))
    experts = QuantizedExperts("mxfp4", codes.view(torch.int8), scales, (3, 5, 160), 5)
    assert torch.equal(experts.for_kernels().dequantize(), experts.dequantize())
    many = 2 * REPACK_EXPERTS + 3  # (several passes, the last a partial one)
    codes, scales = codes.repeat(many, 1, 1)[:many], scales.repeat(many, 1, 1)[:many]
    experts = QuantizedExperts("mxfp4", codes.view(torch.int8), scales, (many, 5, 160), 5)
    repacked, whole = experts.for_kernels(), repack_mxfp4(codes, scales)
    assert torch.equal(repacked.data, whole[0]) and torch.equal(repacked.scale, whole[1])
    with pytest.raises(ValueError, match="codes above 128"):
        repack_mxfp4(codes, scales + 1)


# --- routing and the shared expert's activation as kernels --------------------------------------------------------


@pytest.mark.parametrize("num_tokens,num_experts,k", [(1, 16, 4), (19, 16, 6), (37, 24, 3), (5, 7, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_topk_kernel_matches_the_reference(num_tokens, num_experts, k, dtype):
    """Irregular token and expert counts (partial blocks, a non-power-of-two E, k = E); the kernel's ids come in
    descending score order, so sets are compared, and the weights slot by slot after ordering both alike."""
    from kernels.moe import route_topk_triton

    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    logits = (torch.randn(num_tokens, num_experts, generator=gen) * 3).to(dtype)
    logits[0, 0] = 25.0  # softplus' linear branch
    bias = torch.randn(num_experts, generator=gen) * 0.1
    ids_ref, w_ref = route_topk(logits, bias, k, 1.5)
    ids, weights = route_topk_triton(logits, bias, k, 1.5)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (num_tokens, k)
    order_ref, order = ids_ref.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(ids_ref.gather(1, order_ref), ids.gather(1, order))
    torch.testing.assert_close(weights.gather(1, order), w_ref.gather(1, order_ref), rtol=1e-6, atol=1e-6)


def test_route_topk_kernel_breaks_ties_to_the_lowest_expert():
    from kernels.moe import route_topk_triton

    logits = torch.zeros(3, 8)  # every score equal
    ids, weights = route_topk_triton(logits, torch.zeros(8), 3, 1.0)
    assert ids.tolist() == [[0, 1, 2]] * 3
    torch.testing.assert_close(weights, torch.full((3, 3), 1 / 3))


@pytest.mark.parametrize("num_tokens", [1, 17])
def test_route_hash_kernel_matches_the_reference(num_tokens):
    from kernels.moe import route_hash_triton

    gen = torch.Generator().manual_seed(num_tokens)
    tid2eid = torch.stack([torch.randperm(12, generator=gen)[:5] for _ in range(40)]).int()
    input_ids = torch.randint(0, 40, (num_tokens,), generator=gen)
    logits = torch.randn(num_tokens, 12, generator=gen)
    ids_ref, w_ref = route_hash(logits, tid2eid, input_ids, 2.0)
    ids, weights = route_hash_triton(logits, tid2eid, input_ids, 2.0)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(weights, w_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_tokens,inter", [(1, 24), (13, 40), (3, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_kernel_matches_the_reference(num_tokens, inter, dtype):
    """Column views of a wider product, partial tiles, several column programs (1500 > 1024); bf16 against the
    fp32 reference within one bf16 rounding."""
    from kernels.moe import clamped_swiglu, swiglu_triton

    gen = torch.Generator().manual_seed(inter)
    wide = (torch.randn(num_tokens, 2 * inter + 6, generator=gen) * 3).to(dtype)
    gate_up = wide[:, : 2 * inter]  # a column view: row stride 2I + 6
    expected = clamped_swiglu(gate_up.float(), LIMIT)
    actual = swiglu_triton(gate_up, LIMIT)
    assert actual.dtype == dtype and actual.shape == (num_tokens, inter)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual.float(), expected, rtol=tol, atol=tol)
    assert swiglu_triton(gate_up[:0], LIMIT).shape == (0, inter)


@pytest.mark.parametrize("per_pair_output", [False, True])
def test_pairs_of_other_ranks_experts_are_left_out(per_pair_output):
    """Expert parallelism: ids shifted by the rank's first expert fall outside [0, E) for other ranks' experts;
    kernel and reference then equal the MoE with those pairs' weights zeroed."""
    from kernels.moe import plan_moe_align

    x, ids, weights, w_gate_up, w_down = make_inputs(19, 8, 3, hidden=40, inter=24, dtype=torch.float32, seed=3)
    local = ids - 3  # this rank holds experts 3..6 of 8 (4 experts): others are < 0 or >= 4
    mine = (local >= 0) & (local < 4)
    assert mine.any() and not mine.all()
    expected = fused_moe_reference(x, ids, weights * mine, w_gate_up, w_down, LIMIT)
    local_up, local_down = w_gate_up[3:7], w_down[3:7]
    torch.testing.assert_close(fused_moe_reference(x, local, weights, local_up, local_down, LIMIT), expected)
    actual = fused_moe_triton(x, local, weights, local_up, local_down, LIMIT, per_pair_output=per_pair_output,
                              config=SMALL_TILES)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    (sorted_pairs, block_expert), launches = plan_moe_align(local, 4, 16)
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)
    reference = moe_align(local, 4, 16)
    assert torch.equal(sorted_pairs, reference[0]) and torch.equal(block_expert, reference[1])
    assert sorted((p for p in sorted_pairs.tolist() if p < local.numel())) == mine.reshape(-1).nonzero().view(-1).tolist()


# --- DeepSeek's order: the routing weight before the down projection, whose input is act_quant'ed ---------------
def assert_close_but_for_straddles(actual, expected, atol, rtol, max_rows=1):
    """Every token's row close, but for at most max_rows: where the kernel's and the reference's h (the same math in
    another fp32 order) fall on either side of an e4m3 rounding boundary of DeepSeek's act_quant, a whole row moves
    by a step of that value (seen: 31.0 at 2^-6 rounding to 30 on one side, 32 on the other). Returns the rows'
    mask of those that are close."""
    close = torch.isclose(actual, expected, atol=atol, rtol=rtol).all(dim=-1)
    assert (~close).sum() <= max_rows, f"{int((~close).sum())} rows differ, at most {max_rows} may straddle"
    return close



def test_deepseek_order_is_the_same_sum_as_transformers_order():
    """Without the quantization the two orders compute one sum (a routing weight is a scalar per pair)."""
    x, ids, weights, w_gate_up, w_down = make_inputs(23, 8, 3, hidden=40, inter=24, dtype=torch.float32, seed=2)
    plain = fused_moe_reference(x, ids, weights, w_gate_up, w_down, LIMIT)
    torch.testing.assert_close(fused_moe_reference(x, ids, weights, w_gate_up, w_down, LIMIT, deepseek_order=True),
                               plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_moe_triton(x, ids, weights, w_gate_up, w_down, LIMIT, deepseek_order=True,
                                                config=SMALL_TILES), plain, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["dense", "fp8", "mxfp4"])
def test_the_down_projections_input_is_quantized_in_the_gate_up_tile(fmt):
    """The kernel act_quants each pair's weighted SwiGLU output in groups of 128 (inside its 128-column tile), as
    the reference does with simulate_quantization; the quantization is really on (far from the plain order). FP8
    experts multiply e4m3 by e4m3 there, both inputs act_quant'ed (x by the launch ahead)."""
    x, ids, weights, w_gate_up, w_down = make_inputs(37, 6, 2, hidden=128, inter=256, dtype=torch.float32, seed=5)
    tiles = dict(BLOCK_M=16, gate_up=dict(BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=2),
                 down=dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2))
    if fmt != "dense":
        (w_gate_up, _), (w_down, _) = quantized_experts(fmt, w_gate_up, 2), quantized_experts(fmt, w_down, 1)
        w_gate_up, w_down = w_gate_up.for_kernels(), w_down.for_kernels()
        tiles = dict(tiles, gate_up=dict(tiles["gate_up"], BLOCK_K=128), down=dict(tiles["down"], BLOCK_K=128))
    dense = [w.dequantize() if isinstance(w, QuantizedExperts) else w for w in (w_gate_up, w_down)]
    expected = fused_moe_reference(x, ids, weights, *dense, LIMIT, deepseek_order=True, quantize_hidden=True)
    plain = fused_moe_reference(x, ids, weights, *dense, LIMIT, deepseek_order=True)
    actual = fused_moe_triton(x, ids, weights, w_gate_up, w_down, LIMIT, deepseek_order=True, quantize_hidden=True,
                              config=tiles)
    close = assert_close_but_for_straddles(actual, expected, atol=1e-4, rtol=1e-4)
    assert (expected - plain)[close].abs().max() > 100 * (actual - expected)[close].abs().max()
    # x act_quant'ed by its producer (the mHC collapse): no launch ahead, the same output
    from kernels.fp8_gemm import quantize_activations_reference
    from kernels.moe import plan_fused_moe

    given = quantize_activations_reference(x)
    kwargs = dict(deepseek_order=True, quantize_hidden=True, config=tiles)
    assert len(plan_fused_moe(x, ids, weights, w_gate_up, w_down, LIMIT, **kwargs, x_quantized=given)[1]) == \
        len(plan_fused_moe(x, ids, weights, w_gate_up, w_down, LIMIT, **kwargs)[1]) - 1
    torch.testing.assert_close(fused_moe_triton(x, ids, weights, w_gate_up, w_down, LIMIT, **kwargs, x_quantized=given),
                               actual, atol=1e-6, rtol=1e-6)  # (the pairs' fp32 atomics add in any order on a GPU)
    with pytest.raises(AssertionError, match="groups of 128"):  # a gate/up tile narrower than a group
        fused_moe_triton(x, ids, weights, w_gate_up, w_down, LIMIT, deepseek_order=True, quantize_hidden=True,
                         config=dict(tiles, gate_up=dict(tiles["gate_up"], BLOCK_N=32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numerics", ["transformers", "deepseek_order", "deepseek"])
@pytest.mark.parametrize("fmt", ["dense", "fp8", "mxfp4"])
def test_every_variant_equals_its_reference(fmt, numerics, dtype):
    """Each format (bf16, fp8 with 128 x 128 block scales, mxfp4 in the kernels' layout) in each expert order, with
    and without DeepSeek's act_quant of the GEMMs' inputs (numerics "deepseek"), at the default tiles, against the
    reference on the dequantized weights; DeepSeek's order returns its fp32 sum, as the model asks."""
    x, ids, weights, w_gate_up, w_down = make_inputs(9, 4, 2, hidden=128, inter=128, dtype=torch.float32, seed=11)
    if fmt != "dense":
        (w_gate_up, _), (w_down, _) = quantized_experts(fmt, w_gate_up, 2), quantized_experts(fmt, w_down, 1)
        w_gate_up, w_down = w_gate_up.for_kernels(), w_down.for_kernels()
    dense = [(w.dequantize() if isinstance(w, QuantizedExperts) else w).to(dtype) for w in (w_gate_up, w_down)]
    w_gate_up, w_down = (w if isinstance(w, QuantizedExperts) else w.to(dtype) for w in (w_gate_up, w_down))
    order = dict(deepseek_order=numerics != "transformers", quantize_hidden=numerics == "deepseek")
    out_dtype = torch.float32 if order["deepseek_order"] else dtype
    x = x.to(dtype)
    expected = fused_moe_reference(x, ids, weights, *dense, LIMIT, out_dtype=out_dtype, **order)
    actual = fused_moe_triton(x, ids, weights, w_gate_up, w_down, LIMIT, out_dtype=out_dtype, **order)
    assert actual.dtype == out_dtype
    tolerance = 1e-4 if dtype == torch.float32 else TOLERANCE[dtype]
    assert_close_but_for_straddles(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


def deepseek_moe_forward(x, topk_ids, topk_weights, w_gate_up, w_down, shared, limit, *, round_swiglu=False,
                         round_routed=False):
    """DeepSeek's MoE.forward and Expert.forward (its inference/model.py) written out token by token, for weights in
    x's dtype: gate = w1(x).float() and up = w3(x).float() (its linears return x's dtype), the clamps, silu(gate) * up
    times the routing weight in fp32, w2 of that rounded to x's dtype; the experts' outputs, then the shared
    expert's, added to an fp32 y rounded once at the end. round_swiglu / round_routed make the roundings DeepSeek
    does not (silu(gate) * up in x's dtype; the routed sum rounded before the shared expert joins it)."""
    inter = w_gate_up.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for slot, expert in enumerate(topk_ids[t].tolist()):
            gate = F.linear(x[t:t + 1], w_gate_up[expert, :inter]).float().clamp(max=limit)
            up = F.linear(x[t:t + 1], w_gate_up[expert, inter:]).float().clamp(min=-limit, max=limit)
            swiglu = F.silu(gate) * up
            if round_swiglu:
                swiglu = swiglu.to(x.dtype).float()
            y[t] += F.linear((topk_weights[t, slot] * swiglu).to(x.dtype), w_down[expert])[0].float()
    if round_routed:
        y = y.to(x.dtype).float()
    return (y + shared.float()).to(x.dtype)


def test_deepseek_order_rounds_where_deepseeks_moe_rounds():
    """In bf16 the reference's DeepSeek order, plus the shared expert in fp32 (the model's mix), is DeepSeek's MoE
    bit for bit; rounding silu(gate) * up early, or the routed sum before the shared expert, is not."""
    x, ids, weights, w_gate_up, w_down = make_inputs(12, 6, 3, hidden=64, inter=48, dtype=torch.bfloat16, seed=8)
    shared = (torch.randn(12, 64, generator=torch.Generator().manual_seed(8)) * 0.5).to(torch.bfloat16)
    routed = fused_moe_reference(x, ids, weights, w_gate_up, w_down, LIMIT, deepseek_order=True,
                                 out_dtype=torch.float32)
    mixed = (routed + shared.float()).to(torch.bfloat16)
    assert torch.equal(mixed, deepseek_moe_forward(x, ids, weights, w_gate_up, w_down, shared, LIMIT))
    for early in (dict(round_swiglu=True), dict(round_routed=True)):
        assert not torch.equal(mixed, deepseek_moe_forward(x, ids, weights, w_gate_up, w_down, shared, LIMIT, **early))


@pytest.mark.parametrize("swap_ab", [True, False])
@pytest.mark.parametrize("deepseek", [False, True])
def test_fp8_experts_in_either_orientation(swap_ab, deepseek):
    """moe_config puts fp8 weights on the MMA's M side; a config (a tuned table's) may put the tokens there instead,
    for e4m3 x e4m3 products and for bf16 ones, and each computes the reference's sums."""
    x, ids, weights, w_gate_up, w_down = make_inputs(9, 4, 2, hidden=128, inter=128, dtype=torch.float32, seed=12)
    (q_gate_up, deq_gate_up), (q_down, deq_down) = fp8_experts(w_gate_up, 2), fp8_experts(w_down, 1)
    order = dict(deepseek_order=deepseek, quantize_hidden=deepseek)
    tiles = dict(BLOCK_M=16, SWAP_AB=swap_ab, gate_up=dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=2),
                 down=dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=2))
    expected = fused_moe_reference(x, ids, weights, deq_gate_up, deq_down, LIMIT, **order)
    actual = fused_moe_triton(x, ids, weights, q_gate_up, q_down, LIMIT, config=tiles, **order)
    assert_close_but_for_straddles(actual, expected, atol=1e-4, rtol=1e-4)


def _run(launches):
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)


@pytest.mark.parametrize("kind", ["topk", "hash"])
@pytest.mark.parametrize("num_tokens,first_expert", [(1, 0), (37, 0), (37, 5), (70, 5)])
def test_the_alignment_routes_the_tokens_itself(kind, num_tokens, first_expert):
    """plan_routed_alignment: up to FUSED_ROUTING_MAX_TOKENS tokens the alignment's one launch routes them first (its
    program 0 runs the routing kernel's code), beyond that the routing kernel's launch does; either way the ids,
    weights, sorted pairs and block experts are the routing kernel's then the alignment's, bit for bit, with the ids
    shifted by first_expert (expert parallelism: another rank's experts, here 5 of 16, are left out)."""
    from kernels.moe import FUSED_ROUTING_MAX_TOKENS, Routing, plan_moe_align, plan_routed_alignment

    gen = torch.Generator().manual_seed(num_tokens + first_expert)
    logits = torch.randn(num_tokens, 16, generator=gen) * 3
    if kind == "topk":
        routing = Routing(logits, torch.randn(16, generator=gen) * 0.1, 6, 2.5)
    else:
        tid2eid = torch.stack([torch.randperm(16, generator=gen)[:6] for _ in range(40)]).int()
        routing = Routing(logits, tid2eid, 6, 2.5, torch.randint(0, 40, (num_tokens,), generator=gen))
    (ids, weights), route = routing.plan()
    _run(route)
    (sorted_pairs, block_expert), align = plan_moe_align(ids, 11, 16, first_expert=first_expert)
    _run(align)
    fused, launches = plan_routed_alignment(routing, 11, 16, first_expert=first_expert)
    assert len(launches) == (1 if num_tokens <= FUSED_ROUTING_MAX_TOKENS else 2)
    _run(launches)
    for got, expected in zip(fused, (ids, weights, sorted_pairs, block_expert)):
        assert torch.equal(got, expected)
    expected_pairs, expected_blocks = moe_align(ids - first_expert, 11, 16)
    assert torch.equal(sorted_pairs, expected_pairs) and torch.equal(block_expert, expected_blocks)
    if first_expert:
        assert (sorted_pairs < num_tokens * 6).sum() < num_tokens * 6  # some pairs were another rank's


def test_the_experts_route_their_tokens():
    """fused_moe_triton with a Routing (one launch fewer at decode sizes) equals it with the routing kernel's ids."""
    from kernels.moe import Routing, route_topk_triton

    x, _, _, w_gate_up, w_down = make_inputs(9, 8, 3, hidden=64, inter=32, dtype=torch.float32, seed=3)
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(4))
    bias = torch.zeros(8)
    ids, weights = route_topk_triton(logits, bias, 3, 1.5)
    for first_expert in (0, 2):
        expected = fused_moe_triton(x, ids - first_expert, weights, w_gate_up[:6], w_down[:6], LIMIT,
                                    per_pair_output=True)
        routed = fused_moe_triton(x, None, None, w_gate_up[:6], w_down[:6], LIMIT, per_pair_output=True,
                                  routing=Routing(logits, bias, 3, 1.5), first_expert=first_expert)
        assert torch.equal(routed, expected)
