"""DeepSeek-V4's quantized weight formats: which tensors are quantized, what the bytes mean, how to write them.

The decoding is defined once, in kernels/quant_formats.py (the kernels' references need it too), and
re-exported here for the loader.

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

from kernels.quant_formats import (E4M3_MAX, FP4_VALUES, FP8_BLOCK, MXFP4_BLOCK, dequantize_fp8,  # noqa: F401
                                   dequantize_mxfp4, fp8_block_shape, scale_to_float)

# Engine tensors DeepSeek stores in FP8 (`<name>.weight` + `<name>.scale`); routed experts by expert_dtype.
FP8_LINEARS = ("q_a_proj.weight", "q_b_proj.weight", "self_attn.kv_proj.weight", "o_a_proj.weight",
               "o_b_proj.weight", "indexer.q_b_proj.weight", "shared_experts.gate_proj.weight",
               "shared_experts.up_proj.weight", "shared_experts.down_proj.weight", ".e_proj.weight", ".h_proj.weight")
ROUTED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")  # the engine's merged routed experts [E, N, K]


def published_format(name: str, config) -> str | None:
    """How DeepSeek's checkpoint of `config` stores engine tensor `name`: "fp8" (e4m3 + block scales), "mxfp4" (the
    routed experts with expert_dtype fp4), or None (bf16/fp32: an unquantized config, or a tensor never quantized)."""
    if config.quantization_config is None:
        return None
    if name.endswith(ROUTED_EXPERTS):
        return "mxfp4" if config.expert_dtype == "fp4" else "fp8"
    return "fp8" if name.endswith(FP8_LINEARS) else None


def kept_quantized(name: str) -> bool:
    """Whether weight_format=fp8 keeps a quantized tensor as published: the routed experts and the FP8 linears, o_a_proj
    too (DeepSeek dequantizes it for a bf16 einsum; kernels/grouped_linear.py reads it FP8 for the same products)."""
    return name.endswith(ROUTED_EXPERTS) or name.endswith(FP8_LINEARS)


# --- writing (scripts/make_checkpoint.py, tests) ------------------------------------------------------


def _power_of_two_at_least(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x)))


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [N, K], e8m0 block scales) with power-of-two scales, as DeepSeek's converter writes."""
    n, k = weight.shape
    bn, bk = fp8_block_shape((n, k))
    padded = torch.zeros(bn * FP8_BLOCK, bk * FP8_BLOCK, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    blocks = padded.view(bn, FP8_BLOCK, bk, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-4)
    scale = _power_of_two_at_least(amax / E4M3_MAX)  # [bn, bk]
    quantized = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view_as(padded)[:n, :k]
    return quantized.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed e2m1 codes [N, K/2] int8, e8m0 scales [N, K/32] float8_e8m0fnu): round to the nearest code."""
    n, k = weight.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs K divisible by {MXFP4_BLOCK}, got {k}")
    groups = weight.float().view(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    scale = _power_of_two_at_least(groups.abs().amax(-1).clamp(min=1e-4) / 6.0)  # [N, K/32]
    scaled = (groups / scale[..., None]).view(n, k)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = (scaled[..., None] - table).abs().argmin(-1).to(torch.uint8)  # [N, K]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)
