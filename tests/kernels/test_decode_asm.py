"""The decodes a GPU runs: the inline asm of kernels/quant_formats.py (the MXFP4 experts' MXFP4_GROUP_ASM, the
indexer's FP4 keys' FP4_PAIR_ASM, the grouped o_a's e4m3 E4M3_PAIR_ASM), which the interpreter cannot run.

Their PTX is run here by a small emulator of the instructions they use, on words and scales as the kernels read
them, and must give the published weights and the stored keys exactly; the multipliers the MXFP4 decode reads come
from `mxfp4_multiplier_pairs`, run as a kernel. scripts/check_kernels_compile.py checks the other half, that each
compiled asm instance takes one word twice (`decode_asm_problem`)."""

from __future__ import annotations

import re

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.quant_formats import (E4M3_PAIR_ASM, FP4_PAIR_ASM, MXFP4_CHUNK, MXFP4_GROUP_ASM, dequantize_mxfp4,
                                   fp4_pairs_in_column_order, mxfp4_multiplier_pairs, pack_indexer_fp4, repack_mxfp4,
                                   unpack_indexer_fp4)

# Which multiplier register each group's asm reads (_mxfp4_words_to_bf16): groups 0 and 2 the even one, 1 and 3 odd.
MULTIPLIERS_OF_GROUP = ("even", "odd", "even", "odd")


