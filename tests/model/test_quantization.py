"""backend/model/quantization.py: what FP8 / MXFP4 / e8m0 bytes mean, at irregular sizes."""

from __future__ import annotations

import pytest
import torch

from backend.model.quantization import (FP4_VALUES, dequantize_fp8, dequantize_mxfp4, quantize_fp8, quantize_mxfp4,
                                        scale_to_float)


def test_e8m0_byte_b_means_two_to_the_b_minus_127():
    raw = torch.tensor([0, 1, 126, 127, 128, 200, 254], dtype=torch.uint8)
    expected = torch.tensor([2.0 ** (b - 127) for b in raw.tolist()])
    assert torch.equal(scale_to_float(raw), expected)
    assert torch.equal(scale_to_float(raw.view(torch.float8_e8m0fnu)), expected)
    assert torch.isnan(scale_to_float(torch.tensor([255], dtype=torch.uint8).view(torch.float8_e8m0fnu)))[0]


@pytest.mark.parametrize("n, k", [(200, 300), (128, 128), (5, 129), (257, 64)])
def test_fp8_block_scales_multiply_their_128x128_block_including_partial_ones(n, k):
    g = torch.Generator().manual_seed(n * k)
    weight = (torch.randn(n, k, generator=g) * 100).to(torch.float8_e4m3fn)
    bn, bk = -(-n // 128), -(-k // 128)
    scale = torch.randint(100, 140, (bn, bk), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    out = dequantize_fp8(weight, scale)
    for row, col in [(0, 0), (n - 1, k - 1), (min(n - 1, 130), min(k - 1, 129)), (n // 2, k // 3)]:
        block_scale = 2.0 ** (scale.view(torch.uint8)[row // 128, col // 128].item() - 127)
        assert out[row, col].item() == weight[row, col].float().item() * block_scale
    assert torch.equal(out.to(torch.bfloat16).float(), out)  # exact in bf16


def test_mxfp4_low_nibble_is_the_even_element_and_bit_3_the_sign():
    packed = torch.tensor([[0x21, 0xF8] + [0] * 14], dtype=torch.uint8).view(torch.int8)  # K = 32
    scale = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2^1
    out = dequantize_mxfp4(packed, scale)
    assert out.shape == (1, 32)
    # 0x21: low 1 -> 0.5, high 2 -> 1.0; 0xF8: low 8 -> -0.0, high 15 -> -6.0; all times 2.
    assert out[0, :4].tolist() == [1.0, 2.0, -0.0, -12.0]
    assert torch.signbit(out[0, 2])


@pytest.mark.parametrize("n, k", [(5, 64), (64, 32), (33, 96)])
def test_mxfp4_scales_apply_per_32_columns_and_round_trip_the_codes(n, k):
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    exps = torch.randint(120, 135, (n, k // 32), generator=g, dtype=torch.uint8)
    out = dequantize_mxfp4(packed, exps.view(torch.float8_e8m0fnu))
    table = torch.tensor(FP4_VALUES)
    expected = table[codes.long()] * torch.exp2(exps.float() - 127).repeat_interleave(32, 1)
    assert torch.equal(out, expected)
    assert torch.equal(out.to(torch.bfloat16).float(), out)


def test_quantizers_write_what_the_dequantizers_read():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 96, generator=g)
    q, s = quantize_fp8(weight)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 1)
    assert (dequantize_fp8(q, s) - weight).abs().max() <= weight.abs().max() / 16  # e4m3: 3 mantissa bits
    q, s = quantize_mxfp4(weight)
    assert q.dtype == torch.int8 and q.shape == (200, 48) and s.shape == (200, 3)
    assert (dequantize_mxfp4(q, s) - weight).abs().max() <= weight.abs().max() / 2
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_mxfp4(torch.randn(4, 48))
