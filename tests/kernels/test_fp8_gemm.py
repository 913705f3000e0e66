"""kernels/fp8_gemm.py under Triton's interpreter: irregular sizes, partial scale blocks, both scale dtypes."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemm import fp8_gemm_reference, fp8_gemm_triton, quantize_activations_reference


def _weight(n: int, k: int, seed: int, scale_dtype=torch.float8_e8m0fnu):
    g = torch.Generator().manual_seed(seed)
    w_q = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    exps = torch.randint(118, 124, (-(-n // 128), -(-k // 128)), generator=g, dtype=torch.uint8)
    scale = exps.view(torch.float8_e8m0fnu)
    return w_q, (scale if scale_dtype == torch.float8_e8m0fnu else scale.to(torch.float32))


# Under the interpreter the FP8 products are exact and summed in fp32. On Hopper, tiles of more than 16 rows take the
# wgmma path, whose FP8 accumulator keeps fewer mantissa bits within each 128-wide K block (the block's partial is then
# added to the fp32 accumulator, as DeepSeek's own FP8 GEMMs do): a few 1e-4 of the output's scale (2.2e-4 seen on an
# H200, 2026-12-04).
ACCUMULATOR_ERROR = 2e-3 if torch.get_default_device().type == "cuda" else 1e-5


def test_activation_quantization_is_per_token_and_per_128_group_with_power_of_two_scales():
    x = torch.zeros(2, 200)
    x[0, :128], x[0, 128:] = 1.0, 100.0
    x[1, 5] = -3000.0
    x_q, scale = quantize_activations_reference(x)
    assert scale.shape == (2, 2)
    assert scale[0].tolist() == [2.0 ** -8, 2.0 ** -2]  # 1/448 -> 2^-8; 100/448 -> 2^-2
    assert scale[1, 0].item() == 8.0 and scale[1, 1].item() == 2.0 ** -22  # 3000/448 -> 2^3; empty group: 1e-4
    assert x_q.float().abs().max() <= 448


@pytest.mark.parametrize("tokens, n, k", [(1, 128, 128), (5, 200, 300), (33, 64, 96), (17, 130, 257)])
@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32])
def test_kernel_matches_the_reference_at_irregular_sizes(tokens, n, k, scale_dtype):
    w_q, w_scale = _weight(n, k, tokens + n + k, scale_dtype)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(k)) * 3
    expected = fp8_gemm_reference(x, w_q, w_scale)
    got = fp8_gemm_triton(x, w_q, w_scale)
    assert got.shape == (tokens, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=ACCUMULATOR_ERROR * expected.abs().max().item())


def test_the_fp8_gemm_is_close_to_the_unquantized_product():
    """What FP8 costs: the activations' e4m3 rounding (3 mantissa bits), per 128-wide group."""
    w_q, w_scale = _weight(96, 256, 3)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(4))
    exact = x @ fp8_gemm_reference(torch.eye(256), w_q, w_scale)  # W^T dequantized (eye is exact), x not quantized
    got = fp8_gemm_triton(x, w_q, w_scale)
    assert (got - exact).norm() / exact.norm() < 0.05


def test_bad_inputs_are_refused_before_launch():
    w_q, w_scale = _weight(64, 128, 0)
    with pytest.raises(AssertionError, match="x has 100 columns"):
        fp8_gemm_triton(torch.randn(2, 100), w_q, w_scale)
    with pytest.raises(AssertionError, match="w_scale must be"):
        fp8_gemm_triton(torch.randn(2, 128), w_q, w_scale[:, :0])
    with pytest.raises(AssertionError, match="float8_e4m3fn"):
        fp8_gemm_triton(torch.randn(2, 128), w_q.float(), w_scale)


@pytest.mark.parametrize("swap_ab", [True, False])
@pytest.mark.parametrize("prequantized", [True, False])
@pytest.mark.parametrize("split_k", [1, 3])
def test_every_variant_matches_the_reference(swap_ab, prequantized, split_k):
    """Each variant fp8_gemm_config can pick, forced by config at irregular sizes: the product transposed (the weight's
    columns on the MMA's M side) or not, x act_quant'ed ahead or in registers, K split over programs (5 steps in 3
    splits: one split of one step) whose last adds the partial sums."""
    from kernels.fp8_gemm import plan_fp8_gemm

    w_q, w_scale = _weight(150, 600, 5)
    x = torch.randn(19, 600, generator=torch.Generator().manual_seed(6)) * 3
    config = dict(BLOCK_M=32 if swap_ab else 16, BLOCK_N=64, SPLIT_K=split_k, SWAP_AB=swap_ab, PREQUANTIZED=prequantized,
                  num_warps=4, num_stages=2)
    got, launches = plan_fp8_gemm(x, w_q, w_scale, config=config)
    assert len(launches) == 1 + prequantized
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)
    expected = fp8_gemm_reference(x, w_q, w_scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=ACCUMULATOR_ERROR * expected.abs().max().item())
    from kernels.common import split_counters
    assert not split_counters(x.device).any(), "a split launch leaves its counters at zero"


