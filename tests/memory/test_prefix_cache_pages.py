"""Prefix-cache page accounting: any sequence of requests arriving (restoring a cached prefix when one
matches), computing chunks (keeping the block boundaries inside them and where they end), failing a step,
finishing, aborting, and cache evictions conserves every pool's pages and snapshot slots (a request's end always
in a full one), and a page is free only when no request and no cache entry holds it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.memory.page_allocator import PageAllocator
from backend.request import Sequence

from test_pools import _manager  # tests/memory is on sys.path


def test_a_retained_page_is_freed_only_by_its_last_holder():
    alloc = PageAllocator("p", 3)
    (page,) = alloc.allocate(1)
    alloc.retain([page])
    alloc.free([page])
    assert alloc.num_used == 1 and alloc.refs(page) == 1  # one holder left: still in use
    alloc.free([page])
    assert alloc.num_used == 0
    alloc.check()


operations = st.lists(st.tuples(st.sampled_from(["arrive", "compute", "finish", "evict"]), st.integers(0, 10 ** 6)),
                      min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(operations=operations)
def test_any_sequence_of_operations_conserves_pages(operations):
    kv = _manager(num_tokens=2048, ratio=0.5, page_size=16, max_running=4)
    kv.enable_prefix_caching(128, max_entries=6, max_end_entries=2)  # 2 full snapshot slots, 4 light ones
    cache = kv.prefix_cache
    history = list(range(2, 700))  # requests share prefixes of it
    live: list[Sequence] = []
    for step, (op, value) in enumerate(operations):
        if op == "arrive" and len(live) < 4 and kv.has_free_slot():
            length = 1 + value % 600
            seq = Sequence(f"r{step}", history[:length] if value % 3 else history[:length // 2] + [1] * (length // 2))
            entry = cache.lookup(seq)
            if entry is not None:
                assert entry.length < seq.num_tokens and (entry.length % 128 == 0 or entry.request_end)
                if cache.restore(seq, entry):
                    seq.num_computed_tokens = entry.length  # as the scheduler counts a restore
            live.append(seq)
        elif op == "compute" and live:  # one step of one request, as the scheduler and the engine run it
            seq = live[value % len(live)]
            start = seq.num_computed_tokens
            n = min(seq.num_tokens - start, 1 + value % 300)
            if n > 0 and kv.evict_cached_until(seq, n):
                kv.extend(seq, n)
                reserved = cache.reserve(seq, start, start + n)
                assert all(start < r.position <= start + n and r.position % 128 == 0 for r in reserved)
                if value % 7 == 0:  # the forward failed: nothing kept, the request ends
                    cache.release_reserved(reserved)
                    live.remove(seq)
                    kv.free(seq)
                else:
                    seq.num_computed_tokens += n
                    cache.keep_reserved(seq, reserved)
                    kv.release_slid_out(seq)
        elif op == "finish" and live:
            seq = live.pop(value % len(live))
            if value % 2:  # finished (an abort keeps nothing)
                cache.register_end(seq, seq.num_computed_tokens)
            kv.free(seq)
        elif op == "evict":
            cache.evict_one()
        kv.check()  # every page's references are exactly its holders; free + used == total
        assert cache.num_free_snapshots + _entries(cache) == 6 and cache.num_reserved == 0  # snapshot slots
        assert all(not kv.state_pool.is_light(e.snapshot) for e in cache._entries.values() if e.length % 128)
        for pool, pages in cache.snapshot_stats()["pages"].items():  # the gauge, kept as entries come and go
            assert pages == len({p for held in cache.held_pages(pool) for p in held})
    for seq in live:
        kv.free(seq)
    cache.clear()
    kv.check()
    assert all(used == 0 for used in kv.pages_used().values())


def test_a_second_request_shares_the_first_ones_pages_and_copies_its_partial_ones():
    kv = _manager(num_tokens=2048, ratio=0.5, page_size=16, max_running=4)
    kv.enable_prefix_caching(128, max_entries=4)
    cache = kv.prefix_cache
    first = Sequence("a", list(range(2, 400)))
    for n in (128, 128):  # two chunks, each ending at a block boundary
        _step(kv, first, n)
    assert _entries(cache) == 2
    second = Sequence("b", list(range(2, 300)) + [1, 1])
    entry = cache.lookup(second)
    assert entry.length == 256 and cache.restore(second, entry)
    csa = kv.compressed_pools["csa"]  # 64 entries = 4 pages of 16: whole pages, shared
    assert second.pages.runs["csa"].pages == first.pages.runs["csa"].pages[:4]
    # holders: a, b, the entry at 256 and (for the first 32 entries, 2 pages) the entry at 128
    assert [csa.allocator.refs(p) for p in second.pages.runs["csa"].pages] == [4, 4, 3, 3]
    # hca: 2 entries of a 16-entry page, partly filled, so b got its own copy
    assert second.pages.runs["hca"].pages != first.pages.runs["hca"].pages[:1]
    window = second.pages.runs["window"]
    assert window.pages == first.pages.runs["window"].pages[window.first - first.pages.runs["window"].first:][:len(window.pages)]
    kv.check()
    kv.free(first)
    kv.free(second)
    cache.clear()
    kv.check()
    assert all(used == 0 for used in kv.pages_used().values())


def test_a_restore_takes_its_pages_from_the_memory_manager_and_leaves_the_count_to_the_scheduler():
    """KVCacheManager.adopt gives a request (holding nothing) an entry's pages: shared by reference, a partly filled
    last page copied into one of its own, all or nothing; the positions it holds are the scheduler's to count."""
    kv = _manager(num_tokens=2048, ratio=0.5, page_size=16, max_running=2)
    kv.enable_prefix_caching(128, max_entries=4)
    cache = kv.prefix_cache
    first = Sequence("a", list(range(2, 300)))
    _step(kv, first, 192, finish=True)  # its end: 12 window pages, 48 CSA entries (3 pages), 1 HCA entry
    entry = cache.lookup(second := Sequence("b", list(range(2, 194)) + [1, 1]))
    assert entry.length == 192 and entry.request_end
    cache.take_pending()
    blocker = Sequence("c", list(range(900, 1000)))
    kv.extend(blocker, 1)  # the last free state slot: no room for the restore, and nothing of the cache to evict
    assert kv.adopt(second, entry.pages, entry.length) is None and second.pages is None
    kv.free(blocker)
    assert cache.restore(second, entry) and second.num_computed_tokens == 0
    (_, name, src, dst), = [op for op in cache.take_pending() if op[0] == "page"]
    assert name == "hca" and src == first.pages.runs["hca"].pages[0] and second.pages.runs["hca"].pages == [dst]
    assert second.pages.runs["csa"].pages == first.pages.runs["csa"].pages  # whole pages: shared
    kv.check()
    for seq in (first, second):
        kv.free(seq)
    cache.clear()
    kv.check()
    source = (Path(__file__).parents[2] / "backend/memory/prefix_cache.py").read_text()
    assert ".allocator" not in source and "num_computed_tokens =" not in source  # the manager's, the scheduler's


