"""DeepSeek's in-place activation quantizers as one launch each (kernels/act_rounding.py) against their references:
the same bits, signs of zeros included, at V4's widths (the experts' 4096-wide input, the indexer's 128-wide queries
of 64 heads) and at odd ones."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.act_rounding import (round_activations_reference, round_activations_triton, round_indexer_reference,
                                  round_indexer_triton)
from kernels.quant_formats import hadamard_rotate, rotate_rows


def _values(shape, gen) -> torch.Tensor:
    """Magnitudes over many binades (groups whose scales differ), exact zeros, negative zeros and e2m1/e4m3 ties."""
    x = torch.randn(shape, generator=gen) * torch.exp(3 * torch.randn(shape, generator=gen))
    flat = x.view(-1, shape[-1])
    flat[0, :32] = 0.0  # a group of zeros: the amax floor's scale
    flat[0, 32:40] = -0.0
    flat[-1, :8] = torch.tensor([0.25, -0.75, 2.5, -5.0, 448.0, -448.0, 1e-30, 3e38])  # ties; extremes
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.float().view(torch.int32),
                                                                     b.float().view(torch.int32))


@pytest.mark.parametrize("shape", [(3, 4096), (1, 128), (5, 384), (2, 3, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_activations_is_act_quant_in_place(shape, dtype):
    x = _values(shape, torch.Generator().manual_seed(sum(shape))).clamp(-1e30, 1e30).to(dtype)
    out = round_activations_triton(x)
    assert _same_bits(out, round_activations_reference(x))
    assert not torch.equal(out, x)  # it rounds


@pytest.mark.parametrize("shape", [(3, 64, 128), (7, 32), (1, 2, 64), (33, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_indexer_rotates_then_rounds_to_fp4(shape, dtype):
    x = _values(shape, torch.Generator().manual_seed(sum(shape))).clamp(-1e30, 1e30).to(dtype)
    out = round_indexer_triton(x)
    assert _same_bits(out, round_indexer_reference(x))
    codes_per_group = out.float().unflatten(-1, (-1, 32)).abs()
    scales = codes_per_group.amax(-1, keepdim=True).clamp(min=1e-38) / 6  # at most 8 magnitudes a group: e2m1's grid
    assert all(len(torch.unique(g)) <= 8 for g in (codes_per_group / scales).reshape(-1, 32)[:50])


@triton.jit
def _rotate_kernel(x_ptr, out_ptr, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    offsets = tl.arange(0, ROWS)[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(out_ptr + offsets, rotate_rows(tl.load(x_ptr + offsets), ROWS, N, LOG_N, tl.float32))


@pytest.mark.parametrize("n", [32, 128])
def test_the_rotation_in_registers_takes_the_references_butterflies(n):
    """Values whose rotation's last bits depend on the order of the sums: a product with the Hadamard matrix does not
    give hadamard_rotate's bits; `rotate_rows` does, value for value."""
    x = _values((16, n), torch.Generator().manual_seed(n))
    signs = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(n)] for i in range(n)], dtype=torch.float32)
    assert not torch.equal((x @ signs) * n ** -0.5, hadamard_rotate(x))  # the order of the sums shows
    out = torch.empty_like(x)
    _rotate_kernel[(1,)](x, out, ROWS=16, N=n, LOG_N=n.bit_length() - 1)
    assert _same_bits(out, hadamard_rotate(x))