def test_the_plan_picks_the_variant_by_shape():
    """V4-Flash's linears: up to 64 tokens the product is transposed, the narrow ones (wkv's 512 and wq_a's 1024
    columns) split K at decode, and from 17 tokens x is quantized once ahead."""
    from kernels.fp8_gemm import fp8_gemm_config

    wkv, wq_b = fp8_gemm_config(1, 512, 4096), fp8_gemm_config(1, 32768, 1024)
    assert wkv["SWAP_AB"] and wkv["SPLIT_K"] == 16 and not wkv["PREQUANTIZED"]  # 4 tiles x 16 = 64 programs
    assert wq_b["SWAP_AB"] and wq_b["SPLIT_K"] == 1 and wq_b["BLOCK_M"] == 16
    assert fp8_gemm_config(64, 1024, 4096)["SPLIT_K"] == 16 and fp8_gemm_config(64, 1024, 4096)["PREQUANTIZED"]
    prefill = fp8_gemm_config(4096, 32768, 1024)
    assert not prefill["SWAP_AB"] and prefill["SPLIT_K"] == 1 and prefill["BLOCK_M"] == 128


def test_act_quant_kernel_is_the_reference():
    """plan_act_quant (one launch: x act_quant'ed for the GEMMs that read it more than once) equals
    quantize_activations_reference, at a K with a partial last group."""
    from kernels.fp8_gemm import plan_act_quant

    x = torch.randn(11, 300, generator=torch.Generator().manual_seed(7)) * torch.logspace(-2, 2, 11)[:, None]
    (x_q, x_s), launches = plan_act_quant(x)
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)
    expected_q, expected_s = quantize_activations_reference(x)
    assert torch.equal(x_q.float(), expected_q.float()) and torch.equal(x_s, expected_s)


@pytest.mark.parametrize("prequantized", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_swiglu_fed_gemm_equals_the_swiglu_kernel_then_the_gemm(prequantized, dtype):
    """The shared expert's down projection (swiglu_limit): the GEMM computing the SwiGLU of a gate|up product as it
    loads (quantizes) its input, in registers or in the act_quant launch ahead, gives the swiglu kernel's output fed
    to the GEMM bit for bit, and the reference; values past the clamp limit included."""
    from kernels.fp8_gemm import plan_fp8_gemm
    from kernels.moe import swiglu_triton

    w_q, w_scale = _weight(150, 300, 8)
    gate_up = (torch.randn(19, 600, generator=torch.Generator().manual_seed(9)) * 6).to(dtype)
    config = dict(BLOCK_M=32, BLOCK_N=64, SPLIT_K=2, SWAP_AB=True, PREQUANTIZED=prequantized, num_warps=4,
                  num_stages=2)
    got, launches = plan_fp8_gemm(gate_up, w_q, w_scale, config=config, swiglu_limit=7.0)
    assert len(launches) == 1 + prequantized
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)
    assert torch.equal(got, fp8_gemm_triton(swiglu_triton(gate_up, 7.0), w_q, w_scale, config=config))
    if dtype == torch.float32:  # (in bf16 the reference's sigmoid, an ulp off the kernel's here and there, moves an
        # e4m3 rounding of the GEMM's input by a step: 8 output ulps)
        expected = fp8_gemm_reference(gate_up, w_q, w_scale, swiglu_limit=7.0)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=ACCUMULATOR_ERROR * expected.abs().max().item())
        unclamped = fp8_gemm_reference(gate_up, w_q, w_scale, swiglu_limit=1e9)
        assert (unclamped - expected).abs().max() > 1.0  # the limit bites: the check above can fail


def test_a_swiglu_fed_gemm_takes_twice_the_weights_k():
    w_q, w_scale = _weight(64, 128, 0)
    with pytest.raises(AssertionError, match="needs 256 \\(gate\\|up\\)"):
        fp8_gemm_triton(torch.randn(2, 128), w_q, w_scale, swiglu_limit=7.0)