def _entries(cache) -> int:
    return cache.snapshot_stats()["entries"]


def _step(kv, seq, n: int, finish: bool = False) -> None:
    """One step computing n tokens of `seq`, with the cache calls the scheduler makes around it."""
    cache, start = kv.prefix_cache, seq.num_computed_tokens
    kv.extend(seq, n)
    reserved = cache.reserve(seq, start, start + n)
    seq.num_computed_tokens += n
    cache.keep_reserved(seq, reserved)
    if finish:
        cache.register_end(seq, seq.num_computed_tokens)
    kv.release_slid_out(seq)


def test_eviction_takes_the_least_recently_used_and_of_equals_boundaries_then_ends():
    """Using a prefix uses every shorter boundary of it too; of entries used together, boundaries go before a
    request's end (a chat's next turn needs it), the one holding the most window pages no other entry holds
    first, then the longest (a leaf before its ancestors)."""
    kv = _manager(num_tokens=4096, ratio=1.0, page_size=16, max_running=4)
    kv.enable_prefix_caching(128, max_entries=8)
    cache = kv.prefix_cache
    names = {}

    def compute(seq, n, finish=False):
        before = set(cache._entries)
        _step(kv, seq, n, finish)
        names.update({key: f"{seq.request_id}{cache._entries[key].length}" for key in set(cache._entries) - before})

    a, b = Sequence("a", list(range(2, 522))), Sequence("b", list(range(600, 900)))
    compute(a, 520)  # boundaries 128 .. 512 inside one chunk
    compute(b, 300, finish=True)  # boundaries 128, 256 and its end at 300
    assert sorted(names.values()) == ["a128", "a256", "a384", "a512", "b128", "b256", "b300"]
    c = Sequence("c", list(range(2, 302)) + [1] * 10)
    entry = cache.lookup(c)
    assert names[entry.key] == "a256" and cache.restore(c, entry)  # uses a's 256 and 128 again
    evicted = []
    while _entries(cache):
        before = set(cache._entries)
        cache.evict_one()
        (gone,) = before - set(cache._entries)
        evicted.append(names[gone])
    # boundaries 128 apart hold disjoint windows; b256's overlaps b's end at 300, so b128 goes first
    assert evicted == ["a512", "a384", "b128", "b256", "b300", "a256", "a128"]
    for seq in (a, b, c):
        kv.free(seq)
    kv.check()
    assert all(used == 0 for used in kv.pages_used().values())


