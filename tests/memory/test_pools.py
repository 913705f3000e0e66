"""Paged pools: pages conserved, window pages released as requests advance, OutOfPages at capacity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.memory.kv_manager import KVCacheManager
from backend.memory.page_allocator import OutOfPages, PageAllocator
from backend.memory.paged_pool import PageRun
from backend.memory.window_pool import WindowPool
from backend.model.config import ModelConfig, _normalise
from backend.request import Sequence


def _model_config(**overrides) -> ModelConfig:
    raw = dict(hidden_size=8, head_dim=16, index_head_dim=16, num_hidden_layers=3, partial_rotary_factor=0.5,
               layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
               mlp_layer_types=["hash_moe", "moe", "moe"], **overrides)
    config = ModelConfig(**_normalise(raw))
    config.qk_rope_head_dim = 8
    return config


def _manager(num_tokens=4096, ratio=0.25, page_size=16, max_running=4) -> KVCacheManager:
    return KVCacheManager(_model_config(), num_tokens=num_tokens, swa_full_tokens_ratio=ratio, page_size=page_size,
                          max_running_requests=max_running, dtype=torch.float32, device="cpu")


def test_allocator_rejects_double_free_and_is_all_or_nothing():
    alloc = PageAllocator("p", 4)
    pages = alloc.allocate(3)
    with pytest.raises(OutOfPages) as info:
        alloc.allocate(2)
    assert (info.value.needed, info.value.free) == (2, 1)
    assert alloc.num_free == 1  # nothing was taken by the failed call
    alloc.free(pages[:1])
    with pytest.raises(ValueError):
        alloc.free(pages[:1])
    alloc.check()


def test_window_pages_slide_out_as_a_request_advances():
    pool = WindowPool(num_layers=1, num_pages=64, page_size=16, head_dim=4, window=128, dtype=torch.float32,
                      device="cpu")
    run = PageRun()
    pool.extend(run, 0, 300)
    assert len(run.pages) == 19  # positions 0..299
    pool.release_slid_out(run, 300)  # next token 300 sees positions 173..300
    assert run.first == 173 // 16 and len(run.pages) == 19 - run.first
    for pos in range(300, 700):  # decode: the request never holds more than window/page + 1 pages
        pool.extend(run, pos, 1)
        pool.release_slid_out(run, pos + 1)
        assert len(run.pages) <= 128 // 16 + 1
    pool.check([run])
    pool.free(run)
    pool.check([])
    assert pool.allocator.num_free == 64


def test_out_of_pages_is_raised_at_the_predicted_capacity():
    kv = _manager(num_tokens=4096, ratio=0.25, page_size=16)
    capacity = kv.capacity()
    # window: 4096 * 0.25 positions; compressed pools: num_tokens' entries in pages of 16, plus one
    # partly filled page for each of the 4 running requests.
    assert capacity["window"] == 1024
    assert capacity["csa"] == (4096 // 4 // 16 + 4) * 16 * 4 == 4352
    assert capacity["hca"] == (4096 // 128 // 16 + 4) * 16 * 128 == 12288
    # One request can prefill window-pool capacity in a single chunk, not one token more.
    seq = Sequence("big", list(range(5000)))
    assert kv.can_extend(seq, 1024) and not kv.can_extend(seq, 1025)
    with pytest.raises(OutOfPages) as info:
        kv.extend(seq, 1025)
    assert info.value.pool == "window"
    kv.check()
    assert kv.pages_used()["window"] == 0  # the failed extend allocated nothing
    # Compressed pools: a request of 4352 positions fits, 4352 + 4 needs one CSA entry more.
    assert kv.max_request_positions() == 4352 + 3


def test_every_running_request_can_hold_a_partial_page_of_each_pool():
    """Short requests each take a whole page per pool; the pools keep one per running request."""
    kv = _manager(num_tokens=1024, ratio=1.0, page_size=16, max_running=4)
    seqs = [Sequence(f"s{i}", [0] * 200) for i in range(4)]
    for seq in seqs:  # 130 positions: one HCA entry and 32 CSA entries each
        assert kv.can_extend(seq, 130)
        kv.extend(seq, 130)
    assert kv.pages_used()["hca"] == 4 and kv.pages_used()["csa"] == 4 * 2
    kv.check()


def test_bytes_per_token_and_capacity_are_reported():
    kv = _manager()
    per_token = kv.bytes_per_token()
    # window: 3 layers x 16 dims x 4 bytes; csa: (16 + 16 index dims) x 4 bytes / 4; hca: 16 x 4 / 128
    assert per_token == {"window": 3 * 16 * 4, "csa": 32 * 4 / 4, "hca": 16 * 4 / 128}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["extend", "advance", "free"]), st.integers(1, 300)),
                max_size=60))
def test_pages_are_conserved_under_any_sequence_of_operations(ops):
    kv = _manager(num_tokens=2048, ratio=0.5, page_size=16, max_running=4)
    seqs = [Sequence(f"s{i}", [0] * 4000) for i in range(6)]
    for index, op, n in ops:
        seq = seqs[index]
        if op == "free":
            kv.free(seq)
            seq.num_computed_tokens = 0
        elif kv.can_extend(seq, n):
            kv.extend(seq, n)
            if op == "advance":
                seq.num_computed_tokens += n
                kv.release_slid_out(seq)
        else:
            with pytest.raises(OutOfPages):
                kv.extend(seq, n)
        kv.check()
    for seq in seqs:
        kv.free(seq)
    kv.check()
    assert all(v == 0 for v in kv.pages_used().values())


def test_freeing_a_request_returns_every_page_and_its_slot():
    """One handle (seq.pages) holds all of a request's memory; kv.free(seq) gives all of it back."""
    kv = _manager()
    seq, other = Sequence("s", [0] * 400), Sequence("o", [0] * 400)
    kv.extend(seq, 300)
    kv.extend(other, 100)
    assert seq.pages is not None and seq.pages.slot is not None
    assert set(seq.pages.runs) == {"window", "csa", "hca"}
    kv.free(seq)
    assert seq.pages is None
    kv.check()
    assert kv.pages_used() == {"window": 7, "csa": 2, "hca": 0, "compressor_state": 1}  # the other's only
    kv.free(seq)  # idempotent
    kv.free(other)
    kv.check()
    assert all(used == 0 for used in kv.pages_used().values())