def run_ptx(asm: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """$0 of an asm instance made of the instructions the decode uses (and, or, shl, shr, prmt, mov of b32 values, of
    immediates and of b16 halves, fma.rn.bf16x2), every register a uint32 (b16: the low 16 bits) array."""
    regs = {name: value.astype(np.uint64) for name, value in inputs.items()}
    shape = inputs["$1"].shape

    def read(operand: str) -> np.ndarray:
        if operand.startswith("{"):  # two b16 registers packed into a b32, the first the low half
            lo, hi = (regs[name.strip()] for name in operand.strip("{}").split(","))
            return lo | (hi << 16)
        return np.full(shape, int(operand, 0), dtype=np.uint64) if operand[0].isdigit() else regs[operand]

    for statement in asm.strip().strip("{}").split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        opcode, rest = statement.split(None, 1)
        dest, *args = re.findall(r"\{[^}]*\}|[^,\s]+", rest)
        values = [read(arg) for arg in args]
        if opcode == "mov.b32" and dest.startswith("{"):  # unpack into halves
            lo, hi = (name.strip() for name in dest.strip("{}").split(","))
            regs[lo], regs[hi] = values[0] & 0xFFFF, values[0] >> 16
            continue
        if opcode == "mov.b32":
            result = values[0]
        elif opcode == "and.b32":
            result = values[0] & values[1]
        elif opcode == "or.b32":
            result = values[0] | values[1]
        elif opcode == "shl.b32":
            result = (values[0] << values[1]) & 0xFFFFFFFF
        elif opcode == "shr.b32":
            result = values[0] >> values[1]
        elif opcode == "prmt.b32":  # result byte i: byte (selector nibble i) of b:a (the replicating modes not used)
            a, b, selector = values
            both = a | (b << 32)
            assert not (selector & 0x8888).any(), "a sign-replicating selector"
            result = sum(((both >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif opcode == "fma.rn.bf16x2":  # each half a * b + c in float64, to bf16 through float32 (exact here)
            a, b, c = values
            result = _bf16(_float(a & 0xFFFF).astype(np.float64) * _float(b & 0xFFFF) + _float(c & 0xFFFF)) | \
                (_bf16(_float(a >> 16).astype(np.float64) * _float(b >> 16) + _float(c >> 16)) << 16)
        else:
            raise AssertionError(f"the emulator does not know {opcode}")
        regs[dest] = result
    return regs["$0"].astype(np.uint32)


def _float(bf16_bits: np.ndarray) -> np.ndarray:
    return (bf16_bits.astype(np.uint32) << 16).view(np.float32)


def _bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, to nearest, ties to even."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def _multiplier_pairs_kernel(codes_ptr, even_ptr, odd_ptr, ROWS: tl.constexpr):
    rows = tl.arange(0, ROWS)
    even, odd = mxfp4_multiplier_pairs(tl.load(codes_ptr + rows).to(tl.uint32, bitcast=True))
    tl.store(even_ptr + rows, even.to(tl.int32, bitcast=True))
    tl.store(odd_ptr + rows, odd.to(tl.int32, bitcast=True))


def multiplier_pairs(scale_words: torch.Tensor) -> dict[str, np.ndarray]:
    """The kernel's (even, odd) multiplier registers of each int32 scale word [R] (R a power of two)."""
    even, odd = torch.empty_like(scale_words), torch.empty_like(scale_words)
    _multiplier_pairs_kernel[(1,)](scale_words, even, odd, ROWS=scale_words.numel())
    return {"even": even.cpu().numpy().view(np.uint32), "odd": odd.cpu().numpy().view(np.uint32)}


def decode_like_the_gpu(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W [N, Kp] float32 from repack_mxfp4's (words [N, Kp / 8], scales [N, Kp / 32]) through the decode's asm."""
    n, chunks = words.shape[0], words.shape[1] // 16
    scale_words = scales.view(n, chunks, 4).contiguous().view(torch.int32).reshape(-1)  # byte j = group j
    pairs = multiplier_pairs(scale_words)
    w = words.cpu().numpy().view(np.uint32).reshape(n * chunks, 16)
    groups = []
    for asm, which in zip(MXFP4_GROUP_ASM, MULTIPLIERS_OF_GROUP):
        multiplier = np.repeat(pairs[which][:, None], 16, axis=1)
        out = run_ptx(asm, {"$1": w, "$2": w, "$3": multiplier, "$4": multiplier})  # [R, 16] bf16 pairs
        groups.append(np.stack((out & 0xFFFF, out >> 16), axis=-1).reshape(n * chunks, 32))  # k = 2 w + lane
    bits = np.concatenate(groups, axis=1).reshape(n, chunks * MXFP4_CHUNK)  # k = 32 j + 2 w + lane in a chunk
    return torch.from_numpy(_float(bits))


def test_the_gpus_decode_asm_gives_the_published_weights():
    """Every e2m1 code in both nibbles of every group, with the extreme scale codes 0 (2^-127, the products bf16
    subnormals) and 128, decode to exactly the published weights."""
    gen = torch.Generator().manual_seed(4)
    n, k = 16, 256
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    codes[0] = torch.arange(k // 2, dtype=torch.uint8) * 2  # every byte value over rows 0 and 1
    codes[1] = codes[0] + 1
    scales = torch.randint(100, 129, (n, k // 32), generator=gen, dtype=torch.uint8)
    scales[2], scales[3] = 0, 128
    words, padded = repack_mxfp4(codes, scales)
    decoded = decode_like_the_gpu(words, padded)
    expected = dequantize_mxfp4(codes, scales).cpu()
    assert torch.equal(decoded, expected)
    assert torch.equal(torch.signbit(decoded), torch.signbit(expected))  # negative zeros stay negative


def test_the_emulator_sees_a_wrong_mask():
    """A mask off by one bit in one group's asm changes the weights: the check above can fail."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (4, 64), generator=gen, dtype=torch.uint8)
    words, padded = repack_mxfp4(codes, torch.full((4, 4), 120, dtype=torch.uint8))
    w = words.cpu().numpy().view(np.uint32).reshape(-1, 16)
    multiplier = np.full_like(w, 0x3F803F80)  # 1.0 in both halves
    inputs = {"$1": w, "$2": w, "$3": multiplier, "$4": multiplier}
    broken = MXFP4_GROUP_ASM[1].replace("0x81C081C0", "0x81C081E0")
    assert not np.array_equal(run_ptx(broken, inputs), run_ptx(MXFP4_GROUP_ASM[1], inputs))


def decode_keys_like_the_gpu(entries: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Keys [N, head_dim] float32 from FP4 entries [N, head_dim / 2 + head_dim / 32] through the decode's asm: each
    int32 word of codes and its group's multiplier (the e8m0 code e times 0x00800080, as the kernel computes it)."""
    entries = entries.cpu()
    n, words_per_key = entries.shape[0], head_dim // 8
    words = entries[:, :head_dim // 2].contiguous().view(torch.int32).numpy().view(np.uint32)  # [N, words]
    codes = entries[:, head_dim // 2:].to(torch.int64).numpy()
    multipliers = np.repeat(codes * 0x00800080, 4, axis=1).astype(np.uint32)  # a group's four words
    keys = np.zeros((n, words_per_key, 8), dtype=np.uint64)
    for j, asm in enumerate(FP4_PAIR_ASM):
        out = run_ptx(asm, {"$1": words, "$2": words, "$3": multipliers, "$4": multipliers})
        keys[:, :, j], keys[:, :, j + 4] = out & 0xFFFF, out >> 16  # pair j: columns 8w + j and 8w + j + 4
    return torch.from_numpy(_float(keys.reshape(n, head_dim)))


def test_the_gpus_fp4_key_decode_asm_gives_the_stored_keys():
    """Keys of every magnitude the quantizer gives (scale codes from the floor's 1 to float32's largest, 253: the
    decode multiplies by 2^126 and by the scale apart) decode to exactly what the entries hold."""
    gen = torch.Generator().manual_seed(6)
    head_dim = 128
    keys = torch.randn(24, head_dim, generator=gen) * torch.logspace(-30, 30, 24, base=2.0)[:, None]
    keys[0] = 0.0  # the amax floor: scale code 1
    keys[1, :32] = 1.51 * 2.0 ** 127  # scale code 253 (amax / 6 above 2^125), rounded to 3 x 2^126
    keys[2, ::3] = -0.0
    entries = pack_indexer_fp4(keys.to(torch.get_default_device()))
    assert {1, 253} <= set(entries[:, head_dim // 2:].flatten().tolist())
    decoded = decode_keys_like_the_gpu(entries, head_dim)
    expected = unpack_indexer_fp4(entries, head_dim, torch.float32).cpu()
    assert torch.isfinite(decoded).all() and torch.equal(decoded, expected)
    assert torch.equal(torch.signbit(decoded), torch.signbit(expected))


@triton.jit
def _pairs_in_order_kernel(out_ptr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None, None]
    words = tl.arange(0, WORDS)[None, :, None]
    lanes = tl.arange(0, 2)[None, None, :]
    column = (8 * words + 4 * lanes + rows * 0).to(tl.float32)  # pair j holds columns 8w + j, 8w + j + 4
    tile = fp4_pairs_in_column_order(column, column + 1, column + 2, column + 3)
    tl.store(out_ptr + tl.arange(0, ROWS)[:, None] * WORDS * 8 + tl.arange(0, WORDS * 8)[None, :], tile)


def test_the_fp4_key_decode_puts_each_pair_in_its_columns():
    """The GPU decode's pairs (pair j of word w: columns 8w + j and 8w + j + 4) land in column order."""
    out = torch.empty(4, 128)
    _pairs_in_order_kernel[(1,)](out, ROWS=4, WORDS=16)
    assert torch.equal(out.cpu(), torch.arange(128.0).expand(4, 128))


def decode_e4m3_like_the_gpu(words: np.ndarray) -> np.ndarray:
    """float32 values [N, 4] of uint32 words [N] (byte j the code of column j) through E4M3_PAIR_ASM (pair h: the
    columns 2h and 2h + 1)."""
    out = np.zeros((len(words), 4), dtype=np.uint64)
    for h, asm in enumerate(E4M3_PAIR_ASM):
        pair = run_ptx(asm, {"$1": words, "$2": words})
        out[:, 2 * h], out[:, 2 * h + 1] = pair & 0xFFFF, pair >> 16
    return _float(out)


def test_the_gpus_e4m3_decode_asm_gives_every_codes_value():
    """Every pair of e4m3 codes (65,536 words, each pair of codes in both halves of a word), subnormals and negative
    zero included, decodes to the code's value; the NaN codes, which no weight holds, to +-480."""
    codes = np.arange(256, dtype=np.uint32)
    first, second = np.repeat(codes, 256), np.tile(codes, 256)
    words = first | (second << 8) | (second << 16) | (first << 24)
    decoded = torch.from_numpy(decode_e4m3_like_the_gpu(words))
    byte_values = torch.from_numpy(codes.astype(np.uint8)).view(torch.float8_e4m3fn).float()
    byte_values[[0x7F, 0xFF]] = torch.tensor([480.0, -480.0])
    expected = torch.stack([byte_values[torch.from_numpy(c.astype(np.int64))] for c in (first, second, second, first)],
                           dim=1)
    assert torch.equal(decoded, expected)
    assert torch.equal(torch.signbit(decoded), torch.signbit(expected))


def test_the_emulator_sees_a_wrong_e4m3_selector():
    """Pairs taken from the wrong bytes change the values: the check above can fail."""
    words = np.arange(1, 1 << 16, 97, dtype=np.uint32) * 0x10001
    broken = E4M3_PAIR_ASM[1].replace("0x3424", "0x2434")
    assert not np.array_equal(run_ptx(broken, {"$1": words, "$2": words}),
                              run_ptx(E4M3_PAIR_ASM[1], {"$1": words, "$2": words}))