def test_a_long_prompt_overflowing_the_cache_keeps_its_start():
    """Four snapshot slots, a prompt with eight boundaries: the later chunks evict the deepest boundaries of the
    earlier ones, so the first block (the likeliest to be shared: a system prompt) stays."""
    kv = _manager(num_tokens=4096, ratio=1.0, page_size=16, max_running=4)
    kv.enable_prefix_caching(128, max_entries=4)
    cache = kv.prefix_cache
    seq = Sequence("long", list(range(2, 1102)))
    for n in (300, 300, 300, 200):
        _step(kv, seq, n)
        kv.check()
    lengths = sorted(e.length for e in cache._entries.values())
    assert len(lengths) == 4 and lengths[0] == 128 and lengths[-1] == 1024, lengths
    kv.free(seq)
    cache.clear()
    kv.check()


def test_boundaries_take_light_snapshot_slots_and_ends_full_ones():
    """Of four snapshot slots one is full (all rings): boundaries go to the light ones (no HCA ring), a request's
    end to the full one, and a second end evicts the first end, not a boundary, whatever their recency."""
    kv = _manager(num_tokens=4096, ratio=1.0, page_size=16, max_running=4)
    kv.enable_prefix_caching(128, max_entries=4, max_end_entries=1)
    cache, state = kv.prefix_cache, kv.state_pool
    assert (state.num_spare, state.num_light_spare, state.light_streams) == (1, 3, {"csa", "indexer"})
    assert state.kv["hca"].shape[1] == state.kv["csa"].shape[1] - 3
    assert state.spare_bytes() == state.bytes_per_slot() + 3 * state.bytes_per_slot({"csa", "indexer"})
    a = Sequence("a", list(range(2, 302)))
    _step(kv, a, 200)  # the boundary at 128 inside the chunk
    _step(kv, a, 100, finish=True)  # the one at 256 inside it, and the end at 300
    kinds = {e.length: "light" if state.is_light(e.snapshot) else "full" for e in cache._entries.values()}
    assert kinds == {128: "light", 256: "light", 300: "full"}
    b = Sequence("b", list(range(600, 740)))
    _step(kv, b, 140, finish=True)  # its boundary at 128 takes the last light slot, its end evicts a's end
    lengths = lambda: sorted(e.length for e in cache._entries.values())  # noqa: E731
    assert lengths() == [128, 128, 140, 256] and cache.stats.evictions == 1
    c = Sequence("c", list(range(900, 1030)))
    _step(kv, c, 130, finish=True)  # its boundary evicts the least recently used entry (a's deepest), its end b's
    assert lengths() == [128, 128, 128, 130] and cache.stats.evictions == 3 and cache.num_free_snapshots == 0
    assert [e.length for e in cache._entries.values() if not state.is_light(e.snapshot)] == [130]
    for seq in (a, b, c):
        kv.free(seq)
    cache.clear()
    kv.check()
    assert cache.num_free_snapshots == 4


