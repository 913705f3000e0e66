"""DeepSeek-V4's published weight formats: what their bytes mean, decoded with plain torch.

The one definition, shared by the kernels' references (kernels/fp8_gemm.py, kernels/moe.py) and the
checkpoint loader (through backend/model/quantization.py, which also writes them for tests).

- FP8 (dense and attention linears; V4-Flash-Base also its routed experts): `X.weight` float8 e4m3
  [N, K] and `X.scale` [ceil(N/128), ceil(K/128)], float8_e8m0fnu (V4-Flash, V4-Pro) or float32
  holding powers of two (V4-Flash-Base): W[n, k] = W_q[n, k] * S[n // 128, k // 128].
- MXFP4 (routed experts, `expert_dtype: "fp4"`): `X.weight` int8 [N, K/2], two e2m1 codes per byte
  (low nibble = even k), and `X.scale` e8m0 [N, K/32]: W[n, k] = FP4[code] * 2^(S[n, k // 32] - 127).
- e8m0: byte b means 2^(b - 127) (0xFF is NaN); the scale multiplies, it is not an inverse.

Every dequantized value is exact in bf16 and fp32: an e4m3 or e2m1 value (3 or 1 mantissa bits)
times a power of two.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
MXFP4_BLOCK = 32
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
# e2m1 code -> value; bit 3 is the sign.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as float32 multipliers, from e8m0 (float8_e8m0fnu or raw uint8 bytes) or float32."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - 127.0)
    return scale.to(torch.float32)


def fp8_block_shape(shape: tuple[int, int]) -> tuple[int, int]:
    n, k = shape
    return -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W [N, K] float32 from e4m3 `weight` [N, K] and block scales [ceil(N/128), ceil(K/128)]."""
    n, k = weight.shape
    blocks = scale_to_float(scale)
    expanded = blocks.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return weight.to(torch.float32) * expanded


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W [N, K] float32 from packed e2m1 codes [N, K/2] (int8 or uint8) and e8m0 scales [N, K/32]."""
    codes = packed.view(torch.uint8)
    low, high = (codes & 0xF).long(), (codes >> 4).long()
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed.device)
    values = torch.stack((table[low], table[high]), dim=-1).flatten(-2)  # [N, K]: low nibble = even k
    return values * scale_to_float(scale).repeat_interleave(MXFP4_BLOCK, -1)
