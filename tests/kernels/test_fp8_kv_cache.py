"""The KV cache in DeepSeek's layouts (kv_cache_dtype fp8): the attention and indexer kernels, and their references,
read pools of the fp8 entry's and the FP4 indexer key's bytes as the values those bytes decode to; the store kernels
write the references' bytes.

The pools of tests/kernels/test_attention.py and test_indexer.py are packed (their NaN pages too: a NaN entry packs to
NaN scales, so a stray read still shows), and each kernel's output on the packed pool must equal, bit for bit, its
output on the decoded pool: one launch differs from the other only in how a key reaches the registers. The reads are
checked at DeepSeek-V4's widths too (head_dim 512 with 64 rope dims, index_head_dim 128), each group of an entry at its
own scale: a group read at another's scale shows only where an entry has several groups.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention import sparse_paged_attention_reference, sparse_paged_attention_triton
from kernels.indexer import indexer_scores_reference, indexer_scores_triton
from kernels.quant_formats import (hadamard_rotate, indexer_fp4_entry_bytes, kv_fp8_entry_bytes, pack_indexer_fp4,
                                   pack_kv_fp8, simulate_indexer_fp4, simulate_kv_fp8, simulate_quantization,
                                   unpack_indexer_fp4, unpack_kv_fp8)

from test_attention import MIXED, make_batch
from test_indexer import make_inputs

HEAD_DIM, ROPE_DIM = 128, 64  # one e4m3 group of 64 and 64 bf16 rope values: 64 + 128 + 8 = 200 bytes
# DeepSeek-V4's widths: 7 e4m3 groups of 64 beside the 64 rope values (584 bytes), indexer keys of 128 (4 FP4 groups).
# Only there can a group's values be read at another group's scale: the tests at HEAD_DIM have a single group.
V4_HEAD_DIM, V4_INDEX_HEAD_DIM = 512, 128


def _groups_at_their_own_scales(x: torch.Tensor, group: int) -> torch.Tensor:
    """x with each group of `group` columns at another magnitude (2^-3 .. 2^3, cycling): every group of an entry gets
    its own power-of-two scale, where random values of one magnitude would mostly share one."""
    factors = torch.exp2(torch.arange(x.shape[-1] // group) % 7 - 3.0).repeat_interleave(group)
    return x * factors.to(x.dtype)


def _packed_and_decoded(pool: torch.Tensor, head_dim: int = HEAD_DIM):
    packed = pack_kv_fp8(_groups_at_their_own_scales(pool, 64), ROPE_DIM)
    return packed, unpack_kv_fp8(packed, head_dim, ROPE_DIM, pool.dtype)


def test_layout_widths():
    assert kv_fp8_entry_bytes(V4_HEAD_DIM, ROPE_DIM) == 584 and kv_fp8_entry_bytes(HEAD_DIM, ROPE_DIM) == 200
    assert indexer_fp4_entry_bytes(V4_INDEX_HEAD_DIM) == 68


def _check_fp8_reads(seqs, head_dim, dtype, mode, **batch):
    """Each implementation's output on the packed pools equals, bit for bit, its output on the values they decode to."""
    q, sinks, scale, kwargs = make_batch(seqs, num_heads=4, head_dim=head_dim, dtype=dtype, mode=mode, compress_rate=4,
                                         **batch)
    packed, decoded = dict(kwargs), dict(kwargs)
    for name in ("window_kv", "comp_kv"):
        if name in kwargs:
            packed[name], decoded[name] = _packed_and_decoded(kwargs[name], head_dim)
            assert packed[name].dtype == torch.uint8
            assert packed[name].shape[-1] == kv_fp8_entry_bytes(head_dim, ROPE_DIM)
    for implementation, options in ((sparse_paged_attention_reference, {}),
                                    (sparse_paged_attention_triton, dict(num_splits=1, block_n=16))):
        expected = implementation(q, sinks, scale, **decoded, **options)
        actual = implementation(q, sinks, scale, **packed, rope_dim=ROPE_DIM, **options)
        assert not actual.isnan().any()
        assert torch.equal(actual, expected), implementation.__name__