def test_with_no_end_slots_ends_are_not_kept_and_boundaries_are():
    kv = _manager(num_tokens=4096, ratio=1.0, page_size=16, max_running=4)
    kv.enable_prefix_caching(128, max_entries=3, max_end_entries=0)
    cache = kv.prefix_cache
    a = Sequence("a", list(range(2, 302)))
    _step(kv, a, 300, finish=True)
    assert sorted(e.length for e in cache._entries.values()) == [128, 256]
    kv.free(a)
    cache.clear()
    kv.check()


def test_a_request_with_tokens_in_flight_is_hashed_only_as_far_as_its_host_tokens():
    """A preempted request whose verify is still in flight (127 tokens on the host, 2 on the device) looked up for the
    next step's budget: its digests are kept for good, so none may hash a block short of its last token."""
    kv = _manager()
    kv.enable_prefix_caching(128, max_entries=4)
    cache, tokens = kv.prefix_cache, [3 + i % 30 for i in range(129)]
    seq = Sequence("in-flight", tokens[:127])
    seq.num_placeholders = 2
    assert cache.cached_length(seq) == 0
    seq.token_ids.extend(tokens[127:])  # (the step's tokens reach the host)
    seq.num_placeholders = 0
    cache.cached_length(seq)
    assert seq.block_digests == cache.digests(tokens, 1)


def _serve_alone(kv, scheduler, seq) -> None:
    from backend.scheduler import StepOutput, StepTiming

    scheduler.add(seq)
    while not seq.is_finished:
        plan = scheduler.schedule(now=0.0)
        scheduler.update_from_output(plan, StepOutput([[7] for c in plan.chunks if c.samples],
                                                      timing=StepTiming(duration_s=0.01)))
        kv.check()


@pytest.mark.parametrize("cache", [False, True])
def test_an_empty_engine_admits_a_prompt_it_holds_in_the_chunk_its_memory_fits(cache):
    """A 16-page window pool (256 positions) and 512-token chunks: a 359-token prompt fits the engine, not in one
    chunk. Admission fits the chunk as a running prefill's are fitted, after a restored prefix too (giving that up
    where nothing fits beside it), instead of failing the request as too large for an empty engine."""
    import torch

    from backend.config import EngineConfig
    from backend.memory.kv_manager import KVCacheManager
    from backend.request import SamplingParams
    from backend.scheduler import Scheduler

    from test_pools import _model_config

    kv = KVCacheManager(_model_config(), num_tokens=1024, swa_full_tokens_ratio=0.25, page_size=16,
                        max_running_requests=4, dtype=torch.float32, device="cpu", max_step_tokens=512)
    if cache:
        kv.enable_prefix_caching(128, 8, 4)
    scheduler = Scheduler(EngineConfig(policy="prefill_first", max_running_requests=4, max_num_batched_tokens=512,
                                       prefill_chunk_tokens=512), kv, 512, prefix_cache=kv.prefix_cache)
    shared = list(range(1, 129))
    first, second = (Sequence(name, shared + tail, SamplingParams(max_tokens=2))
                     for name, tail in (("first", [3, 4]), ("second", [5] * 231)))
    for seq in (first, second):
        _serve_alone(kv, scheduler, seq)
        assert seq.finish_reason.value == "length", seq.request_id
    assert second.num_cached_tokens == (128 if cache else 0)  # (the restore kept: a smaller chunk fits beside it)


