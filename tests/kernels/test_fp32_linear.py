"""DeepSeek's fp32 linears (router, LM head) over weights as stored (kernels/fp32_linear.py) against
F.linear(x.float(), weight.float()): a bf16 weight with x split into three bf16 parts, an fp32 weight with fp32 dots."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.fp32_linear import fp32_linear_config, fp32_linear_reference, fp32_linear_triton


def _inputs(num_tokens, n, k, weight_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=gen) * torch.exp(torch.randn(num_tokens, k, generator=gen))
    weight = (torch.randn(n, k, generator=gen) * k ** -0.5).to(weight_dtype)
    return x, weight


@pytest.mark.parametrize("num_tokens,n,k", [(1, 256, 512), (5, 300, 384), (40, 129, 256), (3, 64, 200)])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_the_fp32_product_of_the_weight_as_stored(num_tokens, n, k, weight_dtype):
    x, weight = _inputs(num_tokens, n, k, weight_dtype, num_tokens + n)
    out = fp32_linear_triton(x, weight)
    exact = F.linear(x.double(), weight.double())
    assert out.dtype == torch.float32 and out.shape == (num_tokens, n)
    # as close as an fp32 GEMM: a relative error of a few float32 ulps of the sum of |products|
    scale = F.linear(x.double().abs(), weight.double().abs())
    assert ((out.double() - exact).abs() <= 4 * k * 2.0 ** -24 * scale).all()
    assert ((fp32_linear_reference(x, weight).double() - exact).abs() <= 4 * k * 2.0 ** -24 * scale).all()


def test_a_bf16_input_is_its_own_one_part():
    """The compressors' input: bf16 x and weight, one exact dot in fp32 (no split)."""
    x, weight = _inputs(7, 160, 256, torch.bfloat16, 9)
    x = x.to(torch.bfloat16)
    out = fp32_linear_triton(x, weight)
    exact = F.linear(x.double(), weight.double())
    scale = F.linear(x.double().abs(), weight.double().abs())
    assert out.dtype == torch.float32 and ((out.double() - exact).abs() <= 4 * 256 * 2.0 ** -24 * scale).all()


def test_x_is_not_rounded_to_bf16():
    """The three parts keep all of x: the result differs from the bf16-rounded x's product by far more than the
    tolerance above (a kernel that dropped `mid` and `lo` fails here)."""
    x, weight = _inputs(4, 128, 256, torch.bfloat16, 3)
    out = fp32_linear_triton(x, weight).double()
    exact = F.linear(x.double(), weight.double())
    rounded = F.linear(x.to(torch.bfloat16).double(), weight.double())
    assert (out - exact).abs().max() < (rounded - exact).abs().max() / 100


def test_batched_leading_dims_and_the_tiles():
    x, weight = _inputs(6, 96, 128, torch.bfloat16, 5)
    out = fp32_linear_triton(x.view(2, 3, 128), weight)
    assert out.shape == (2, 3, 96)
    torch.testing.assert_close(out.view(6, 96), fp32_linear_reference(x, weight), rtol=1e-6, atol=1e-6)
    assert fp32_linear_config(1, 129280, 4096, torch.device("cpu"))["BLOCK_N"] == 128  # the LM head: full tiles
    assert fp32_linear_config(1, 256, 4096, torch.device("cpu"))["BLOCK_N"] == 16  # the router: more programs