@pytest.mark.parametrize("mode", ["window", "hca", "csa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_fp8_entries_as_their_values(mode, dtype):
    _check_fp8_reads(MIXED, HEAD_DIM, dtype, mode, window=11, page_size=4, topk=12, seed=7)


@pytest.mark.parametrize("mode", ["window", "hca", "csa"])
def test_attention_reads_v4_wide_fp8_entries_as_their_values(mode):
    """V4's 584-byte entries, each of their 7 groups at its own scale; a short batch (decodes and a chunk) keeps the
    interpreter quick at 512 dims."""
    _check_fp8_reads([(0, 1), (37, 1), (13, 2)], V4_HEAD_DIM, torch.bfloat16, mode, window=11, page_size=4, topk=6,
                     seed=5)


def test_attention_split_kv_reads_fp8_entries():
    q, sinks, scale, kwargs = make_batch([(0, 1), (30, 1), (61, 1)], num_heads=4, head_dim=HEAD_DIM, window=20,
                                         page_size=8, dtype=torch.bfloat16, mode="csa", compress_rate=4, topk=24)
    packed, decoded = dict(kwargs), dict(kwargs)
    for name in ("window_kv", "comp_kv"):
        packed[name], decoded[name] = _packed_and_decoded(kwargs[name])
    expected = sparse_paged_attention_triton(q, sinks, scale, **decoded, num_splits=3, block_n=16)
    assert torch.equal(sparse_paged_attention_triton(q, sinks, scale, **packed, rope_dim=ROPE_DIM, num_splits=3,
                                                     block_n=16), expected)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.bfloat16, 64),
                                            (torch.bfloat16, V4_INDEX_HEAD_DIM)])
def test_indexer_reads_fp4_keys_as_their_values(dtype, head_dim):
    q, weights, scale, token_seq, token_pos, index_k, table, rate = make_inputs(
        [(0, 1), (4, 1), (70, 1), (0, 9), (33, 6)], num_heads=8, head_dim=head_dim, page_size=8, compress_rate=4,
        dtype=dtype, seed=3)
    packed = pack_indexer_fp4(_groups_at_their_own_scales(hadamard_rotate(index_k), 32))
    assert packed.dtype == torch.uint8 and packed.shape[-1] == indexer_fp4_entry_bytes(head_dim)
    decoded = unpack_indexer_fp4(packed, head_dim, dtype)
    for implementation, options in ((indexer_scores_reference, {}), (indexer_scores_triton, dict(block_e=16))):
        expected = implementation(q, weights, scale, token_seq, token_pos, decoded, table, rate, **options)
        actual = implementation(q, weights, scale, token_seq, token_pos, packed, table, rate, **options)
        assert not actual.isnan().any()
        assert torch.equal(actual, expected), implementation.__name__


def test_an_fp8_pool_without_its_rope_width_is_refused():
    """rope_dim says where the bf16 values start; without it the kernel would expect 128 + 0 + 8 bytes."""
    q, sinks, scale, kwargs = make_batch([(0, 2)], num_heads=4, head_dim=HEAD_DIM, window=8, page_size=4,
                                         dtype=torch.float32, mode="window")
    kwargs["window_kv"] = pack_kv_fp8(kwargs["window_kv"], ROPE_DIM)
    with pytest.raises(AssertionError, match="136"):
        sparse_paged_attention_triton(q, sinks, scale, **kwargs)


# --- quantize-on-write: one kernel per store, the references' bytes ----------------------------------------------
def _edge_entries(num: int, width: int, gen) -> torch.Tensor:
    """Random entries across magnitudes, with a zero row, an amax at 448 times a power of two, values rounding up
    into the next binade, ties between grid points and a negative zero."""
    x = torch.randn(num, width, generator=gen) * torch.logspace(-4, 3, num)[:, None]
    x[0] = 0.0
    x[1, 0], x[1, 1:] = 448.0 * 2.0 ** -5, torch.rand(width - 1, generator=gen)
    x[2] = torch.linspace(3.9, 4.0, width)  # amax 4: scale 2^-6 for e4m3, 1 for e2m1 (3.9.. rounds up to 4)
    x[3] = 448.0 * (torch.arange(width) % 7 + 0.5) / 8
    x[4, :3] = torch.tensor([-0.0, 0.25, -0.75])  # e2m1 ties at scale 1/8 ... and a negative zero
    return x