@pytest.mark.parametrize("overlap", [False, True])
def test_pages_a_step_in_flight_pins_are_waited_for_not_taken_as_too_little_memory(overlap):
    """A 16-page window pool; A decodes alone across a block boundary, whose snapshot the step in flight reserves
    (its pages pinned until that step's take-in), while B arrives. With overlap the next step is scheduled before
    that take-in: A, then B, waited for those pages instead of being failed as fitting no engine."""
    import torch

    from backend.config import EngineConfig
    from backend.memory.kv_manager import KVCacheManager
    from backend.request import SamplingParams
    from backend.scheduler import Scheduler, StepOutput, StepTiming

    from test_pools import _model_config

    kv = KVCacheManager(_model_config(), num_tokens=1024, swa_full_tokens_ratio=0.25, page_size=16,
                        max_running_requests=4, dtype=torch.float32, device="cpu", max_step_tokens=512)
    kv.enable_prefix_caching(128, 8, 4)
    scheduler = Scheduler(EngineConfig(policy="mixed", max_running_requests=4, max_num_batched_tokens=512), kv, 128,
                          prefix_cache=kv.prefix_cache, max_steps_in_flight=2 if overlap else 1)
    a = Sequence("A", list(range(1, 101)), SamplingParams(max_tokens=200))
    b = Sequence("B", list(range(500, 700)), SamplingParams(max_tokens=10))
    in_flight, ended = [], {}

    def take_in(plan):
        output = StepOutput([[7] for c in plan.chunks if c.samples], timing=StepTiming(duration_s=0.01))
        ended.update((o.request_id, o.finish_reason) for o in scheduler.update_from_output(plan, output) if o.finished)

    scheduler.add(a)
    for _ in range(600):
        if a.num_computed_tokens == 127 and b.request_id not in scheduler._by_id and not b.is_finished:
            scheduler.add(b)  # (A's next decode reaches the boundary at 128)
        plan = scheduler.schedule(now=0.0)
        if plan is not None:
            ended.update((s.request_id, s.finish_reason) for s in plan.aborted)
        if in_flight:
            take_in(in_flight.pop(0))
        if plan is not None and plan.chunks:
            (in_flight.append if overlap else take_in)(plan)
        kv.check()
        if len(ended) == 2:
            break
    assert {name: reason.value for name, reason in ended.items()} == {"A": "length", "B": "length"}
    assert len(a.output_ids) == 200 and len(b.output_ids) == 10


def test_a_head_that_cannot_fit_beside_running_requests_leaves_the_cache_alone():
    """B shares A's first 256 tokens, but its first chunk cannot fit beside A, which is decoding: evicting the cache
    frees nothing A holds, so B's tries evict nothing (they emptied the cache at once, B's own prefix too; A's
    decode may still evict for its own pages), and B restores A's prefix once A has ended."""
    import torch

    from backend.config import EngineConfig
    from backend.memory.kv_manager import KVCacheManager
    from backend.request import SamplingParams
    from backend.scheduler import Scheduler, StepOutput, StepTiming

    from test_pools import _model_config

    kv = KVCacheManager(_model_config(), num_tokens=1024, swa_full_tokens_ratio=0.5, page_size=16,
                        max_running_requests=4, dtype=torch.float32, device="cpu", max_step_tokens=512)
    kv.enable_prefix_caching(128, 8, 4)
    cache = kv.prefix_cache
    scheduler = Scheduler(EngineConfig(max_running_requests=4, max_num_batched_tokens=512, prefill_chunk_tokens=512),
                          kv, 512, prefix_cache=cache)
    a = Sequence("A", list(range(1000, 1300)), SamplingParams(max_tokens=240))
    b = Sequence("B", list(range(1000, 1256)) + [5] * 600, SamplingParams(max_tokens=2))
    scheduler.add(a)
    steps_b_waited = None
    while not (a.is_finished and b.is_finished):
        if a.num_computed_tokens >= 300 and steps_b_waited is None:
            assert cache.cached_length(b) == 256 and cache.stats.evictions == 0  # (A's boundaries at 128 and 256)
            scheduler.add(b)
            steps_b_waited = 0
        plan = scheduler.schedule(now=0.0)
        scheduler.update_from_output(plan, StepOutput([[7] for c in plan.chunks if c.samples],
                                                      timing=StepTiming(duration_s=0.01)))
        kv.check()
        if steps_b_waited is not None and steps_b_waited < 50:  # (A's own pages last it that long)
            steps_b_waited += 1
            assert b.status.value == "waiting" and cache.stats.evictions == 0, "evicted for a head that cannot fit"
    assert b.num_cached_tokens == 256


