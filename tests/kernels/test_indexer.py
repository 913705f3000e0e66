"""indexer_scores_triton against indexer_scores_reference, on CPU under the interpreter.

Batches are ragged and mixed, index-key pages are shuffled, and pool slots the kernel must not read are NaN.
"""

from __future__ import annotations

import pytest
import torch

from kernels.indexer import indexer_scores_reference, indexer_scores_triton

# Scores are sums over heads of fp32 products; bf16 inputs are exact in fp32, fp16 dots round at the end.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-5}


def make_inputs(seqs, *, num_heads, head_dim, page_size, compress_rate, dtype, seed=0):
    """seqs: (first query position, number of query tokens) per sequence, interleaved into one batch."""
    gen = torch.Generator().manual_seed(seed)
    token_seq = torch.cat([torch.full((n,), b, dtype=torch.int32) for b, (_, n) in enumerate(seqs)])
    token_pos = torch.cat([torch.arange(p0, p0 + n, dtype=torch.int64) for p0, n in seqs])
    perm = torch.randperm(token_seq.numel(), generator=gen)
    token_seq, token_pos = token_seq[perm], token_pos[perm]
    num_entries = [(p0 + n) // compress_rate for p0, n in seqs]
    pages_per_seq = [-(-n // page_size) for n in num_entries]
    num_pages = sum(pages_per_seq) + 2
    index_k = torch.randn(num_pages, page_size, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen)
    index_k[order[sum(pages_per_seq):]] = float("nan")
    table = torch.full((len(seqs), max(pages_per_seq) + 1), int(order[-1]), dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages_per_seq):
        table[b, :count] = order[used : used + count].to(torch.int32)
        for entry in range(num_entries[b], count * page_size):  # entries not written yet
            index_k[table[b, entry // page_size], entry % page_size] = float("nan")
        used += count
    q = torch.randn(token_seq.numel(), num_heads, head_dim, generator=gen).to(dtype)
    weights = torch.randn(token_seq.numel(), num_heads, generator=gen) * num_heads**-0.5
    return q, weights, head_dim**-0.5, token_seq, token_pos, index_k, table, compress_rate


def _check(inputs, dtype, **kernel_kwargs):
    q, weights, scale, token_seq, token_pos, index_k, table, rate = inputs
    expected = indexer_scores_reference(q.float(), weights, scale, token_seq, token_pos, index_k.float(), table, rate)
    actual = indexer_scores_triton(*inputs, **kernel_kwargs)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    assert torch.equal(actual.isneginf(), expected.isneginf())
    assert not actual.isnan().any()
    torch.testing.assert_close(actual, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference(dtype):
    """Decodes with 0, 1 and many entries and prefill chunks, several entry blocks, 72 heads in two head blocks."""
    inputs = make_inputs([(0, 1), (4, 1), (70, 1), (0, 9), (33, 6)], num_heads=72, head_dim=32, page_size=8,
                         compress_rate=4, dtype=dtype, seed=1)
    _check(inputs, dtype, block_e=16)


def test_default_tiles_and_explicit_width():
    inputs = make_inputs([(10, 3), (150, 1)], num_heads=16, head_dim=64, page_size=16, compress_rate=4,
                         dtype=torch.float32, seed=2)
    _check(inputs, torch.float32)
    narrow = indexer_scores_triton(*inputs)
    wide = indexer_scores_triton(*inputs, max_entries=60)
    assert narrow.shape == (4, 151 // 4) and wide.shape == (4, 60)
    assert torch.equal(wide[:, : narrow.shape[1]], narrow) and wide[:, narrow.shape[1] :].isneginf().all()


def test_no_causal_entry_anywhere():
    inputs = make_inputs([(0, 3)], num_heads=4, head_dim=32, page_size=4, compress_rate=4, dtype=torch.float32)
    assert indexer_scores_triton(*inputs).shape == (3, 0)
