"""DeepSeek's activation quantizers (kernels/quant_formats.py: act_quant and fp4_act_quant semantics, the Hadamard
rotation) against the formulas of DeepSeek's inference, written out independently here, at the edges: zero
blocks, amax at exact powers of two, ties, values in e4m3's subnormal range, and the amax floors that keep every
scale a normal float; and the fp8 KV entry / FP4 indexer key byte layouts (what they store, exactly)."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from kernels.quant_formats import (FP4_MAX, FP4_VALUES, hadamard_rotate, power_of_two_scale, quantize_groups,
                                   round_e2m1, e4m3_groups, simulate_quantization)

INV = {m: float(torch.tensor(1 / m, dtype=torch.float32)) for m in (448.0, 6.0)}  # the kernel's float32 constants


def _scale_by_formula(amax: float, max_value: float) -> float:
    """2^ceil(log2(fl32(amax * fl32(1/max)))) with Python's exact arithmetic on the float32 product."""
    product = float(torch.tensor(amax, dtype=torch.float32) * torch.tensor(INV[max_value], dtype=torch.float32))
    mantissa, exponent = math.frexp(product)  # product = mantissa * 2^exponent, mantissa in [0.5, 1)
    return 2.0 ** (exponent - 1 if mantissa == 0.5 else exponent)


@pytest.mark.parametrize("max_value", [448.0, 6.0])
def test_power_of_two_scale_is_the_ceiling_power_of_two_of_the_float32_product(max_value):
    """Over the amaxes the quantizers pass (at or above their floors, so the product is a normal float)."""
    generator = torch.Generator().manual_seed(0)
    lowest = math.log2(1e-4) if max_value == 448.0 else math.log2(6.0) - 126
    magnitudes = torch.exp2(torch.empty(2000).uniform_(lowest, 100, generator=generator))
    exact = torch.tensor([max_value * 2.0 ** k for k in range(-20, 20)])  # amax at exact powers of two of MAX
    neighbours = torch.cat([exact.nextafter(torch.tensor(0.0)), exact.nextafter(torch.tensor(math.inf))])
    for amax in torch.cat([magnitudes, exact, neighbours]).tolist():
        assert power_of_two_scale(torch.tensor([amax]), max_value).item() == _scale_by_formula(amax, max_value), amax
    assert power_of_two_scale(exact, max_value).tolist() == [2.0 ** k for k in range(-20, 20)]


def test_e2m1_rounds_to_the_nearest_value_ties_to_the_even_code():
    grid = torch.tensor(FP4_VALUES[:8])
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    for value, expected in ties.items():
        assert round_e2m1(torch.tensor([value, -value])).tolist() == [expected, -expected]
    values = torch.linspace(-FP4_MAX, FP4_MAX, 4801)
    got = round_e2m1(values)
    distance = (values.abs()[:, None] - grid).abs()
    nearest = grid[distance.argmin(-1)]
    is_tie = (distance.sort(-1).values[:, :2].diff(dim=-1).squeeze(-1) == 0)
    assert torch.equal(got.abs()[~is_tie], nearest[~is_tie]) and torch.equal(got.sign(), values.sign() * (got != 0))


def test_e4m3_rounding_is_round_to_nearest_even_including_its_subnormals():
    """A group whose amax is 448 has scale 1: the other values round on e4m3's own grid (2^-9 steps below 2^-6)."""
    values = torch.tensor([448.0, 0.5 + 2**-5, 0.5 + 3 * 2**-5, 3 * 2**-10, 5 * 2**-10, 2**-10, 2**-11] + [0.0] * 57)
    grid, scale = quantize_groups(values[None], 64, "e4m3")
    assert scale.tolist() == [[1.0]]
    assert grid[0, :7].tolist() == [448.0, 0.5, 0.625, 2 * 2**-9, 2 * 2**-9, 0.0, 0.0]


