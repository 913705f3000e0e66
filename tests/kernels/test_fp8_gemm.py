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
    with pytest.raises(AssertionError, match="K=100"):
        fp8_gemm_triton(torch.randn(2, 100), w_q, w_scale)
    with pytest.raises(AssertionError, match="w_scale must be"):
        fp8_gemm_triton(torch.randn(2, 128), w_q, w_scale[:, :0])
    with pytest.raises(AssertionError, match="float8_e4m3fn"):
        fp8_gemm_triton(torch.randn(2, 128), w_q.float(), w_scale)
