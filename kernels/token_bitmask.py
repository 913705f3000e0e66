"""Structured outputs: apply a grammar's next-token bitmask to the logits, in place, in one launch.

The bitmask is XGrammar's layout: int32 words [R, W], W = cdiv(V, 32); bit j of word w allows token 32 * w + j
(bit set: allowed). Row r of the bitmask masks logits row `rows[r]`: only the constrained rows of a step are
touched. A token that is not allowed gets -inf; a logit column past the bitmask's 32 * W tokens is left alone
(the model's vocabulary is never wider than the mask built for it).

`rows` and `bitmask` are device tensors the caller filled (the bitmask copied from pinned host memory without
waiting): nothing here reads data on the host, so applying the mask never syncs with the device.

Kernel `_apply_token_bitmask_kernel`, grid (R, cdiv(V, BLOCK_V)): a program owns BLOCK_V columns of one masked
row, loads the BLOCK_V / 32 words that cover them once and broadcasts each bit to its column. V and the row stride
are specialised (they are the model's), R is not: a new count of constrained rows never recompiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import launch, wait_for_previous_kernel

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    return triton.cdiv(vocab_size, BITS_PER_WORD)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size] from int32 words [R, W]: bit j of word w says whether token 32 * w + j is allowed."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [B, V] in place: row rows[r] gets -inf at every token bitmask[r] does not allow."""
    if rows.numel() == 0:
        return
    width = min(logits.shape[1], bitmask.shape[1] * BITS_PER_WORD)
    allowed = allowed_tokens(bitmask, width)
    masked = logits[rows, :width].masked_fill(~allowed, float("-inf"))
    logits[rows, :width] = masked


@triton.jit(do_not_specialize=["num_rows"])
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, num_rows, stride_logits, stride_mask,
                                WIDTH: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = cols < WIDTH
    words = tl.load(bitmask_ptr + r * stride_mask + cols // 32, mask=inside, other=-1)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_logits + cols, tl.full((BLOCK_V,), float("-inf"), tl.float32)
             .to(logits_ptr.dtype.element_ty), mask=inside & ~allowed)


def plan_apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor):
    """Check the layouts; return the launches: one (none without rows), grid (R, cdiv(width, BLOCK_V))."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [B, V] with a contiguous last dimension"
    assert bitmask.dtype == torch.int32 and bitmask.dim() == 2 and bitmask.stride(1) == 1, \
        f"bitmask must be int32 [R, W] with contiguous rows, got {bitmask.dtype} {tuple(bitmask.shape)}"
    assert rows.dim() == 1 and rows.shape[0] == bitmask.shape[0], "one logits row per bitmask row"
    num_rows = rows.shape[0]
    if num_rows == 0:
        return []
    width = min(logits.shape[1], bitmask.shape[1] * BITS_PER_WORD)
    block_v = min(4096, triton.next_power_of_2(width))
    grid = (num_rows, triton.cdiv(width, block_v))
    args = (logits, bitmask, rows, num_rows, logits.stride(0), bitmask.stride(0))
    return [(_apply_token_bitmask_kernel, grid, args, dict(WIDTH=width, BLOCK_V=block_v, num_warps=4))]


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    launch(plan_apply_token_bitmask(logits, bitmask, rows))
