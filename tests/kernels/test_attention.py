"""sparse_paged_attention_triton against sparse_paged_attention_reference, on CPU under the interpreter.

Every batch is ragged and mixed (decode tokens and prefill chunks of different sequences in one launch), its
pages are shuffled in the pools, and every pool page or block-table column the kernel must not read holds NaN,
so a stray read shows up as a NaN in the output.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention import (choose_num_splits, plan_sparse_paged_attention, sparse_paged_attention_reference,
                               sparse_paged_attention_triton)
from kernels.norm_rope import norm_rope_triton
from kernels.quant_formats import pack_kv_fp8

# bf16 runs through fp32 compute under the interpreter; the output is stored with fp32->bf16 truncation,
# so its error is up to 2^-7 relative on top of bf16 inputs.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _paged_pool(num_entries_per_seq, page_size, head_dim, dtype, gen, extra_pages=3):
    """A pool holding entries [first_page * page_size, n) of each sequence on shuffled pages.

    num_entries_per_seq: list of (first_page, n). Returns pool [pages, page_size, D] and block table [B, C]
    int32 whose unused columns point at a NaN page.
    """
    pages_per_seq = [max(0, -(-n // page_size) - first) for first, n in num_entries_per_seq]
    num_pages = sum(pages_per_seq) + extra_pages
    pool = torch.randn(num_pages, page_size, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen)
    nan_page = int(order[-1])
    pool[order[sum(pages_per_seq):]] = float("nan")  # pages no sequence owns
    table = torch.full((len(pages_per_seq), max(pages_per_seq + [1]) + 1), nan_page, dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages_per_seq):
        table[b, :count] = order[used : used + count].to(torch.int32)
        used += count
    return pool, table


def make_batch(seqs, *, num_heads, head_dim, window, page_size, dtype, mode, compress_rate=4, topk=0, seed=0):
    """seqs: list of (first query position, number of query tokens) per sequence; the queries are
    interleaved across sequences to make a mixed ragged batch. mode: "window", "hca" or "csa"."""
    gen = torch.Generator().manual_seed(seed)
    token_seq = torch.cat([torch.full((n,), b, dtype=torch.int32) for b, (_, n) in enumerate(seqs)])
    token_pos = torch.cat([torch.arange(p0, p0 + n, dtype=torch.int64) for p0, n in seqs])
    perm = torch.randperm(token_seq.numel(), generator=gen)
    token_seq, token_pos = token_seq[perm], token_pos[perm]
    num_tokens = token_seq.numel()

    first_page = [max(0, p0 - window + 1) // page_size for p0, _ in seqs]
    window_kv, window_table = _paged_pool([(f, p0 + n) for f, (p0, n) in zip(first_page, seqs)],
                                          page_size, head_dim, dtype, gen)
    for b, (p0, n) in enumerate(seqs):  # poison the slots no query of the sequence may read
        for pos in range(first_page[b] * page_size, -(-(p0 + n) // page_size) * page_size):
            if not max(0, p0 - window + 1) <= pos < p0 + n:
                window_kv[window_table[b, pos // page_size - first_page[b]], pos % page_size] = float("nan")
    kwargs = dict(token_seq=token_seq, token_pos=token_pos, window_kv=window_kv, window_block_table=window_table,
                  window_first_page=torch.tensor(first_page, dtype=torch.int64), window=window)
    if mode != "window":
        num_entries = [(p0 + n) // compress_rate for p0, n in seqs]
        comp_kv, comp_table = _paged_pool([(0, n) for n in num_entries], page_size, head_dim, dtype, gen)
        for b, n in enumerate(num_entries):  # entries not written yet
            for entry in range(n, -(-n // page_size) * page_size):
                comp_kv[comp_table[b, entry // page_size], entry % page_size] = float("nan")
        kwargs.update(comp_kv=comp_kv, comp_block_table=comp_table, compress_rate=compress_rate)
        if mode == "csa":
            kwargs["topk_indices"] = _random_topk(token_seq, token_pos, num_entries, compress_rate, topk, gen)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    sinks = torch.randn(num_heads, generator=gen) * 2
    return q, sinks, head_dim**-0.5, kwargs


def _random_topk(token_seq, token_pos, num_entries, compress_rate, topk, gen):
    """Causal entries in random order, -1 where a token has fewer than topk, and some slots knocked out."""
    rows = []
    for b, p in zip(token_seq.tolist(), token_pos.tolist()):
        causal = min((p + 1) // compress_rate, num_entries[b])
        chosen = torch.randperm(causal, generator=gen)[:topk].to(torch.int32)
        row = torch.full((topk,), -1, dtype=torch.int32)
        row[: chosen.numel()] = chosen
        row[torch.rand(topk, generator=gen) < 0.2] = -1
        rows.append(row[torch.randperm(topk, generator=gen)])
    return torch.stack(rows)


def _check(q, sinks, scale, kwargs, dtype, **kernel_kwargs):
    expected = sparse_paged_attention_reference(q.float(), sinks, scale, **_as_float(kwargs))
    actual = sparse_paged_attention_triton(q, sinks, scale, **kwargs, **kernel_kwargs)
    assert actual.dtype == dtype and actual.shape == q.shape
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def _as_float(kwargs):
    return {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kwargs.items()}


# (first query position, number of query tokens) per sequence: decodes at 0, inside and past the window,
# and prefill chunks starting at 0 and mid-sequence crossing page boundaries.
MIXED = [(0, 1), (5, 1), (37, 1), (0, 6), (13, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["window", "hca", "csa"])
def test_matches_reference(dtype, mode):
    q, sinks, scale, kwargs = make_batch(MIXED, num_heads=4, head_dim=32, window=11, page_size=4, dtype=dtype,
                                         mode=mode, compress_rate=4, topk=12, seed=len(mode))
    _check(q, sinks, scale, kwargs, dtype, num_splits=1, block_n=16)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_v4_widths(num_splits):
    """DeepSeek-V4's widths (head_dim 512: the kernel's two halves of 256 columns; 64 heads, two blocks of 32) at the
    default key blocks, with and without split-KV."""
    q, sinks, scale, kwargs = make_batch([(0, 1), (70, 1), (40, 3)], num_heads=64, head_dim=512, window=40,
                                         page_size=16, dtype=torch.bfloat16, mode="csa", compress_rate=4, topk=20,
                                         seed=num_splits)
    _check(q, sinks, scale, kwargs, torch.bfloat16, num_splits=num_splits)


def _query_rope(num_tokens, rope_dim, dtype, seed):
    """A cos / sin table pair [T, rope_dim / 2] of the model's dtype at random angles."""
    angles = torch.rand(num_tokens, rope_dim // 2, generator=torch.Generator().manual_seed(seed)) * 6
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _separately(q, sinks, scale, kwargs, eps, rope, **kernel_kwargs):
    """What the model launched before the attention kernel took them in: q normed and roped by the norm_rope kernel,
    the attention, then the output's inverse rope by the norm_rope kernel."""
    cos, sin = rope
    q = norm_rope_triton(q, None, eps, cos=cos, sin=sin)
    out = sparse_paged_attention_triton(q, sinks, scale, **kwargs, **kernel_kwargs)
    return norm_rope_triton(out, None, eps, normalize=False, cos=cos, sin=sin, inverse=True)


@pytest.mark.parametrize("num_splits", [1, 3])  # the output's rope undone by the attention kernel / the combine
@pytest.mark.parametrize("fp8", [False, True])
def test_queries_normed_and_roped_and_the_output_unroped_in_the_kernel(num_splits, fp8):
    """At V4's widths (head_dim 512, 64 rope channels, 64 heads in blocks of 32): the kernel's own q norm and rope and
    its inverse rope of the output equal, bit for bit, the norm_rope launches they replace, and the reference."""
    q, sinks, scale, kwargs = make_batch([(0, 1), (70, 1), (40, 3)], num_heads=64, head_dim=512, window=40,
                                         page_size=16, dtype=torch.bfloat16, mode="csa", compress_rate=4, topk=20,
                                         seed=num_splits)
    if fp8:
        kwargs = dict(kwargs, rope_dim=64, window_kv=pack_kv_fp8(kwargs["window_kv"], 64),
                      comp_kv=pack_kv_fp8(kwargs["comp_kv"], 64))
    q = q * 3  # the norm must matter
    rope = _query_rope(q.shape[0], 64, torch.bfloat16, seed=num_splits)
    fused = sparse_paged_attention_triton(q, sinks, scale, **kwargs, q_norm_eps=1e-6, rope=rope,
                                          num_splits=num_splits)
    assert torch.equal(fused, _separately(q, sinks, scale, kwargs, 1e-6, rope, num_splits=num_splits))
    expected = sparse_paged_attention_reference(q, sinks, scale, **kwargs, q_norm_eps=1e-6, rope=rope)
    torch.testing.assert_close(fused.float(), expected.float(), atol=TOLERANCE[torch.bfloat16],
                               rtol=TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("num_splits", [1, 2])
def test_query_norm_and_rope_in_fp32(num_splits):
    """fp32, the rope in a 16-channel tail: within the fp32 sum order of the norm (the kernel adds two halves' sums)
    of the separate launches, and of the reference."""
    q, sinks, scale, kwargs = make_batch(MIXED, num_heads=4, head_dim=64, window=11, page_size=4,
                                         dtype=torch.float32, mode="hca", compress_rate=4, seed=3)
    rope = _query_rope(q.shape[0], 16, torch.float32, seed=3)
    fused = sparse_paged_attention_triton(q, sinks, scale, **kwargs, q_norm_eps=1e-6, rope=rope,
                                          num_splits=num_splits, block_n=16)
    separate = _separately(q, sinks, scale, kwargs, 1e-6, rope, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(fused, separate, atol=1e-6, rtol=1e-6)
    expected = sparse_paged_attention_reference(q, sinks, scale, **kwargs, q_norm_eps=1e-6, rope=rope)
    torch.testing.assert_close(fused, expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])
    unnormed = sparse_paged_attention_reference(q, sinks, scale, **kwargs, rope=rope)
    assert (unnormed - expected).abs().max() > 1e-3  # the norm changes the output: the check above can fail


def test_a_rope_wider_than_half_the_head_is_refused():
    q, sinks, scale, kwargs = make_batch([(3, 1)], num_heads=4, head_dim=32, window=8, page_size=4,
                                         dtype=torch.float32, mode="window")
    with pytest.raises(AssertionError, match="at most half"):
        sparse_paged_attention_triton(q, sinks, scale, **kwargs, rope=_query_rope(1, 24, torch.float32, 0))


@pytest.mark.parametrize("mode", ["hca", "csa"])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_matches_reference(mode, num_splits):
    """More splits than some tokens have key blocks: empty splits must merge as nothing."""
    q, sinks, scale, kwargs = make_batch([(0, 1), (30, 1), (61, 1)], num_heads=4, head_dim=64, window=20,
                                         page_size=8, dtype=torch.float32, mode=mode, compress_rate=4, topk=24,
                                         seed=num_splits)
    _check(q, sinks, scale, kwargs, torch.float32, num_splits=num_splits, block_n=16)


def test_automatic_split_for_small_decode_batch():
    """The default picks split-KV for a 3-token decode batch (3 programs for 132 SMs), as many splits as the
    traffic bound allows: (window 160 + up to 32 entries) / 16 = 12 key blocks at >= 4 blocks a split: 3."""
    q, sinks, scale, kwargs = make_batch([(3, 1), (140, 1), (250, 1)], num_heads=4, head_dim=32, window=160,
                                         page_size=4, dtype=torch.bfloat16, mode="hca", compress_rate=8)
    _, launches = plan_sparse_paged_attention(q, sinks, scale, **kwargs, block_n=16)
    assert len(launches) == 2 and launches[0][1][2] == 3  # (token, head block, split) grid, then the combine
    _check(q, sinks, scale, kwargs, torch.bfloat16, block_n=16)


def test_hca_with_no_entries_yet():
    """Positions below compress_rate - 1 have no compressed entry: window and sink only."""
    q, sinks, scale, kwargs = make_batch([(0, 3), (2, 2)], num_heads=4, head_dim=32, window=8, page_size=4,
                                         dtype=torch.float32, mode="hca", compress_rate=16)
    _check(q, sinks, scale, kwargs, torch.float32, num_splits=1, block_n=16)


def test_csa_with_every_slot_invalid():
    q, sinks, scale, kwargs = make_batch([(9, 2), (20, 1)], num_heads=4, head_dim=32, window=8, page_size=4,
                                         dtype=torch.float32, mode="csa", compress_rate=4, topk=8)
    kwargs["topk_indices"][0] = -1
    _check(q, sinks, scale, kwargs, torch.float32, num_splits=2, block_n=16)


def test_several_head_blocks_and_default_tiles():
    """80 heads: two 64-head blocks, the second one masked; tiles as the engine picks them."""
    q, sinks, scale, kwargs = make_batch([(4, 2), (70, 1)], num_heads=80, head_dim=32, window=40, page_size=16,
                                         dtype=torch.float16, mode="csa", compress_rate=4, topk=20)
    _check(q, sinks, scale, kwargs, torch.float16)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_batches(data):
    """Random mixes of decodes and chunks, windows, page sizes, rates, top-k widths and split counts."""
    seqs = data.draw(st.lists(st.tuples(st.integers(0, 70), st.integers(1, 4)), min_size=1, max_size=3))
    mode = data.draw(st.sampled_from(["window", "hca", "csa"]))
    q, sinks, scale, kwargs = make_batch(
        seqs, num_heads=data.draw(st.integers(1, 6)), head_dim=32, window=data.draw(st.integers(1, 24)),
        page_size=data.draw(st.sampled_from([2, 4, 8])), dtype=torch.float32, mode=mode,
        compress_rate=data.draw(st.sampled_from([2, 4, 8])), topk=data.draw(st.integers(1, 20)),
        seed=data.draw(st.integers(0, 100)))
    _check(q, sinks, scale, kwargs, torch.float32, num_splits=data.draw(st.sampled_from([1, 2, 3])), block_n=16)


def test_empty_batch():
    q, sinks, scale, kwargs = make_batch([(3, 1)], num_heads=4, head_dim=32, window=8, page_size=4,
                                         dtype=torch.float32, mode="window")
    kwargs.update(token_seq=kwargs["token_seq"][:0], token_pos=kwargs["token_pos"][:0])
    assert sparse_paged_attention_triton(q[:0], sinks, scale, **kwargs).shape == (0, 4, 32)


def test_split_rule():
    """Splits fill one wave of the SMs at the kernel's occupancy, within the key blocks and the traffic bound."""
    assert choose_num_splits(num_programs=8, max_key_blocks=400, num_sms=132, programs_per_sm=1) == 17
    assert choose_num_splits(num_programs=8, max_key_blocks=400, num_sms=132, programs_per_sm=2) == 32  # capped
    assert choose_num_splits(num_programs=8, max_key_blocks=40, num_sms=132, programs_per_sm=2) == 20
    assert choose_num_splits(num_programs=8, max_key_blocks=40, num_sms=132, programs_per_sm=2,
                             min_blocks_per_split=8) == 5
    assert choose_num_splits(num_programs=132, max_key_blocks=200, num_sms=132, programs_per_sm=1) == 1
    assert choose_num_splits(num_programs=132, max_key_blocks=200, num_sms=132, programs_per_sm=3) == 3
    assert choose_num_splits(num_programs=1, max_key_blocks=3, num_sms=132, programs_per_sm=4) == 1


def test_occupancy_from_registers_threads_and_shared_memory():
    from kernels.common import programs_per_sm

    # V4-Flash's decode attention on sm_90: 176 registers x 8 warps (registers bound: 1), 67.5 KB shared
    assert programs_per_sm(176, 8, 67584) == 1
    assert programs_per_sm(96, 4, 12288) == 5  # the tiny model's: registers bound (65536 / (3072 * 4))
    assert programs_per_sm(32, 4, 100 * 1024) == 2  # shared memory bound
    assert programs_per_sm(16, 1, 0) == 32  # the programs-per-SM cap
    assert programs_per_sm(255, 8, 0) == 1  # never 0


def test_partials_never_cost_more_traffic_than_the_keys_a_split_reads():
    from kernels.attention import min_blocks_per_split

    # head_dim 512, 32 heads per block, 32 keys per block, bf16: 2 * 32 * 4 B per channel of partials against
    # 32 * 2 B of keys per block: 4 blocks
    assert min_blocks_per_split(32, 32, 512, 2) == 4
    assert min_blocks_per_split(16, 64, 64, 4) == 2  # fp32 keys, small head blocks: the floor of 2
