"""The token-bitmask kernel (kernels/token_bitmask.py) against its reference (under the interpreter on CPU, compiled
with DSV4_TEST_DEVICE=cuda), and the reference against XGrammar's own `apply_token_bitmask_inplace` on CPU, the
layout's definition (XGrammar is pinned in requirements.txt; a bare GPU machine may lack it)."""

from __future__ import annotations

import pytest
import torch

from kernels.token_bitmask import (allowed_tokens, apply_token_bitmask_reference, apply_token_bitmask_triton,
                                   bitmask_words)


def _case(batch: int, vocab: int, rows: list[int], dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    words = bitmask_words(vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int64).to(torch.int32)
    if rows:  # edge words: all allowed, none allowed
        bitmask[0, 0] = -1
        bitmask[-1, -1] = 0
    return logits, bitmask, torch.tensor(rows, dtype=torch.long)


CASES = pytest.mark.parametrize("vocab,dtype,rows", [
    (vocab, dtype, rows) for vocab in (512, 1000, 129280) for dtype in (torch.float32, torch.bfloat16)
    for rows in ([0, 2, 3], [1], [])])


@CASES
def test_kernel_matches_the_reference_and_leaves_other_rows_alone(vocab, dtype, rows):
    logits, bitmask, row_ids = _case(4, vocab, rows, dtype)
    expected = logits.clone()
    apply_token_bitmask_reference(expected, bitmask, row_ids)
    got = logits.clone()
    apply_token_bitmask_triton(got, bitmask, row_ids)
    assert torch.equal(got, expected)
    untouched = [r for r in range(4) if r not in rows]
    assert torch.equal(got[untouched], logits[untouched])


@CASES
def test_the_reference_is_xgrammars_layout(vocab, dtype, rows):
    xgr = pytest.importorskip("xgrammar")
    logits, bitmask, row_ids = (t.cpu() for t in _case(4, vocab, rows, dtype))
    expected = logits.clone()
    apply_token_bitmask_reference(expected, bitmask, row_ids)
    oracle = logits.float().clone()  # XGrammar's CPU path: float32 logits, a full-width mask per listed row
    full = torch.full((4, bitmask.shape[1]), -1, dtype=torch.int32, device="cpu")
    full[row_ids] = bitmask
    if rows:
        xgr.apply_token_bitmask_inplace(oracle, full, indices=rows)
    assert torch.equal(expected.float(), oracle)


def test_allowed_tokens_reads_bit_j_of_word_w_as_token_32w_plus_j():
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5
    bitmask[0, 1] = -2**31  # the sign bit: token 63
    allowed = allowed_tokens(bitmask, 64)
    assert allowed[0].nonzero().flatten().tolist() == [5, 63]


def test_logits_wider_than_the_mask_keep_their_extra_columns():
    logits = torch.randn(2, 70)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)  # 64 tokens, none allowed
    got = logits.clone()
    apply_token_bitmask_triton(got, bitmask, torch.tensor([1]))
    assert torch.isinf(got[1, :64]).all() and torch.equal(got[1, 64:], logits[1, 64:])
    assert torch.equal(got[0], logits[0])
