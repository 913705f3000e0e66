"""DeepSeek-V4's number formats: the published weights, DeepSeek's activation quantizers and its KV cache layouts.

What the bytes mean, in plain torch (the references' side), and for the KV cache also decoded in a kernel's
registers (`load_kv_entries`, `load_indexer_keys`: Triton helpers the attention and indexer kernels inline).

The one definition, shared by the kernels' references (kernels/fp8_gemm.py, kernels/moe.py) and the
checkpoint loader (through backend/model/quantization.py, which also writes them for tests).

- FP8 (dense and attention linears; V4-Flash-Base also its routed experts): `X.weight` float8 e4m3
  [N, K] and `X.scale` [ceil(N/128), ceil(K/128)], float8_e8m0fnu (V4-Flash, V4-Pro) or float32
  holding powers of two (V4-Flash-Base): W[n, k] = W_q[n, k] * S[n // 128, k // 128].
- MXFP4 (routed experts, `expert_dtype: "fp4"`): `X.weight` int8 [N, K/2], two e2m1 codes per byte
  (low nibble = even k), and `X.scale` e8m0 [N, K/32]: W[n, k] = FP4[code] * 2^(S[n, k // 32] - 127).
- e8m0: byte b means 2^(b - 127) (0xFF is NaN); the scale multiplies, it is not an inverse.
- MXFP4 in the kernels' layout (`repack_mxfp4`, a load-time repack for the MoE kernels): the same codes and scales,
  arranged so that registers turn them into bf16 with a few integer operations (see the section below).

Every dequantized value is exact in bf16 and fp32: an e4m3 or e2m1 value (3 or 1 mantissa bits)
times a power of two.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

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


# --- MXFP4 weights in the kernels' layout ---------------------------------------------------------------------------
# Hopper has no FP4 tensor cores: the MoE kernels turn e2m1 codes into bf16 in registers and multiply in bf16. As
# published, two codes share a byte and the bytes of a row follow K, so a register of codes decodes only through
# per-value shifts and selects. Repacked, each row is cut into chunks of 128 K values (K padded with zero codes), a
# chunk into 16 int32 words; word w holds, for each of the chunk's four 32-wide scale groups j, the pair
# k = 32 j + 2 w + (0, 1), its four bits (sign, exponent 2 bits, mantissa) at MXFP4_BIT_POSITIONS[j] of the word's
# low (even k) or high (odd k) 16 bits. Group j's two codes then become two bf16 bit patterns (sign at bit 15,
# exponent and mantissa at bits 8..6: the bf16 value fp4 x 2^-126, exact) with one mask for j = 0, a shift and a mask
# for j = 1, 2 (3 j bits left) and three for j = 3 (`mxfp4_words_to_values`); one bf16 multiply by 2^(e - 1) applies
# the group's e8m0 code e and the missing 2^126. The pair lies in one register as the MMA operand wants it: on a GPU
# each group's masks and multiply are one inline-asm instance writing that register (`MXFP4_GROUP_ASM`), as Triton
# would otherwise split the word into 16-bit halves and pack them again. The scales stay e8m0 bytes [N, K/32] (padded
# with 127), a chunk's four read as one int32. Codes above 128 (scales above 2) would overflow the bf16 multiplier
# and are refused; DeepSeek's published weights use scales far below 1.
MXFP4_CHUNK = 128
MXFP4_BIT_POSITIONS = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (14, 13, 11, 10))  # (sign, e1, e0, m) per group
MXFP4_MAX_SCALE_CODE = 128


def repack_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(words int32 [..., N, Kp / 8], scales uint8 [..., N, Kp / 32]) in the kernels' layout from the published codes
    [..., N, K/2] (int8 or uint8, low nibble = even k) and e8m0 scales [..., N, K/32]; Kp = K rounded up to 128."""
    codes = packed.view(torch.uint8)
    k = 2 * codes.shape[-1]
    padded = -(-k // MXFP4_CHUNK) * MXFP4_CHUNK
    codes = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).to(torch.int32)  # [..., N, K]
    codes = torch.nn.functional.pad(codes, (0, padded - k)).unflatten(-1, (-1, 4, 16, 2))  # [.., chunk, j, w, lane]
    words = torch.zeros(codes.shape[:-3] + (16,), dtype=torch.int32, device=codes.device)
    for j, positions in enumerate(MXFP4_BIT_POSITIONS):
        for lane in range(2):
            code = codes[..., j, :, lane]
            for bit, position in zip((3, 2, 1, 0), positions):
                words |= ((code >> bit) & 1) << (position + 16 * lane)  # bit 31: int32's sign bit, as intended
    scale = scale.view(torch.uint8)
    if scale.numel() and int(scale.max()) > MXFP4_MAX_SCALE_CODE:
        raise ValueError(f"MXFP4 scales above 2 (e8m0 codes above {MXFP4_MAX_SCALE_CODE}) do not fit the kernels' "
                         f"bf16 multiplier; the largest here is code {int(scale.max())}")
    scale = torch.nn.functional.pad(scale, (0, padded // MXFP4_BLOCK - scale.shape[-1]), value=127)
    return words.flatten(-2), scale.contiguous()


def unpack_mxfp4(words: torch.Tensor, scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The published (codes uint8 [..., N, K/2], e8m0 scales uint8 [..., N, K/32]) from `repack_mxfp4`'s layout."""
    bits = words.unflatten(-1, (-1, 16)).to(torch.int64) & 0xFFFFFFFF  # [..., N, chunk, w]
    groups = []
    for positions in MXFP4_BIT_POSITIONS:
        lanes = [sum(((bits >> (position + 16 * lane)) & 1) << bit for bit, position in zip((3, 2, 1, 0), positions))
                 for lane in range(2)]
        groups.append(torch.stack(lanes, dim=-1).flatten(-2))  # [..., N, chunk, 32]: k = 2 w + lane
    codes = torch.stack(groups, dim=-2).flatten(-3)[..., :k].to(torch.uint8)  # [..., N, K]
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale[..., :k // MXFP4_BLOCK].view(torch.uint8)


# --- DeepSeek's activation quantizers (the semantics of its inference/kernel.py) -----------------------------------
# What DeepSeek's own inference rounds activations to, as quantization-aware training saw it (facts and sources:
# shared docs, deepseek-v4-reference-numerics.md). Each group of `block` values along the last dimension gets a
# power-of-two scale s = 2^ceil(log2(amax * (1 / MAX))), computed from the float32 bits as DeepSeek's
# fast_round_scale does (the float32 product by the float32 constant 1 / MAX, then exponent - 127 + (mantissa != 0)),
# with amax floored (1e-4 for e4m3, 6 * 2^-126 for e2m1); the values are clamp(x / s, -MAX, MAX) rounded to the
# format with round-to-nearest-even. "Simulated" (DeepSeek's inplace=True) returns the rounded value times s in x's
# dtype; every such value is exact in bf16.

FP8_ACT_BLOCK = 128  # linears' inputs
KV_FP8_BLOCK = 64  # the attention entries' non-rotary dims
FP4_MAX = 6.0
_AMAX_FLOOR = {"e4m3": 1e-4, "e2m1": 6.0 * 2.0 ** -126}
_MAX = {"e4m3": E4M3_MAX, "e2m1": FP4_MAX}


def power_of_two_scale(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """2^ceil(log2(amax * fl32(1 / max_value))) from the float32 bits (DeepSeek's fast_round_scale), float32. Exact
    for a normal product, which the amax floors guarantee (a subnormal one would give 2^-126)."""
    product = (amax.to(torch.float32) * torch.tensor(1.0 / max_value, dtype=torch.float32)).contiguous()
    bits = product.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((exponent + 127) << 23).view(torch.float32)


def round_e2m1(values: torch.Tensor) -> torch.Tensor:
    """float32 values in [-6, 6] rounded to the nearest e2m1 value {0, 0.5, 1, 1.5, 2, 3, 4, 6} (ties to the even
    code, as the hardware's cvt.rn): within each binade the grid is evenly spaced, and an even multiple of its
    spacing is an even code."""
    magnitude = values.abs()
    step = torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))
    return torch.copysign(torch.round(magnitude / step) * step, values)  # torch.round: half to even


def quantize_groups(x: torch.Tensor, block: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values on the format's grid as float32 [..., N], power-of-two scales float32 [..., N / block]): DeepSeek's
    act_quant (fmt "e4m3", scale_fmt ue8m0) or fp4_act_quant (fmt "e2m1") of x [..., N]."""
    if x.shape[-1] % block:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be a multiple of the block ({block})")
    groups = x.to(torch.float32).unflatten(-1, (-1, block))
    amax = groups.abs().amax(-1).clamp(min=_AMAX_FLOOR[fmt])
    scale = power_of_two_scale(amax, _MAX[fmt])
    limit = _MAX[fmt]
    scaled = (groups / scale.unsqueeze(-1)).clamp(-limit, limit)
    grid = scaled.to(torch.float8_e4m3fn).to(torch.float32) if fmt == "e4m3" else round_e2m1(scaled)
    return grid.flatten(-2), scale


def simulate_quantization(x: torch.Tensor, block: int, fmt: str) -> torch.Tensor:
    """x rounded as DeepSeek's inference rounds it in place (act_quant / fp4_act_quant with inplace=True): each
    value replaced by its quantized value times its group's scale, in x's dtype."""
    grid, scale = quantize_groups(x, block, fmt)
    return (grid.unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2).to(x.dtype)


def simulate_kv_fp8(entries: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """An attention entry [..., D] as DeepSeek's inference rounds it after its norm and rope: the nope values
    act_quant'ed in groups of 64 (e4m3, ue8m0 scales), the trailing rope_dim values kept."""
    nope = _check_nope(entries.shape[-1], rope_dim)
    return torch.cat([simulate_quantization(entries[..., :nope], KV_FP8_BLOCK, "e4m3"), entries[..., nope:]], dim=-1)


def simulate_indexer_fp4(x: torch.Tensor) -> torch.Tensor:
    """An indexer key or query [..., Di] as DeepSeek's inference rounds it: rotated, then fp4_act_quant'ed in groups
    of 32 (e2m1, ue8m0 scales). Scores of rotated queries against rotated keys are those of the originals."""
    return simulate_quantization(hadamard_rotate(x), MXFP4_BLOCK, "e2m1")


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotate_activation: the Sylvester-ordered Hadamard transform of the last dimension (a power of
    two) scaled by its size^-1/2, computed in float32 and rounded once to x's dtype (fast_hadamard_transform)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two width, got {n}")
    y = x.to(torch.float32).reshape(-1, n)
    h = 1
    while h < n:  # butterflies: pairs (i, i + h) within blocks of 2h
        pairs = y.view(-1, n // (2 * h), 2, h)
        y = torch.cat((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=-1).view(-1, n)
        h *= 2
    return (y * n ** -0.5).view(x.shape).to(x.dtype)


# --- the KV cache as DeepSeek's model was trained for it (kv_cache_dtype fp8) ---------------------------------------
# An attention entry (window, CSA, HCA) of D = nope + rope values, rope the trailing rope_dim: the nope values as
# e4m3 bytes with one ue8m0 scale per 64 (DeepSeek's act_quant on kv[..., :-rope_dim], block 64), the rope values
# kept as bf16, the scales last, padded to 8 bytes. V4 (D 512, rope 64): 448 + 128 + 7 + 1 = 584 bytes, as vLLM
# stores it, against 1,024 in bf16. An indexer key of Di values: Di / 2 bytes of e2m1 pairs (low nibble = even
# index, as the MXFP4 weights) after the Hadamard rotation, then one ue8m0 scale per 32: V4 (Di 128) 68 bytes
# against 256. A ue8m0 byte b means 2^(b - 127).

def kv_fp8_entry_bytes(head_dim: int, rope_dim: int) -> int:
    nope = _check_nope(head_dim, rope_dim)
    return nope + 2 * rope_dim + padded8(nope // KV_FP8_BLOCK)


def indexer_fp4_entry_bytes(head_dim: int) -> int:
    if head_dim % MXFP4_BLOCK:
        raise ValueError(f"an FP4 indexer key needs a width divisible by {MXFP4_BLOCK}, got {head_dim}")
    return head_dim // 2 + head_dim // MXFP4_BLOCK


def pack_kv_fp8(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """uint8 entries [..., kv_fp8_entry_bytes] from entries kv [..., D] (bf16 or fp32; the rope values must be
    bf16-exact). The nope values are quantized here; storing values DeepSeek's simulation already rounded is exact."""
    nope = _check_nope(kv.shape[-1], rope_dim)
    grid, scale = quantize_groups(kv[..., :nope], KV_FP8_BLOCK, "e4m3")
    scales = torch.zeros(*kv.shape[:-1], padded8(nope // KV_FP8_BLOCK), dtype=torch.uint8, device=kv.device)
    scales[..., :scale.shape[-1]] = _e8m0_bytes(scale)
    rope = kv[..., nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([grid.to(torch.float8_e4m3fn).view(torch.uint8), rope, scales], dim=-1)


def unpack_kv_fp8(entries: torch.Tensor, head_dim: int, rope_dim: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Entries [..., D] in `dtype` from pack_kv_fp8's bytes."""
    nope = _check_nope(head_dim, rope_dim)
    values = entries[..., :nope].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    rope = entries[..., nope:nope + 2 * rope_dim].contiguous().view(torch.bfloat16).to(torch.float32)
    scale = _from_e8m0(entries[..., nope + 2 * rope_dim:nope + 2 * rope_dim + nope // KV_FP8_BLOCK])
    scaled = (values.unflatten(-1, (-1, KV_FP8_BLOCK)) * scale.unsqueeze(-1)).flatten(-2)
    return torch.cat([scaled, rope], dim=-1).to(dtype)


def pack_indexer_fp4(keys: torch.Tensor) -> torch.Tensor:
    """uint8 entries [..., Di / 2 + Di / 32] from indexer keys [..., Di] already rotated (hadamard_rotate)."""
    width = keys.shape[-1]
    indexer_fp4_entry_bytes(width)
    grid, scale = quantize_groups(keys, MXFP4_BLOCK, "e2m1")
    magnitude = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=keys.device)
    codes = (grid.abs().unsqueeze(-1) == magnitude).to(torch.uint8).argmax(-1).to(torch.uint8)
    codes |= (torch.signbit(grid).to(torch.uint8) << 3)
    return torch.cat([codes[..., 0::2] | (codes[..., 1::2] << 4), _e8m0_bytes(scale)], dim=-1)


def unpack_indexer_fp4(entries: torch.Tensor, head_dim: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Indexer keys [..., Di] in `dtype` from pack_indexer_fp4's bytes."""
    half = head_dim // 2
    values = dequantize_mxfp4(entries[..., :half].reshape(-1, half), entries[..., half:].reshape(-1, head_dim // 32))
    return values.view(*entries.shape[:-1], head_dim).to(dtype)


def _check_nope(head_dim: int, rope_dim: int) -> int:
    nope = head_dim - rope_dim
    if nope <= 0 or nope % KV_FP8_BLOCK:
        raise ValueError(f"the fp8 KV layout needs head_dim - rope_dim to be a positive multiple of {KV_FP8_BLOCK} "
                         f"(DeepSeek-V4: 512 - 64), got {head_dim} - {rope_dim}")
    return nope


def padded8(count: int) -> int:
    return -(-count // 8) * 8


def _e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales as ue8m0 bytes (the biased exponent)."""
    return ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def _from_e8m0(codes: torch.Tensor) -> torch.Tensor:
    return (codes.to(torch.int32) << 23).view(torch.float32)


# --- reading a pool of either kind (the references' side; the kernels decode in registers) -----------------------
def decode_kv_entries(stored: torch.Tensor, head_dim: int, rope_dim: int) -> torch.Tensor:
    """Stored attention entries [..., D] as float32 (exact: every stored value is a float32)."""
    if stored.dtype == torch.uint8:
        return unpack_kv_fp8(stored, head_dim, rope_dim, torch.float32)
    return stored.float()


def decode_indexer_keys(stored: torch.Tensor, head_dim: int) -> torch.Tensor:
    if stored.dtype == torch.uint8:
        return unpack_indexer_fp4(stored, head_dim, torch.float32)
    return stored.float()


# --- the same layouts decoded in a kernel's registers (Triton) ------------------------------------------------------
# Whether kernels are compiled (False under TRITON_INTERPRET, which has no inline assembly).
_COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))


@triton.jit
def as_decoded_tile(x):
    """x unchanged, marked for the compiler as a tile of its own type rather than one converted from narrower loads.
    Triton (3.6, 3.7: computeOrigBitWidth) follows pure elementwise ops from a tl.dot operand back to its loads and,
    finding bytes, lays the operand out for a conversion after shared memory (kWidth 4) that a tile decoded with its
    scales and rope values cannot take: the tile is then stored to shared memory once per dot and read back without
    ldmatrix. An opaque register move ends the trace, and a decoded tile is laid out as a
    loaded bf16 one. Found with scripts/check_kernels_compile.py --sass."""
    if _COMPILED:
        if x.dtype.primitive_bitwidth == 16:
            x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)
        else:
            x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=1)
    return x


@triton.jit
def load_kv_entries(pool_ptr, rope_ptr, page, slot, stride_page, stride_slot, mask, HEAD_DIM: tl.constexpr,
                    ROPE_DIM: tl.constexpr, FP8: tl.constexpr, DTYPE: tl.constexpr, ALIGN: tl.constexpr,
                    COL0: tl.constexpr, WIDTH: tl.constexpr):
    """Columns [COL0, COL0 + WIDTH) of the entries at (page, slot) (int64 pages, masked by `mask`) of a pool of
    HEAD_DIM-wide entries, [len(page), WIDTH] in DTYPE (the fp8 layout's: COL0 and WIDTH multiples of 64): its values,
    or for the fp8 layout (uint8 pool; rope_ptr the same memory as bf16) the tile decoded as FlashMLA's sparse fp8
    decode does: the e4m3 codes read with wide loads, converted once into DTYPE and multiplied by their group's ue8m0
    scale (an entry's scale bytes one 8-byte load, applied per 64-column group), the bf16 rope values added in their
    columns (each column holds one of the two, the other 0: exact; a select costs more). Exact: an e4m3 value times a
    power of two is a bf16. ALIGN: what the entries' byte offsets are multiples of (common.row_alignment of the
    strides: 8 for the layout's widths), a hint given on offsets computed here because Triton drops it on a helper's
    argument."""
    rows = page * stride_page + slot * stride_slot
    dims = COL0 + tl.arange(0, WIDTH)
    if FP8:
        NOPE: tl.constexpr = HEAD_DIM - ROPE_DIM
        GROUPS: tl.constexpr = WIDTH // 64  # the rope dims make whole groups too (NOPE, ROPE_DIM multiples of 64)
        rows = tl.multiple_of(rows, ALIGN)
        is_nope = dims < NOPE
        codes = tl.load(pool_ptr + rows[:, None] + dims[None, :], mask=mask[:, None] & is_nope[None, :], other=0)
        groups = COL0 // 64 + tl.arange(0, GROUPS)
        scale_codes = tl.load(pool_ptr + rows[:, None] + (NOPE + 2 * ROPE_DIM) + groups[None, :],
                              mask=mask[:, None] & (groups < NOPE // 64)[None, :], other=127)
        values = tl.reshape(codes.to(tl.float8e4nv, bitcast=True).to(DTYPE), [rows.shape[0], GROUPS, 64])
        nope = tl.reshape(values * ue8m0_value(scale_codes).to(DTYPE)[:, :, None], [rows.shape[0], WIDTH])
        rope = tl.load(rope_ptr + rows[:, None] // 2 + NOPE // 2 + (dims[None, :] - NOPE),
                       mask=mask[:, None] & ~is_nope[None, :], other=0.0)
        entries = as_decoded_tile(nope + rope.to(DTYPE))
    else:
        entries = tl.load(pool_ptr + rows[:, None] + dims[None, :], mask=mask[:, None], other=0.0).to(DTYPE)
    return entries


@triton.jit
def load_indexer_keys(pool_ptr, page, slot, stride_page, stride_slot, mask, HEAD_DIM: tl.constexpr, FP4: tl.constexpr,
                      DTYPE: tl.constexpr, ALIGN: tl.constexpr):
    """Indexer keys [len(page), HEAD_DIM] in DTYPE at (page, slot) (int64 pages, masked by `mask`) of a pool: its
    values, or for the FP4 layout (uint8) a tile decoded as the fp8 entries are (load_kv_entries): the code pairs and
    the entry's scale bytes read with wide loads (ALIGN as there: 4 bytes for V4's 68-byte keys), each e2m1 code
    moved into an e4m3 byte by shifts (sign to bit 7, exponent and mantissa to bits 4..2: the e4m3 value is the e2m1
    value times 2^-6, subnormals too), converted once into DTYPE and multiplied per 32-column group by its ue8m0 scale
    times 2^6. Exact, as the fp8 entries. On a GPU, in bf16 and with 4-byte aligned entries, the codes go straight to
    bf16 pairs instead, through inline asm (`_fp4_keys_to_bf16`: 2.9 instructions a value against 9)."""
    rows = page * stride_page + slot * stride_slot
    if FP4 and _COMPILED and DTYPE == tl.bfloat16 and ALIGN % 4 == 0:
        keys = _fp4_keys_to_bf16(pool_ptr, tl.multiple_of(rows, 4), mask, HEAD_DIM)
    elif FP4:
        GROUPS: tl.constexpr = HEAD_DIM // 32
        rows = tl.multiple_of(rows, ALIGN)
        pairs = tl.load(pool_ptr + rows[:, None] + tl.arange(0, HEAD_DIM // 2)[None, :], mask=mask[:, None], other=0)
        even = ((pairs & 0x8) << 4) | ((pairs & 0x7) << 2)  # low nibble: the even column
        odd = (pairs & 0x80) | ((pairs & 0x70) >> 2)
        e4m3 = tl.reshape(tl.join(even, odd), [rows.shape[0], GROUPS, 32]).to(tl.float8e4nv, bitcast=True)
        scale_codes = tl.load(pool_ptr + rows[:, None] + HEAD_DIM // 2 + tl.arange(0, GROUPS)[None, :],
                              mask=mask[:, None], other=127)
        scale = ue8m0_value(scale_codes.to(tl.int32) + 6).to(DTYPE)  # the 2^6 the e4m3 bytes are short of
        keys = as_decoded_tile(tl.reshape(e4m3.to(DTYPE) * scale[:, :, None], [rows.shape[0], HEAD_DIM]))
    else:
        dims = tl.arange(0, HEAD_DIM)
        keys = tl.load(pool_ptr + rows[:, None] + dims[None, :], mask=mask[:, None], other=0.0).to(DTYPE)
    return keys


# FP4 keys on a GPU: word w of a key (its bytes 4w..4w+3, the codes of columns 8w..8w+7, column 8w + j in bits 4j..4j+3)
# gives four bf16 pairs, pair j the columns 8w + j and 8w + j + 4 (both nibbles 16 bits apart, so that one shift and
# mask place both): the sign at bits 15 / 31, exponent and mantissa at 8..6 / 24..22 (the bf16 value fp4 x 2^-126,
# exact), times 2^126 and then the word's multiplier $3, its group's ue8m0 scale 2^(e - 127) in both halves (two
# multiplies: a key's scale may reach 2^126), each an fma adding -0.0 (sm_80 has no bf16 mul).
_FP4_PAIR_ASM = ("{ .reg .b32 t, u, c, z; %s or.b32 t, t, u; mov.b32 c, 0x7E807E80; mov.b32 z, 0x80008000; "
                 "fma.rn.bf16x2 t, t, c, z; fma.rn.bf16x2 $0, t, $3, z; }")
FP4_PAIR_ASM = tuple(_FP4_PAIR_ASM % bits for bits in (
    "shl.b32 t, $1, 6; and.b32 t, t, 0x01C001C0; shl.b32 u, $1, 12; and.b32 u, u, 0x80008000;",
    "shl.b32 t, $1, 2; and.b32 t, t, 0x01C001C0; shl.b32 u, $1, 8; and.b32 u, u, 0x80008000;",
    "shr.b32 t, $1, 2; and.b32 t, t, 0x01C001C0; shl.b32 u, $1, 4; and.b32 u, u, 0x80008000;",
    "shr.b32 t, $1, 6; and.b32 t, t, 0x01C001C0; and.b32 u, $1, 0x80008000;"))
_PAIR0_ASM, _PAIR1_ASM, _PAIR2_ASM, _PAIR3_ASM = (tl.constexpr(asm) for asm in FP4_PAIR_ASM)


@triton.jit
def _fp4_keys_to_bf16(pool_ptr, rows, mask, HEAD_DIM: tl.constexpr):
    """load_indexer_keys' FP4 tile in bf16 on a GPU: each key's codes read as int32 words (`rows`: 4-byte aligned
    byte offsets), each word's four pairs decoded by one asm instance each (FP4_PAIR_ASM), then the pairs' columns
    put in order in registers."""
    ROWS: tl.constexpr = rows.shape[0]
    WORDS: tl.constexpr = HEAD_DIM // 8
    words = tl.load((pool_ptr + rows[:, None]).to(tl.pointer_type(tl.int32)) + tl.arange(0, WORDS)[None, :],
                    mask=mask[:, None], other=0)
    codes = tl.load(pool_ptr + rows[:, None] + HEAD_DIM // 2 + tl.arange(0, HEAD_DIM // 32)[None, :],
                    mask=mask[:, None], other=127).to(tl.int32)
    multipliers = tl.reshape(tl.broadcast_to((codes * 0x00800080)[:, :, None], [ROWS, HEAD_DIM // 32, 4]),
                             [ROWS, WORDS])  # 2^(e - 127) twice, for the group's four words
    doubled, doubled_multipliers = _doubled(words), _doubled(multipliers)
    pair0 = tl.reshape(_pairs_asm(doubled, doubled_multipliers, _PAIR0_ASM), [ROWS, WORDS, 2])
    pair1 = tl.reshape(_pairs_asm(doubled, doubled_multipliers, _PAIR1_ASM), [ROWS, WORDS, 2])
    pair2 = tl.reshape(_pairs_asm(doubled, doubled_multipliers, _PAIR2_ASM), [ROWS, WORDS, 2])
    pair3 = tl.reshape(_pairs_asm(doubled, doubled_multipliers, _PAIR3_ASM), [ROWS, WORDS, 2])
    return fp4_pairs_in_column_order(pair0, pair1, pair2, pair3)


@triton.jit
def fp4_pairs_in_column_order(pair0, pair1, pair2, pair3):
    """[ROWS, WORDS * 8] from the pairs [ROWS, WORDS, 2] of each word's pair j, the columns 8w + j and 8w + j + 4:
    a permutation within each thread's registers (a word's pairs are one thread's)."""
    ROWS: tl.constexpr = pair0.shape[0]
    tile = tl.join(tl.join(pair0, pair1), tl.join(pair2, pair3))  # [ROWS, WORDS, lane, j % 2, j // 2]
    return tl.reshape(tl.permute(tile, (0, 1, 2, 4, 3)), [ROWS, pair0.shape[1] * 8])  # column 8w + 4 lane + j


@triton.jit
def _doubled(x):
    """[R, C] -> [R, 2C], each element twice in a row: what a pair-writing asm instance takes (pack=2) to read one
    element (a word, a multiplier) of each of its inputs and write one bf16 pair."""
    return tl.join(x, x).reshape(x.shape[0], 2 * x.shape[1])


@triton.jit
def _pairs_asm(doubled, multipliers, ASM: tl.constexpr):
    """An FP4 decode's asm over `_doubled` words and multipliers (broadcast to them, each also twice): bf16 [R, 2C],
    columns 2w and 2w + 1 the pair written from word w."""
    return tl.inline_asm_elementwise(ASM, "=r,r,r,r,r", [doubled, multipliers], dtype=tl.bfloat16, is_pure=True,
                                     pack=2)


# e4m3 weights on a GPU, straight to bf16 without a conversion instruction (Hopper converts 16 values a clock per SM,
# one per byte of the weights a bandwidth-bound loop streams: a decode through f16 and f32 took two): word w (bytes
# 4w..4w+3, column 4w + j in byte j) gives two bf16 pairs, pair h the columns 4w + 2h and 4w + 2h + 1. A byte permute
# puts its two bytes at bits 8..15 / 24..31; the sign stays there, exponent and mantissa move 4 bits down to 4..10 /
# 20..26 (the bf16 value e4m3 x 2^-120, subnormals too), and a multiply by 2^120 restores it (an fma adding -0.0:
# sm_80 has no bf16 mul). Exact for every finite code (the NaN codes 0x7F / 0xFF give +-480).
_E4M3_PAIR_ASM = ("{ .reg .b32 t, u, m, z; mov.b32 u, 0; prmt.b32 t, $1, u, %s; shr.b32 u, t, 4; "
                  "and.b32 u, u, 0x07F007F0; and.b32 t, t, 0x80008000; or.b32 t, t, u; mov.b32 m, 0x7B807B80; "
                  "mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, t, m, z; }")
E4M3_PAIR_ASM = tuple(_E4M3_PAIR_ASM % selector for selector in ("0x1404", "0x3424"))  # bytes 0, 1 / 2, 3
_E4M3_LOW_ASM, _E4M3_HIGH_ASM = (tl.constexpr(asm) for asm in E4M3_PAIR_ASM)


@triton.jit
def e4m3_words_to_values(words, DTYPE: tl.constexpr):
    """words [R, W] int32 of e4m3 codes (column 4w + j in byte j of word w) -> their values [R, 4W] in DTYPE, exact.
    On a GPU in bf16 each word's pairs come from one asm instance each (E4M3_PAIR_ASM); elsewhere each code is cast."""
    ROWS: tl.constexpr = words.shape[0]
    w = words.to(tl.uint32, bitcast=True)
    if _COMPILED and DTYPE == tl.bfloat16:
        doubled = _doubled(w)
        low = tl.inline_asm_elementwise(_E4M3_LOW_ASM, "=r,r,r", [doubled], dtype=tl.bfloat16, is_pure=True, pack=2)
        high = tl.inline_asm_elementwise(_E4M3_HIGH_ASM, "=r,r,r", [doubled], dtype=tl.bfloat16, is_pure=True,
                                         pack=2)
    else:
        low, high = _e4m3_pair(w, 0, DTYPE), _e4m3_pair(w, 16, DTYPE)
    pairs = tl.join(tl.reshape(low, [ROWS, words.shape[1], 2]), tl.reshape(high, [ROWS, words.shape[1], 2]))
    return tl.reshape(tl.permute(pairs, (0, 1, 3, 2)), [ROWS, 4 * words.shape[1]])  # column 4w + 2h + lane


@triton.jit
def _e4m3_pair(w, SHIFT: tl.constexpr, DTYPE: tl.constexpr):
    """The pair of codes at bits SHIFT..SHIFT + 15 of words [R, W] (uint32) -> [R, 2W] values, columns 2w and 2w + 1
    the lower and the higher code: what an E4M3_PAIR_ASM instance writes."""
    lower = ((w >> SHIFT) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    higher = ((w >> (SHIFT + 8)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.join(lower, higher).reshape(w.shape[0], 2 * w.shape[1]).to(DTYPE)


@triton.jit
def e2m1_value(code):
    """The float32 values of e2m1 codes (int32, 4 bits: sign, 2 exponent bits, 1 mantissa bit): +-0, 0.5, 1, 1.5, 2,
    3, 4, 6 (FP4_VALUES), computed rather than looked up."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def e4m3_groups(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """DeepSeek's act_quant of a float32 tile [ROWS, COLS] in groups of 128 columns (COLS % 128 == 0): (values on the
    e4m3 grid [ROWS, COLS] as float32, each group's power-of-two scale [ROWS, COLS // 128]); `quantize_groups(x, 128,
    "e4m3")` in registers."""
    groups = tl.reshape(x, [ROWS, COLS // 128, 128])
    _, scale = e4m3_scale_codes(tl.max(tl.abs(groups), 2))
    grid = round_to_e4m3(tl.clamp(groups / scale[:, :, None], -448.0, 448.0))
    return tl.reshape(grid, [ROWS, COLS]), scale


@triton.jit
def hadamard_rows(x, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    """`hadamard_rotate`'s butterflies on a float32 tile [ROWS, N] (N = 2^LOG_N), without its final scale: stage h
    pairs columns (i, i + h) within blocks of 2h into (sum, difference), as the reference's float32 sums."""
    for stage in tl.static_range(LOG_N):  # h = 2^stage
        pairs = tl.permute(tl.reshape(x, [ROWS, N >> (stage + 1), 2, 1 << stage]), [0, 1, 3, 2])  # [.., h, 2]
        first, second = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(first + second, first - second), [0, 1, 3, 2]), [ROWS, N])
    return x


@triton.jit
def e2m1_groups(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """DeepSeek's fp4_act_quant of a float32 tile [ROWS, COLS] in groups of 32 columns: (magnitudes on the e2m1 grid
    [ROWS, COLS // 32, 32] as float32, their ue8m0 codes [ROWS, COLS // 32], their scales); `quantize_groups(x, 32,
    "e2m1")` in registers, less the signs (the caller's: x's sign bits, -0.0 included, as torch's copysign)."""
    groups = tl.reshape(x, [ROWS, COLS // 32, 32])
    codes, scale = ue8m0_scale_codes(tl.max(tl.abs(groups), 2), 6.0 * 2.0 ** -126, 6.0)
    magnitude = tl.minimum(tl.abs(groups) / scale[:, :, None], 6.0)
    step = tl.where(magnitude < 2.0, 0.5, tl.where(magnitude < 4.0, 1.0, 2.0))
    rounded = ((magnitude / step + 12582912.0) - 12582912.0) * step  # fp32 round half to even, on the binade's grid
    return rounded, codes, scale


@triton.jit
def e2m1_values(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """`simulate_quantization(x, 32, "e2m1")` of a float32 tile [ROWS, COLS]: each value on the e2m1 grid times its
    group's scale, x's sign kept (-0.0 too), float32."""
    magnitude, _, scale = e2m1_groups(x, ROWS, COLS)
    values = tl.reshape(magnitude * scale[:, :, None], [ROWS, COLS])
    return (values.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32,
                                                                                                    bitcast=True)


@triton.jit
def indexer_rounded(x, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr, DTYPE: tl.constexpr):
    """`simulate_indexer_fp4` of a float32 tile [ROWS, N] holding DTYPE values: rotated, then e2m1 per 32 (float32
    holding DTYPE values)."""
    return e2m1_values(rotate_rows(x, ROWS, N, LOG_N, DTYPE), ROWS, N)


@triton.jit
def rotate_rows(x, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr, DTYPE: tl.constexpr):
    """`hadamard_rotate` of a float32 tile [ROWS, N] whose rows are the vectors, rounded to DTYPE (kept float32)."""
    return round_to_dtype(hadamard_rows(x, ROWS, N, LOG_N) * (N ** -0.5), DTYPE)


@triton.jit
def round_to_dtype(v, DTYPE: tl.constexpr):
    """float32 values rounded to DTYPE (to nearest, ties to even) and back to float32: the rounding a store in DTYPE
    makes, kept in registers. bf16 from the bits, because the interpreter's float32 -> bf16 cast truncates."""
    if DTYPE == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    else:
        return v.to(DTYPE).to(tl.float32)


@triton.jit
def mxfp4_words_to_values(words, scale_words, DTYPE: tl.constexpr):
    """One 128-wide K chunk of `repack_mxfp4`'s layout, words [R, 16] int32 and scale_words [R] int32 (the chunk's four
    e8m0 codes, group j in byte j), as values [R, 128] in DTYPE: 1 to 6 integer operations per word and group, then
    one multiply per value pair; bf16 on a GPU by inline asm (`_mxfp4_words_to_bf16`), the same operations."""
    w = words.to(tl.uint32, bitcast=True)
    codes = scale_words.to(tl.uint32, bitcast=True)
    if _COMPILED and DTYPE == tl.bfloat16:
        values = _mxfp4_words_to_bf16(w, codes)
    else:
        group0 = _mxfp4_group(w & 0x81C081C0, codes & 0xFF, DTYPE)
        group1 = _mxfp4_group((w << 3) & 0x81C081C0, (codes >> 8) & 0xFF, DTYPE)
        group2 = _mxfp4_group((w << 6) & 0x81C081C0, (codes >> 16) & 0xFF, DTYPE)
        group3 = _mxfp4_group(((w << 1) & 0x80008000) | ((w >> 5) & 0x01000100) | ((w >> 4) & 0x00C000C0),
                              codes >> 24, DTYPE)
        values = concat_columns(concat_columns(group0, group1), concat_columns(group2, group3))
    return values


# Group j of a word as PTX: its pair of bf16 bit patterns from the word $1 into t (the masks of
# mxfp4_words_to_values), times its multiplier, one bf16 half of $3 taken for both values, into $0 (an fma adding
# -0.0, which keeps every product and its sign: sm_80 has no bf16 mul). An instance takes two elements of each input
# (pack=2): the word and the multipliers twice each (`_mxfp4_words_to_bf16`).
_MXFP4_ASM = ("{ .reg .b32 t, u, m, z; .reg .b16 lo, hi; %s mov.b32 {lo, hi}, $3; mov.b32 m, {%s, %s}; "
              "mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, t, m, z; }")
MXFP4_GROUP_ASM = (
    _MXFP4_ASM % ("and.b32 t, $1, 0x81C081C0;", "lo", "lo"),
    _MXFP4_ASM % ("shl.b32 t, $1, 3; and.b32 t, t, 0x81C081C0;", "lo", "lo"),
    _MXFP4_ASM % ("shl.b32 t, $1, 6; and.b32 t, t, 0x81C081C0;", "hi", "hi"),
    _MXFP4_ASM % ("shl.b32 t, $1, 1; and.b32 t, t, 0x80008000; shr.b32 u, $1, 5; and.b32 u, u, 0x01000100; "
                  "or.b32 t, t, u; shr.b32 u, $1, 4; and.b32 u, u, 0x00C000C0; or.b32 t, t, u;", "hi", "hi"),
)
_GROUP0_ASM, _GROUP1_ASM, _GROUP2_ASM, _GROUP3_ASM = (tl.constexpr(asm) for asm in MXFP4_GROUP_ASM)


@triton.jit
def mxfp4_multiplier_pairs(codes):
    """The multipliers 2^(e - 1) of a chunk's scale words (int32 [R], group j's e8m0 code e in byte j) as bf16 bits,
    two to an int32: (groups 0 and 2, groups 1 and 3), each code moved into a half's exponent field and 126 added
    there (e <= 128 keeps the field below 255)."""
    even = ((codes << 7) & 0x7F807F80) + 0x3F003F00
    odd = ((codes >> 1) & 0x7F807F80) + 0x3F003F00
    return even, odd


@triton.jit
def _mxfp4_words_to_bf16(w, codes):
    """mxfp4_words_to_values in bf16 on a GPU, each group's pair masked and scaled by one asm instance into the one
    register the MMA takes (the pair k = 2 w, 2 w + 1 of the group, from word w)."""
    doubled = _doubled(w)
    even, odd = mxfp4_multiplier_pairs(codes)
    group0 = _pairs_asm(doubled, even[:, None], _GROUP0_ASM)
    group1 = _pairs_asm(doubled, odd[:, None], _GROUP1_ASM)
    group2 = _pairs_asm(doubled, even[:, None], _GROUP2_ASM)
    group3 = _pairs_asm(doubled, odd[:, None], _GROUP3_ASM)
    return concat_columns(concat_columns(group0, group1), concat_columns(group2, group3))


@triton.jit
def _mxfp4_group(pairs, code, DTYPE: tl.constexpr):
    """Words [R, 16] each holding the bf16 bit patterns (fp4 x 2^-126) of the pair k = 2 w, 2 w + 1 in its low and high
    16 bits -> [R, 32] values times 2^(code - 127): the multiplier 2^(code - 1) also restores the 2^126."""
    ROWS: tl.constexpr = pairs.shape[0]
    bits = tl.join((pairs & 0xFFFF).to(tl.uint16), (pairs >> 16).to(tl.uint16)).reshape(ROWS, 2 * pairs.shape[1])
    if DTYPE == tl.float32:  # the bf16 patterns widened by their bits (the interpreter's cast drops subnormals)
        values = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        values = bits.to(tl.bfloat16, bitcast=True).to(DTYPE)
    multiplier = ((code.to(tl.int32) + 126) << 23).to(tl.float32, bitcast=True)
    return values * multiplier.to(DTYPE)[:, None]


@triton.jit
def concat_columns(a, b):
    """[R, C] and [R, C] -> [R, 2C], a's columns first (a join: no data moves between threads)."""
    ROWS: tl.constexpr = a.shape[0]
    return tl.join(a, b).permute(0, 2, 1).reshape(ROWS, 2 * a.shape[1])


@triton.jit
def ue8m0_scale_codes(amax, FLOOR: tl.constexpr, MAX: tl.constexpr):
    """(ue8m0 codes int32, scales float32) of groups with these amax: 2^ceil(log2(max(amax, FLOOR) * fl32(1/MAX)))
    from the float32 bits, as `power_of_two_scale` (DeepSeek's fast_round_scale)."""
    bits = (tl.maximum(amax, FLOOR) * (1.0 / MAX)).to(tl.int32, bitcast=True)
    codes = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return codes, ue8m0_value(codes)


@triton.jit
def ue8m0_value(codes):
    """The float32 power of two ue8m0 codes (int) stand for: 2^(code - 127), from the bits."""
    return (codes.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_scale_codes(amax):
    """`ue8m0_scale_codes` of e4m3 groups (DeepSeek's act_quant: amax floored at 1e-4, max 448)."""
    return ue8m0_scale_codes(amax, 1e-4, 448.0)


@triton.jit
def round_to_e4m3(v):
    """float32 values in [-448, 448] rounded to the nearest e4m3 value, ties to even, keeping the sign (of a zero too):
    |v| / ulp rounded to an integer with the 1.5 * 2^23 trick (fp32 round-to-nearest-even), ulp = 2^(exponent - 3),
    subnormals' 2^-9. Arithmetic
    rather than a cast to float8e4nv, whose emulation under the interpreter mis-rounds values that round up into
    the next binade (exact values cast exactly)."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    ulp = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magnitude = ((tl.abs(v) / ulp + 12582912.0) - 12582912.0) * ulp
    return (magnitude.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # v's sign