@pytest.mark.parametrize("fmt,block", [("e4m3", 64), ("e4m3", 128), ("e2m1", 32)])
def test_zero_blocks_and_the_floors_keep_scales_normal(fmt, block):
    zeros = torch.zeros(2, block)
    grid, scale = quantize_groups(zeros, block, fmt)
    floor_scale = 2.0 ** -22 if fmt == "e4m3" else 2.0 ** -126  # 1e-4 / 448 -> 2^-22; 6 * 2^-126 / 6 -> 2^-126
    assert torch.equal(grid, zeros) and scale.tolist() == [[floor_scale]] * 2
    tiny = torch.full((1, block), 1e-38)  # below the floor: the floor's scale, a normal float
    assert quantize_groups(tiny, block, fmt)[1].item() == floor_scale and floor_scale >= torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("fmt,block,max_value", [("e4m3", 64, 448.0), ("e2m1", 32, 6.0)])
def test_a_group_whose_amax_is_max_times_a_power_of_two_keeps_it_exactly(fmt, block, max_value):
    for k in (-8, 0, 5):
        x = torch.zeros(1, block)
        x[0, 3], x[0, 7] = max_value * 2.0**k, -max_value * 2.0**k / 2
        grid, scale = quantize_groups(x, block, fmt)
        assert scale.item() == 2.0**k and grid[0, 3].item() == max_value and grid[0, 7].item() == -max_value / 2
        assert torch.equal(simulate_quantization(x, block, fmt), x)


@pytest.mark.parametrize("fmt,block", [("e4m3", 64), ("e2m1", 32)])
def test_simulated_values_are_exact_in_bf16_and_requantize_to_themselves(fmt, block):
    x = (torch.randn(16, 4 * block, generator=torch.Generator().manual_seed(1)) *
         torch.exp2(torch.randint(-20, 20, (16, 1)).float())).to(torch.bfloat16)
    once = simulate_quantization(x, block, fmt)
    assert once.dtype == torch.bfloat16
    assert torch.equal(simulate_quantization(x.float(), block, fmt), once.float())  # exact: the same in fp32
    assert torch.equal(simulate_quantization(once, block, fmt), once)


def test_hadamard_rotation_is_the_scaled_sylvester_matrix_and_its_own_inverse():
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < 128:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2), dtype=torch.float64).float()
    torch.testing.assert_close(hadamard_rotate(x), (x.double() @ hadamard.double().T * 128**-0.5).float(),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hadamard_rotate(hadamard_rotate(x)), x, rtol=1e-5, atol=1e-5)
    bf16 = x.to(torch.bfloat16)
    assert torch.equal(hadamard_rotate(bf16), hadamard_rotate(bf16.float()).to(torch.bfloat16))  # one rounding
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_rotate(torch.zeros(2, 96))