def test_layer_memory_is_a_view_of_the_pools_for_each_layer_type():
    kv = _manager()
    csa, hca, sliding = (kv.layer(i) for i in range(3))
    assert (csa.pool, csa.compress_rate, hca.pool, hca.compress_rate) == ("csa", 4, "hca", 128)
    assert sliding.pool is None and sliding.compressed_kv is None and sliding.state == {}
    assert set(csa.state) == {"csa", "indexer"} and set(hca.state) == {"hca"} and hca.index_k is None
    csa.compressed_kv[2, 3] = 1.5
    csa.index_k[2, 3] = 2.5
    sliding.window_kv[1, 0] = 3.5
    assert kv.compressed_pools["csa"].tensors["kv"][0, 2, 3, 0] == 1.5
    assert kv.compressed_pools["csa"].tensors["index_k"][0, 2, 3, 0] == 2.5
    assert kv.window_pool.kv[2, 1, 0, 0] == 3.5  # layer 2's slice of the shared window pool


def test_a_window_pool_smaller_than_one_window_admits_nothing():
    kv = _manager(num_tokens=4096, ratio=128 / 4096, page_size=16)  # 8 pages: a window needs 8 + 1
    assert kv.max_request_positions() == 0


def test_with_one_draft_a_row_the_window_keeps_what_a_verify_that_falls_back_reads():
    """With one draft a row a verify may be scheduled ahead of the one in flight (overlapped verify steps) and fall
    back a position when that one's draft is rejected: the window of the position before the request's own must
    still be held, even where it starts on the last position of a page."""
    from backend.request import Sequence

    kv = KVCacheManager(_model_config(), num_tokens=4096, swa_full_tokens_ratio=0.5, page_size=16,
                        max_running_requests=4, dtype=torch.float32, device="cpu", speculative_tokens=1,
                        draft_layers=1)
    window = kv.window
    for computed in (window + 15, window + 31, window + 40):  # (the first two: its window starts on a page's last)
        seq = Sequence("r", list(range(1, 300)))
        assert kv.try_extend(seq, computed)
        seq.num_computed_tokens = computed
        assert kv.try_extend(seq, 2)
        fallen_back = computed - 1  # its window: [fallen_back - window + 1, fallen_back]
        assert seq.pages.runs["window"].first * 16 <= fallen_back - window + 1
        kv.free(seq)
    kv.check()