def test_a_chunk_fitted_in_an_empty_engine_may_evict_the_entries_holding_its_pages():
    """Two ended requests' entries hold every page of a 16-page window pool; a 300-token prompt (which the engine
    holds) cannot take its 512-token chunk whole even with the cache emptied, so its chunk is fitted smaller: the
    fitting counts the pages only entries hold as free, and evicts them (it counted only free pages and failed the
    request as fitting no engine)."""
    import torch

    from backend.config import EngineConfig
    from backend.memory.kv_manager import KVCacheManager
    from backend.request import SamplingParams
    from backend.scheduler import Scheduler

    from test_pools import _model_config

    kv = KVCacheManager(_model_config(), num_tokens=512, swa_full_tokens_ratio=0.5, page_size=16,
                        max_running_requests=4, dtype=torch.float32, device="cpu", max_step_tokens=512)
    kv.enable_prefix_caching(128, 8, 4)
    scheduler = Scheduler(EngineConfig(policy="prefill_first", max_running_requests=4, max_num_batched_tokens=512,
                                       prefill_chunk_tokens=512), kv, 512, prefix_cache=kv.prefix_cache)
    for name, prompt in (("first", list(range(1, 129))), ("second", list(range(200, 300)))):
        _serve_alone(kv, scheduler, Sequence(name, prompt, SamplingParams(max_tokens=3)))
    assert kv.pages_used()["window"] == kv.window_pool.num_pages and not any(kv.pages_held_by_requests().values())
    big = Sequence("big", list(range(400, 700)), SamplingParams(max_tokens=4))
    _serve_alone(kv, scheduler, big)
    assert big.finish_reason.value == "length" and len(big.output_ids) == 4
    assert kv.prefix_cache.stats.evictions > 0


def test_a_hit_whose_partly_filled_pages_evicting_cannot_free_evicts_nothing(tiny_checkpoint):
    """A restore needs a page of its own for each partly filled last page of the hit. When running requests hold every
    free page of a pool, and share every page the cache holds there (their own boundaries), evicting frees none:
    the restore fails without evicting (it emptied the cache down to the hit, at every step the request waited), and
    succeeds once pages are free again."""
    import torch

    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from backend.request import SamplingParams

    engine = LLMEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", num_tokens=4096, page_size=16,
                                    swa_full_tokens_ratio=0.5, enable_prefix_caching=True,
                                    overlap_scheduling=False))
    cache, hca = engine.kv.prefix_cache, engine.kv.compressed_pools["hca"].allocator
    generator = torch.Generator().manual_seed(1)
    first = torch.randint(2, 500, (200,), generator=generator).tolist()
    (result,) = engine.generate([first], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.generate([torch.randint(2, 500, (300,), generator=generator).tolist() for _ in range(3)],
                    SamplingParams(max_tokens=4, ignore_eos=True))
    follow_up = Sequence("again", first + result["output_ids"] + [7, 8, 9], SamplingParams(max_tokens=3))
    hit, entries = cache.cached_length(follow_up), len(cache._entries)
    assert hit > 0 and entries > 2
    held, shared = hca.allocate(hca.num_free), sorted(cache.holders("hca"))  # (as running requests would)
    hca.retain(shared)
    assert cache.match(follow_up) == 0
    assert (len(cache._entries), cache.stats.evictions) == (entries, 0)
    hca.free(held)
    hca.free(shared)
    assert cache.match(follow_up) == hit
    engine.kv.free(follow_up)
    engine.kv.check()