@pytest.mark.parametrize("prequantized", [False, True])
@pytest.mark.parametrize("k", [128, 1024])
def test_an_rms_norm_fed_gemm_equals_the_norm_kernel_then_the_gemm(prequantized, k):
    """q_b's input (rms_norm): the GEMM computing x's weighted RMSNorm as it loads (quantizes) x, from a column view of
    a wider product as the model has it, equals the norm_rope kernel's output fed to the GEMM: bit for bit where a row
    is one 128-column chunk, and where the kernels add a row's squares in another order (the GEMM by 128-column
    chunks) within a rounding of the GEMM's input; and the reference."""
    from kernels.fp8_gemm import plan_fp8_gemm
    from kernels.norm_rope import norm_rope_triton

    w_q, w_scale = _weight(150, k, 10)
    gen = torch.Generator().manual_seed(11)
    wide = (torch.randn(19, k + 64, generator=gen) * torch.logspace(-1, 1, 19)[:, None]).to(torch.bfloat16)
    x = wide[:, 32:32 + k]  # a column view
    norm = ((torch.randn(k, generator=gen) * 0.2 + 1).to(torch.bfloat16), 1e-6)
    config = dict(BLOCK_M=32, BLOCK_N=64, SPLIT_K=2, SWAP_AB=True, PREQUANTIZED=prequantized, num_warps=4,
                  num_stages=2)
    got, launches = plan_fp8_gemm(x, w_q, w_scale, config=config, rms_norm=norm)
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)
    separate = fp8_gemm_triton(norm_rope_triton(x, *norm), w_q, w_scale, config=config)
    expected = fp8_gemm_reference(x, w_q, w_scale, rms_norm=norm)
    scale = expected.float().abs().max().item()
    if k == 128:
        assert torch.equal(got, separate)
    else:  # an input's bf16 rounding, then its e4m3 one, may move by a step: a few output ulps here and there
        torch.testing.assert_close(got.float(), separate.float(), rtol=0, atol=0.02 * scale)
    # (torch's norm rounds a few inputs to the other side of an e4m3 step: 2.4 % of the output's scale seen)
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=0.05 * scale)
    unnormed = fp8_gemm_reference(x, w_q, w_scale)
    assert (unnormed.float() - expected.float()).abs().max() > 0.1 * scale  # the norm matters: the checks can fail


def test_x_act_quantized_by_its_producer_is_read_as_it_is():
    """x_quantized (the mHC collapse wrote x's act_quant): where the GEMM would act_quant x ahead it reads those bytes
    instead, one launch, the same output; where it quantizes in registers it reads x."""
    from kernels.fp8_gemm import plan_fp8_gemm, plan_act_quant

    w_q, w_scale = _weight(150, 300, 12)
    x = torch.randn(19, 300, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    (x_q, x_s), launches = plan_act_quant(x)
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)
    for prequantized in (True, False):
        config = dict(BLOCK_M=32, BLOCK_N=64, SPLIT_K=1, SWAP_AB=True, PREQUANTIZED=prequantized, num_warps=4,
                      num_stages=2)
        got, launches = plan_fp8_gemm(x, w_q, w_scale, config=config, x_quantized=(x_q, x_s))
        assert len(launches) == 1 and (launches[0][2][0] is x_q) == prequantized
        for kernel, grid, args, kwargs in launches:
            kernel[grid](*args, **kwargs)
        assert torch.equal(got, fp8_gemm_triton(x, w_q, w_scale, config=config))


@pytest.mark.parametrize("swap_ab, prequantized, split_k", [(True, False, 2), (True, True, 1), (False, False, 1),
                                                            (False, True, 2)])
@pytest.mark.parametrize("round_indexer", [False, True])
def test_a_head_roped_gemm_equals_the_gemm_then_the_norm_rope_kernel(swap_ab, prequantized, split_k, round_indexer):
    """The indexer's queries (rope, round_indexer): the GEMM rotating its output's heads (one a column tile, at V4's
    index_head_dim 128 with 64 rope channels) as it stores them, and with DeepSeek's indexer rounding, equals the GEMM
    then the norm_rope kernel (no norm) bit for bit, in every variant, with an RMSNorm prologue too; and (fp32) the
    reference's rope and rounding of its product."""
    from kernels.fp8_gemm import head_rope_reference, plan_fp8_gemm
    from kernels.norm_rope import norm_rope_triton

    tokens, heads, head_dim, k = 19, 3, 128, 256
    w_q, w_scale = _weight(heads * head_dim, k, 14)
    gen = torch.Generator().manual_seed(15)
    x = (torch.randn(tokens, k, generator=gen) * 3).to(torch.bfloat16)
    angles = torch.randn(tokens, 32, generator=gen) * 3
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    norm = ((torch.randn(k, generator=gen) * 0.2 + 1).to(torch.bfloat16), 1e-6)
    config = dict(BLOCK_M=32 if swap_ab else 16, BLOCK_N=head_dim, SPLIT_K=split_k, SWAP_AB=swap_ab,
                  PREQUANTIZED=prequantized, num_warps=4, num_stages=2)
    for prologue in ({}, dict(rms_norm=norm)):
        got, launches = plan_fp8_gemm(x, w_q, w_scale, config=config, rope=(cos, sin, head_dim),
                                      round_indexer=round_indexer, **prologue)
        assert len(launches) == 1 + prequantized
        for kernel, grid, args, kwargs in launches:
            kernel[grid](*args, **kwargs)
        product = fp8_gemm_triton(x, w_q, w_scale, config=config, **prologue)
        separate = norm_rope_triton(product.view(tokens, heads, head_dim), normalize=False, cos=cos, sin=sin,
                                    round_indexer=round_indexer).view(tokens, -1)
        assert torch.equal(got, separate)
        assert not torch.equal(got, product)  # the epilogue did something: the check above can fail
    # In fp32 the epilogue is the reference's rope and rounding of the same product, exactly.
    rope = (angles.cos(), angles.sin(), head_dim)
    got = fp8_gemm_triton(x.float(), w_q, w_scale, config=config, rope=rope, round_indexer=round_indexer)
    product = fp8_gemm_triton(x.float(), w_q, w_scale, config=config)
    assert torch.equal(got, head_rope_reference(product, rope, round_indexer))


