"""The attention output's grouped projection with its weight kept FP8 (kernels/grouped_linear.py) against the bf16
einsum DeepSeek runs over the dequantized weight: the same products, up to the order of the sums."""

from __future__ import annotations

import pytest
import torch

from kernels import tuning
from kernels.fp8_gemm import Fp8Weight
from kernels.grouped_linear import grouped_fp8_config, grouped_linear_reference, grouped_linear_triton
from kernels.quant_formats import dequantize_fp8


def _weight(groups, rows, k, gen) -> Fp8Weight:
    data = torch.randn(groups * rows, k, generator=gen).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = (-(-groups * rows // 128), -(-k // 128))
    scale = 2.0 ** torch.randint(-10, -4, blocks, generator=gen).float()  # powers of two, different per block
    return Fp8Weight(data, scale)


@pytest.mark.parametrize("num_tokens,groups,rows,k", [(1, 8, 128, 256), (5, 2, 64, 384), (20, 4, 96, 200),
                                                      (3, 1, 256, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_weight_gives_the_dequantized_weights_products(num_tokens, groups, rows, k, dtype):
    gen = torch.Generator().manual_seed(num_tokens * groups + k)
    weight = _weight(groups, rows, k, gen)
    x = torch.randn(num_tokens, groups, k, generator=gen).to(dtype)
    out = grouped_linear_triton(x, weight)
    assert out.dtype == dtype and out.shape == (num_tokens, groups * rows)
    dense = dequantize_fp8(weight.data, weight.scale).double().view(groups, rows, k)
    exact = torch.einsum("tgk,grk->tgr", x.double(), dense).reshape(num_tokens, -1)
    bound = torch.einsum("tgk,grk->tgr", x.double().abs(), dense.abs()).reshape(num_tokens, -1)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23  # the output rounded (truncated by the interpreter)
    assert ((out.double() - exact).abs() <= ulp * exact.abs() + 4 * k * 2.0 ** -24 * bound).all()
    torch.testing.assert_close(out, grouped_linear_reference(x, weight), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-5 if dtype == torch.float32 else 1e-2)


def test_each_group_reads_its_own_rows_and_input():
    """A weight whose groups differ and an input whose groups differ: swapping either changes the result (a kernel
    that read group 0's input for every group, or one scale for all blocks, fails)."""
    gen = torch.Generator().manual_seed(1)
    weight = _weight(4, 128, 256, gen)
    x = torch.randn(3, 4, 256, generator=gen)
    out = grouped_linear_triton(x, weight)
    torch.testing.assert_close(out, grouped_linear_reference(x, weight), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, grouped_linear_triton(x.flip(1), weight), rtol=1e-3, atol=1e-3)


def test_a_dense_weight_is_a_batched_matmul_and_the_tiles():
    gen = torch.Generator().manual_seed(2)
    dense = torch.randn(2 * 64, 128, generator=gen)
    x = torch.randn(5, 2, 128, generator=gen)
    expected = torch.cat([x[:, g] @ dense[g * 64:(g + 1) * 64].T for g in range(2)], dim=1)
    torch.testing.assert_close(grouped_linear_triton(x, dense), expected)
    config = grouped_fp8_config(1, 8 * 1024, 4096, torch.device("cpu"))  # V4-Flash at one token: a program for every SM
    assert 8 * 1024 // config["BLOCK_N"] >= 132 and config["BLOCK_N"] >= 16


def test_a_tuned_k_step_wider_than_a_scale_block_is_refused():
    """Each K step reads one 128-wide block's scale: a configuration file's BLOCK_K of 256 would scale a step's second
    block by the first's (silently wrong); it is refused, and a narrower step still gives the products."""
    gen = torch.Generator().manual_seed(3)
    weight = _weight(2, 128, 256, gen)
    x = torch.randn(4, 2, 256, generator=gen)
    shape = dict(rows=256, k=256, tokens=4)
    with tuning.using({"grouped_fp8": {tuning.shape_key(shape)[0]: {4: {"BLOCK_K": 256}}}}):
        with pytest.raises(AssertionError, match="K steps within one 128-wide block"):
            grouped_linear_triton(x, weight)
    with tuning.using({"grouped_fp8": {tuning.shape_key(shape)[0]: {4: {"BLOCK_K": 64}}}}):
        torch.testing.assert_close(grouped_linear_triton(x, weight), grouped_linear_reference(x, weight),
                                   rtol=1e-5, atol=1e-5)