@pytest.mark.parametrize("head_dim,rope_dim", [(128, 64), (512, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_entry_store_writes_the_references_bytes(head_dim, rope_dim, dtype):
    from kernels.kv_store import store_kv_fp8_reference, store_kv_fp8_triton

    gen = torch.Generator().manual_seed(head_dim)
    values = _edge_entries(12, head_dim, gen).to(dtype)
    width = kv_fp8_entry_bytes(head_dim, rope_dim)
    pools = [torch.full((6, 4, width), 0xAB, dtype=torch.uint8) for _ in range(2)]  # stale bytes everywhere
    rows = torch.randperm(24, generator=gen)[:12]
    store_kv_fp8_reference(values, pools[0], rows, rope_dim)
    store_kv_fp8_triton(values, pools[1], rows, rope_dim)
    assert torch.equal(pools[1], pools[0])
    decoded = unpack_kv_fp8(pools[1].view(-1, width)[rows], head_dim, rope_dim, torch.float32)
    nope = head_dim - rope_dim  # what numerics=deepseek rounds the entries to; the rope values in bf16
    assert torch.equal(decoded[:, :nope], simulate_kv_fp8(values, rope_dim)[:, :nope].float())
    assert torch.equal(decoded[:, nope:], values[:, nope:].to(torch.bfloat16).float())


@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp4_key_store_writes_the_references_bytes(head_dim, rotate, dtype):
    """Keys as they are, or rotated by the store first (the compressor's keys: the rotation in registers, rounded to
    the keys' dtype, as hadamard_rotate rounds it)."""
    from kernels.kv_store import store_indexer_fp4_reference, store_indexer_fp4_triton

    gen = torch.Generator().manual_seed(head_dim)
    keys = _edge_entries(12, head_dim, gen).clamp(-1e4, 1e4).to(dtype)
    width = indexer_fp4_entry_bytes(head_dim)
    pools = [torch.full((6, 4, width), 0xAB, dtype=torch.uint8) for _ in range(2)]
    rows = torch.randperm(24, generator=gen)[:12]
    store_indexer_fp4_reference(keys, pools[0], rows, rotate)
    store_indexer_fp4_triton(keys, pools[1], rows, rotate)
    assert torch.equal(pools[1], pools[0])
    stored = unpack_indexer_fp4(pools[1].view(-1, width)[rows], head_dim, torch.float32)
    assert torch.equal(stored, simulate_indexer_fp4(keys).float() if rotate else
                       simulate_quantization(keys, 32, "e2m1").float())


@pytest.mark.parametrize("head_dim,rope_dim", [(128, 64), (512, 64)])
def test_the_window_write_quantizes_in_the_norm_rope_kernel(head_dim, rope_dim):
    """norm_rope into a uint8 pool: the kernel encodes each normed, rotated entry where it stores it, the bytes the
    reference (norm_rope, then store_kv_fp8) writes."""
    from kernels.norm_rope import norm_rope_reference, norm_rope_triton

    gen = torch.Generator().manual_seed(head_dim)
    tokens = 9
    x = torch.randn(tokens, head_dim, generator=gen) * 3
    weight = 1 + 0.1 * torch.randn(head_dim, generator=gen)
    angles = torch.arange(tokens)[:, None].float() * torch.linspace(0.1, 1.0, rope_dim // 2)[None, :]
    width = kv_fp8_entry_bytes(head_dim, rope_dim)
    pools = [torch.full((5, 4, width), 0xAB, dtype=torch.uint8) for _ in range(2)]
    rows = torch.randperm(20, generator=gen)[:tokens]
    for implementation, pool in ((norm_rope_reference, pools[0]), (norm_rope_triton, pools[1])):
        implementation(x, weight, 1e-6, cos=angles.cos(), sin=angles.sin(), out=pool, out_index=rows)
    assert torch.equal(pools[1], pools[0])
    expected = norm_rope_reference(x, weight, 1e-6, cos=angles.cos(), sin=angles.sin())
    assert torch.equal(pools[0].view(-1, width)[rows], pack_kv_fp8(expected, rope_dim))