def test_a_head_rope_makes_a_column_tile_one_head():
    """Whatever the tuned tiles, a head-roped GEMM's column tiles are its heads; heads the epilogue cannot take (wider
    than a tile, or not dividing N) are refused by the plan and roped by a launch after it by the dispatch."""
    from kernels.dispatch import KernelDispatch
    from kernels.fp8_gemm import Fp8Weight, fp8_gemm_config, plan_fp8_gemm

    assert fp8_gemm_config(1, 8192, 1024, head_dim=64)["BLOCK_N"] == 64
    assert fp8_gemm_config(1, 8192, 1024, head_dim=128)["BLOCK_N"] == 128
    w_q, w_scale = _weight(512, 128, 16)
    x, cos = torch.randn(2, 128).to(torch.bfloat16), torch.ones(2, 16, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="a head rope needs heads"):
        plan_fp8_gemm(x, w_q, w_scale, rope=(cos, cos, 256))
    with pytest.raises(AssertionError, match="round_indexer rounds the heads"):
        plan_fp8_gemm(x, w_q, w_scale, round_indexer=True)
    sin = torch.randn(2, 16).to(torch.bfloat16)
    kernels = KernelDispatch("triton")
    wide = kernels.linear(x, Fp8Weight(w_q, w_scale), rope=(cos, sin, 256))  # (256 channels a head: two launches)
    expected = fp8_gemm_reference(x, w_q, w_scale, rope=(cos, sin, 256))
    torch.testing.assert_close(wide.float(), expected.float(), rtol=0.02, atol=0.02 * expected.float().abs().max())


def test_one_act_quant_of_a_prologue_serves_every_gemm_that_reads_it():
    """q_a's RMSNorm feeds q_b and the indexer's q_b: its act_quant made once (`shared_linear_input`, from 17 tokens
    under Triton) and given to each GEMM as x_quantized with the prologue gives each GEMM's own output, in one launch
    where it would act_quant ahead, and the prologue in registers where it would not."""
    from kernels.dispatch import KernelDispatch
    from kernels.fp8_gemm import QUANTIZE_AHEAD_MIN_TOKENS, plan_fp8_gemm

    kernels = KernelDispatch("triton")
    gen = torch.Generator().manual_seed(17)
    norm = ((torch.randn(300, generator=gen) * 0.2 + 1).to(torch.bfloat16), 1e-6)
    w_q, w_scale = _weight(150, 300, 18)
    x = torch.randn(QUANTIZE_AHEAD_MIN_TOKENS - 1, 300, generator=gen).to(torch.bfloat16)
    assert kernels.shared_linear_input(x, rms_norm=norm) is None  # (each GEMM quantizes in its registers)
    assert KernelDispatch("reference").shared_linear_input(torch.cat([x, x]), rms_norm=norm) is None
    x = torch.cat([x, x])
    x_quantized = kernels.shared_linear_input(x, rms_norm=norm)
    for prequantized in (True, False):
        config = dict(BLOCK_M=32, BLOCK_N=64, SPLIT_K=1, SWAP_AB=True, PREQUANTIZED=prequantized, num_warps=4,
                      num_stages=2)
        got, launches = plan_fp8_gemm(x, w_q, w_scale, config=config, rms_norm=norm, x_quantized=x_quantized)
        assert len(launches) == 1 and (launches[0][2][0] is x_quantized[0]) == prequantized
        for kernel, grid, args, kwargs in launches:
            kernel[grid](*args, **kwargs)
        assert torch.equal(got, fp8_gemm_triton(x, w_q, w_scale, config=config, rms_norm=norm))