def test_the_fp8_kv_entry_is_584_bytes_and_stores_deepseeks_rounded_values_exactly():
    from kernels.quant_formats import kv_fp8_entry_bytes, pack_kv_fp8, unpack_kv_fp8

    assert kv_fp8_entry_bytes(512, 64) == 584  # 448 e4m3 + 64 bf16 + 7 scales + 1 pad, as vLLM stores V4's
    kv = (torch.randn(3, 4, 512, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    rounded = torch.cat([simulate_quantization(kv[..., :448], 64, "e4m3"), kv[..., 448:]], dim=-1)
    entries = pack_kv_fp8(rounded, rope_dim=64)
    assert entries.shape == (3, 4, 584) and entries.dtype == torch.uint8
    assert torch.equal(unpack_kv_fp8(entries, 512, 64), rounded)  # DeepSeek's values: stored without loss
    assert torch.equal(unpack_kv_fp8(pack_kv_fp8(kv, 64), 512, 64), rounded)  # quantized on write, the same
    assert torch.equal(entries[..., 448:576].contiguous().view(torch.bfloat16), kv[..., 448:])  # rope: bf16 as is
    assert entries[..., 583].eq(0).all()  # the pad byte
    unit = torch.zeros(1, 512)
    unit[0, :448] = 448.0  # every group's scale is 2^0: ue8m0 byte 127
    assert pack_kv_fp8(unit, 64)[0, 576:583].tolist() == [127] * 7


def test_the_fp4_indexer_key_is_68_bytes_and_stores_rotated_rounded_keys_exactly():
    from kernels.quant_formats import dequantize_mxfp4, indexer_fp4_entry_bytes, pack_indexer_fp4, unpack_indexer_fp4

    assert indexer_fp4_entry_bytes(128) == 68  # 64 bytes of e2m1 pairs + 4 ue8m0 scales, against 256 in bf16
    keys = hadamard_rotate(torch.randn(6, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16))
    rounded = simulate_quantization(keys, 32, "e2m1")
    entries = pack_indexer_fp4(rounded)
    assert entries.shape == (6, 68) and torch.equal(unpack_indexer_fp4(entries, 128), rounded)
    assert torch.equal(unpack_indexer_fp4(pack_indexer_fp4(keys), 128), rounded)
    # The same nibble order and scales as the MXFP4 weights (low nibble: the even index).
    assert torch.equal(dequantize_mxfp4(entries[:, :64], entries[:, 64:]), rounded.float())
    pair = torch.zeros(1, 32)
    pair[0, 0], pair[0, 1] = 0.5, -6.0  # codes 1 and 8 | 7, scale 2^0
    assert pack_indexer_fp4(pair)[0, 0].item() == 1 | (15 << 4)


def test_layouts_that_cannot_apply_are_refused_with_the_widths():
    from kernels.quant_formats import indexer_fp4_entry_bytes, kv_fp8_entry_bytes

    with pytest.raises(ValueError, match="multiple of 64.*64 - 16"):
        kv_fp8_entry_bytes(64, 16)  # the built-in checkpoint's widths
    with pytest.raises(ValueError, match="divisible by 32"):
        indexer_fp4_entry_bytes(48)


@triton.jit
def _quantize_in_registers(x_ptr, grid_ptr, scale_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    offsets = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    grid, scale = e4m3_groups(tl.load(x_ptr + offsets), ROWS, COLS)
    tl.store(grid_ptr + offsets, grid)
    tl.store(scale_ptr + tl.arange(0, ROWS)[:, None] * (COLS // 128) + tl.arange(0, COLS // 128)[None, :], scale)


def test_the_in_register_act_quant_is_the_reference_at_its_edges():
    """e4m3_groups (the fused MoE's act_quant of the down projection's input) against quantize_groups:
    random groups, a zero group, a group whose amax is 448 times a power of two, values that round up into the next
    binade, ties, and e4m3 subnormals."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 256, generator=gen) * torch.logspace(-3, 3, 16)[:, None]
    x[1, :128] = 0.0
    x[2, :128], x[2, 0] = torch.randn(128, generator=gen).clamp(-400, 400), 448.0 * 2.0 ** -3
    x[3, :128] = torch.linspace(3.9, 4.0, 128)  # with amax 4, the scale is 2^-6: 3.9.. rounds up to 4 in e4m3
    x[4, :128] = 448.0 * (torch.arange(128) % 7 + 0.5) / 8  # halfway between neighbours at 448's scale
    x[5, :128] = torch.linspace(-2.0 ** -8, 2.0 ** -8, 128) * 448.0 * 2.0 ** -6  # subnormals after scaling
    grid, scale = torch.empty_like(x), torch.empty(16, 2)
    _quantize_in_registers[(1,)](x, grid, scale, ROWS=16, COLS=256)
    expected_grid, expected_scale = quantize_groups(x, 128, "e4m3")
    assert torch.equal(grid, expected_grid) and torch.equal(scale, expected_scale)
