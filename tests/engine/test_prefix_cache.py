"""Prefix caching: prompts sharing prefixes generate exactly what they generate without the cache.

Prefixes of many lengths (shorter and longer than the 128-token window, across the HCA boundaries at
128 and 256, block-aligned and not), chunked prefill, the mixed policy and preemption; the cache must be
hit, and every page must be accounted for (held by a request or a cache entry, freed when neither holds
it).
"""

from __future__ import annotations

import pytest
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.request import SamplingParams


def _engine(checkpoint, **settings) -> LLMEngine:
    """The uncached engine unless `enable_prefix_caching=True` (the reference every test compares with)."""
    base = dict(checkpoint=str(checkpoint), device="cpu", num_tokens=8192, page_size=16, swa_full_tokens_ratio=0.5,
                enable_prefix_caching=False)
    return LLMEngine(EngineConfig(**{**base, **settings}))


def _prompts(seed: int = 0) -> list[list[int]]:
    """A shared 300-token history; prompts continue it at many lengths, and one shares only 100 tokens."""
    gen = torch.Generator().manual_seed(seed)
    history = torch.randint(2, 500, (420,), generator=gen).tolist()
    tail = lambda n: torch.randint(2, 500, (n,), generator=gen).tolist()  # noqa: E731
    return [history[:300] + tail(5), history[:300] + tail(40), history[:256] + tail(1), history[:129] + tail(70),
            history[:420], history[:100] + tail(60), history[:300]]


@pytest.mark.parametrize("settings", [dict(), dict(prefill_chunk_tokens=48), dict(policy="mixed"),
                                      dict(max_running_requests=2)])
def test_cached_prefixes_generate_exactly_what_recomputing_gives(tiny_checkpoint, settings):
    """Greedy tokens identical, and the log-probabilities of every generated token (log_softmax of the logits,
    and of the top 5) within 1e-5."""
    prompts = _prompts()
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5)
    plain = _engine(tiny_checkpoint, **settings)
    expected = plain.generate(prompts, params)
    cached = _engine(tiny_checkpoint, enable_prefix_caching=True, **settings)
    got = cached.generate(prompts[:1], params) + cached.generate(prompts[1:], params)  # the first fills the cache
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in expected]
    for mine, theirs in zip(got, expected):
        for a, b in zip(mine["logprobs"], theirs["logprobs"]):
            assert abs(a.logprob - b.logprob) <= 1e-5
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) <= 1e-5
    stats = cached.kv.prefix_cache.stats
    assert stats.hits >= 4 and stats.cached_tokens >= 4 * 128, stats
    assert sum(r.num_cached_tokens for r in cached.scheduler.records) == stats.cached_tokens
    cached.kv.check()
    cached.kv.prefix_cache.clear()
    cached.kv.check()
    assert all(used == 0 for used in cached.kv.pages_used().values())


@pytest.mark.parametrize("length,served", [(128, 0), (256, 128)])
def test_a_prompt_cached_whole_still_computes_its_last_token(tiny_checkpoint, length, served):
    """The same block-aligned prompt twice: the cache holds all of it, but the request's first token needs the
    logits of its last prompt token, so a lookup serves at most all but that one (the rest is recomputed)."""
    prompt = torch.randint(2, 500, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    (expected,) = _engine(tiny_checkpoint).generate([prompt], params)
    cached = _engine(tiny_checkpoint, enable_prefix_caching=True)
    first = cached.generate([prompt], params) + cached.generate([prompt], params)
    assert [r["output_ids"] for r in first] == [expected["output_ids"]] * 2
    stats = cached.kv.prefix_cache.stats  # (its blocks are 128 tokens: the boundary before the last token)
    assert (stats.hits, stats.cached_tokens) == (int(served > 0), served), stats
    cached.kv.check()


def test_preempted_requests_resume_from_the_cache_and_eviction_makes_room(tiny_checkpoint):
    """Pools so small that requests preempt each other and cached pages must be evicted to admit them."""
    prompts = _prompts(seed=1)
    params = SamplingParams(max_tokens=150, ignore_eos=True)  # decodes grow past what the pools hold
    expected = [r["output_ids"] for r in _engine(tiny_checkpoint).generate(prompts, params)]
    tight = _engine(tiny_checkpoint, enable_prefix_caching=True, num_tokens=512, swa_full_tokens_ratio=1.0,
                    max_running_requests=4)
    assert [r["output_ids"] for r in tight.generate(prompts, params)] == expected
    stats = tight.kv.prefix_cache.stats
    assert stats.evictions > 0 and tight.stats()["num_preemptions"] > 0 and stats.readmitted_hits > 0, stats
    # the hit rate's counts are the new requests' alone: each prompt queried once, whatever its readmissions
    assert stats.queried_tokens == sum(map(len, prompts)) and stats.hits <= len(prompts), stats
    assert stats.readmitted_queried_tokens > 0 and stats.readmitted_cached_tokens > 0, stats
    tight.kv.check()


def test_with_two_ranks_the_workers_replay_the_caches_copies(parallel_checkpoint):
    """TP=2 + EP=2 with the cache: a chat turn restored from the cache (its pages and rings copied on rank 0
    and replayed on the worker), and a prompt sharing the block boundary at 128 (snapshotted inside the first
    prompt's chunk, on every rank by the step itself), give the single rank's uncached tokens."""
    gen = torch.Generator().manual_seed(4)
    first = torch.randint(2, 500, (200,), generator=gen).tolist()
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    plain = _engine(parallel_checkpoint)
    (expected_first,) = plain.generate([first], params)
    second = first + expected_first["output_ids"] + torch.randint(2, 500, (30,), generator=gen).tolist()
    third = first[:150] + torch.randint(2, 500, (20,), generator=gen).tolist()
    expected = plain.generate([second], params) + plain.generate([third], params)
    sharded = _engine(parallel_checkpoint, enable_prefix_caching=True, tensor_parallel_size=2,
                      expert_parallel_size=2)
    try:
        (got_first,) = sharded.generate([first], params)
        got = sharded.generate([second], params)
        assert sharded.kv.prefix_cache.stats.cached_tokens == 200 + 7 - 1
        got += sharded.generate([third], params)
        assert sharded.kv.prefix_cache.stats.cached_tokens == 200 + 7 - 1 + 128
    finally:
        sharded.shutdown()
    assert got_first["output_ids"] == expected_first["output_ids"]
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in expected]


@pytest.mark.parametrize("first_length", [90, 200, 333])
def test_a_chat_turn_continues_exactly_where_the_previous_request_ended(tiny_checkpoint, first_length):
    """The next turn resends the whole conversation: it restores the previous request's exact end (not a block
    boundary: the open HCA window and the partly filled window page come back too) and generates what the
    uncached engine generates."""
    gen = torch.Generator().manual_seed(first_length)
    first = torch.randint(2, 500, (first_length,), generator=gen).tolist()
    message = torch.randint(2, 500, (37,), generator=gen).tolist()
    params = SamplingParams(max_tokens=9, ignore_eos=True, logprobs=3)
    cached = _engine(tiny_checkpoint, enable_prefix_caching=True)
    (reply,) = cached.generate([first], params)
    second = first + reply["output_ids"] + message
    (got,) = cached.generate([second], params)
    (expected,) = _engine(tiny_checkpoint).generate([second], params)
    assert got["output_ids"] == expected["output_ids"]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got["logprobs"], expected["logprobs"])) <= 1e-5
    assert cached.kv.prefix_cache.stats.cached_tokens == first_length + 9 - 1  # all but the last reply token
    assert (reply["num_cached_tokens"], got["num_cached_tokens"]) == (0, first_length + 9 - 1)  # per request
    assert cached.kv.prefix_cache.stats.queried_tokens == len(first) + len(second)  # the hit rate's denominator
    cached.kv.check()


@pytest.mark.parametrize("settings", [dict(), dict(prefill_chunk_tokens=300), dict(max_running_requests=2)])
def test_prompts_sharing_a_system_prompt_share_it_whatever_their_chunks(tiny_checkpoint, settings):
    """A 700-token system prompt computed in chunks that do not end at block boundaries: its states at the
    boundaries inside the chunks are kept by the steps themselves (chunks are the uncached engine's), so other
    prompts starting with it restore 640 positions, and generate exactly what the uncached engine generates."""
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(2, 500, (700,), generator=gen).tolist()
    prompts = [system + torch.randint(2, 500, (n,), generator=gen).tolist() for n in (20, 45, 3)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    plain = _engine(tiny_checkpoint, **settings)
    expected = plain.generate(prompts[:1], params) + plain.generate(prompts[1:], params)
    cached = _engine(tiny_checkpoint, enable_prefix_caching=True, **settings)
    got = cached.generate(prompts[:1], params)
    chunks = lambda engine: [r.num_prefill_tokens for r in list(engine.scheduler.records)[:4]]  # noqa: E731
    assert chunks(cached) == chunks(plain)
    assert {e.length for e in cached.kv.prefix_cache._entries.values()} >= {128, 256, 384, 512, 640}
    got += cached.generate(prompts[1:], params)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in expected]
    for mine, theirs in zip(got, expected):
        assert max(abs(a.logprob - b.logprob) for a, b in zip(mine["logprobs"], theirs["logprobs"])) <= 1e-5
    assert cached.kv.prefix_cache.stats.cached_tokens == 2 * 640
    assert [r["num_cached_tokens"] for r in got] == [0, 640, 640]
    cached.kv.check()


def test_a_failed_step_keeps_nothing_it_may_have_half_written(tiny_checkpoint, monkeypatch):
    """A forward that raises fails its requests; the snapshots it was to write are given back, and no entry
    is made from its state."""
    cached = _engine(tiny_checkpoint, enable_prefix_caching=True)
    cache = cached.kv.prefix_cache
    free_before = cache.num_free_snapshots

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(cached.model, "forward", broken)
    (result,) = cached.generate([[2 + i % 400 for i in range(598)]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert "injected" in result["error"]
    assert cache.snapshot_stats()["entries"] == 0 and cache.num_free_snapshots == free_before
    assert cache.num_reserved == 0
    cached.kv.check()
    assert all(used == 0 for used in cached.kv.pages_used().values())


def test_a_failed_step_leaves_no_entry_from_the_chunk_in_flight_after_it(tiny_checkpoint, monkeypatch):
    """Overlap: a prompt's first chunk fails while its second, scheduled before the failure was taken in, runs over
    positions the first never wrote. That chunk's block boundary is no cache entry: a later prompt sharing the block
    generates what the uncached engine does."""
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(2, 500, (200,), generator=gen).tolist()
    second = first[:128] + torch.randint(2, 500, (30,), generator=gen).tolist()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    settings = dict(prefill_chunk_tokens=64, num_tokens=8192)
    expected = _engine(tiny_checkpoint, enable_prefix_caching=False, **settings).generate([second], params)[0]
    cached = _engine(tiny_checkpoint, enable_prefix_caching=True, **settings)
    assert cached.overlap
    forward, calls = cached.model.forward, []

    def first_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return forward(*args, **kwargs)

    monkeypatch.setattr(cached.model, "forward", first_fails)
    assert "injected" in cached.generate([first], params)[0]["error"]
    assert len(calls) >= 2  # (the second chunk ran)
    cache = cached.kv.prefix_cache
    assert cache.snapshot_stats()["entries"] == 0 and cache.num_reserved == 0
    got = cached.generate([second], params)[0]
    assert got["output_ids"] == expected["output_ids"] and not got["num_cached_tokens"]
    cached.kv.check()


def test_a_mixed_workload_with_cancels_preemption_and_eviction_stays_exact(tiny_checkpoint):
    """60 requests arriving over time: prompts on three shared system prompts, chat turns continuing finished
    requests, every seventh cancelled after its third token, in pools so small that requests are preempted and
    entries evicted. Every finished request generates what the uncached engine generates for its prompt, a
    cancelled one a prefix of it, and no page is left held when all are done."""
    from backend.request import RequestOutput, Sequence

    gen = torch.Generator().manual_seed(11)
    randoms = lambda n: torch.randint(2, 500, (n,), generator=gen).tolist()  # noqa: E731
    systems = [randoms(n) for n in (150, 260, 400)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine = _engine(tiny_checkpoint, enable_prefix_caching=True, num_tokens=768, swa_full_tokens_ratio=1.0,
                     max_running_requests=4, prefix_cache_entries=12, prefix_cache_end_entries=4)
    outputs, finished, prompts = {}, [], {}

    def on_output(out: RequestOutput):
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if len(outputs[out.request_id]) >= 3 and int(out.request_id[1:]) % 7 == 6:
            engine.abort(out.request_id)
        if out.finished:
            finished.append(out.request_id)

    for i in range(60):
        done = [r for r in finished if not int(r[1:]) % 7 == 6]
        if i % 3 == 2 and done:  # a chat turn: a finished conversation and a new message
            previous = done[int(torch.randint(len(done), (1,), generator=gen))]
            prompt = prompts[previous] + outputs[previous] + randoms(int(torch.randint(5, 60, (1,), generator=gen)))
        else:
            prompt = systems[i % 3] + randoms(int(torch.randint(1, 120, (1,), generator=gen)))
        prompt = prompt[-600:]  # what the pools can hold with the reply
        prompts[f"r{i}"] = prompt
        engine.submit(Sequence(f"r{i}", prompt, params), on_output)
        for _ in range(int(torch.randint(0, 4, (1,), generator=gen))):
            engine.step()
    while len(finished) < 60:
        engine.step()

    expected = _engine(tiny_checkpoint, num_tokens=16384).generate(list(prompts.values()), params)
    cancelled = 0
    for (request_id, prompt), want in zip(prompts.items(), expected):
        got = outputs.get(request_id, [])
        if int(request_id[1:]) % 7 == 6:
            cancelled += 1
            assert got == want["output_ids"][:len(got)], request_id
        else:
            assert got == want["output_ids"], request_id
    stats = engine.kv.prefix_cache.stats
    assert cancelled == 8 and stats.hits >= 10 and stats.evictions > 0 and engine.stats()["num_preemptions"] > 0, \
        (stats, engine.stats()["num_preemptions"])
    engine.kv.check()
    assert all(held == 0 for held in engine.kv.pages_held_by_requests().values())


def test_a_block_boundary_is_restored_from_a_light_snapshot_without_the_hca_ring(tiny_checkpoint):
    """A boundary's snapshot slot holds no HCA ring: at a multiple of 128 every HCA window is closed, so the
    continuation never reads what its own slot's HCA ring held before. Poisoned with NaN, the outputs are still
    exactly the uncached engine's."""
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(2, 500, (300,), generator=gen).tolist()
    prompts = [shared + torch.randint(2, 500, (n,), generator=gen).tolist() for n in (9, 40)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)
    expected = _engine(tiny_checkpoint).generate(prompts, params)
    cached = _engine(tiny_checkpoint, enable_prefix_caching=True, prefix_cache_end_entries=1)
    cache, state = cached.kv.prefix_cache, cached.kv.state_pool
    (first,) = cached.generate(prompts[:1], params)
    boundaries = [e for e in cache._entries.values() if not e.request_end]
    assert [e.length for e in boundaries] == [128, 256] and all(state.is_light(e.snapshot) for e in boundaries)
    assert state.kv["hca"].shape[1] < state.kv["csa"].shape[1]  # light slots have no HCA ring at all
    for rings in (state.kv["hca"], state.gate["hca"]):
        rings.fill_(float("nan"))
    (second,) = cached.generate(prompts[1:], params)
    assert second["num_cached_tokens"] == 256
    for got, want in zip((first, second), expected):
        assert got["output_ids"] == want["output_ids"]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got["logprobs"], want["logprobs"])) <= 1e-5
    cached.kv.check()


def test_a_step_that_fails_to_build_does_not_lose_an_earlier_requests_snapshot(tiny_checkpoint, monkeypatch):
    """A request's end entry is matchable once it ends, its compressor state saved by the next step's copies: when
    that step fails before it is launched (its batch could not be staged), the save goes with the step after it, so a
    later request restoring that entry computes what an uncached engine computes."""
    from backend.engine_core import EngineCore

    first = torch.randint(2, 500, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = _engine(tiny_checkpoint, enable_prefix_caching=True)
    (ended,) = engine.generate([first], params)
    assert any(op[0] == "save" for op in engine.kv.prefix_cache._pending)  # (what the next step copies first)
    real, failures = EngineCore._forward, []

    def staging_fails_once(core, *args, **kwargs):
        if not failures:
            failures.append(True)
            raise RuntimeError("staging failed")
        return real(core, *args, **kwargs)

    monkeypatch.setattr(EngineCore, "_forward", staging_fails_once)
    (failed,) = engine.generate([[7] * 40], params)
    assert failed["finish_reason"] == "error" and failures
    # (past position 256, where the HCA compressor closes a block over the restored state: a stale one shows)
    later = first + ended["output_ids"] + torch.randint(2, 500, (100,), generator=torch.Generator()).tolist()
    scored = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)  # (a stale state moves them, if no token)
    (got,) = engine.generate([later], scored)
    (want,) = _engine(tiny_checkpoint).generate([later], scored)
    assert got["num_cached_tokens"] == len(first) + len(ended["output_ids"]) - 1  # (the end entry)
    assert got["output_ids"] == want["output_ids"]
    assert [lp.logprob for lp in got["logprobs"]] == pytest.approx([lp.logprob for lp in want["logprobs"]], abs=1e-5)


def test_with_drafts_a_boundary_serves_only_prompts_that_go_on_with_the_token_its_draft_entry_read(tiny_checkpoint):
    """The MTP draft layer's window entry at P - 1 was computed with the token at P. A prompt sharing the first 256
    tokens of a cached one but not its 257th restores the boundary at 128 instead (restoring 256, it drafted from a
    stale entry: a seeded sampled request drew other tokens than without the cache); one that goes on with the same
    token restores 256. Both generate what they generate without the cache."""
    def tokens(count: int, seed: int) -> list[int]:
        return torch.randint(2, 500, (count,), generator=torch.Generator().manual_seed(seed)).tolist()

    history = tokens(300, 11)
    other_at_256, same_at_256 = history[:256] + tokens(12, 4005), history[:257] + tokens(11, 4006)
    assert other_at_256[256] != history[256]
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=123)
    speculative = dict(num_speculative_tokens=2, draft_sampling="sample")
    plain = _engine(tiny_checkpoint, **speculative)
    expected = [plain.generate([prompt], params)[0]["output_ids"] for prompt in (other_at_256, same_at_256)]
    cached = _engine(tiny_checkpoint, enable_prefix_caching=True, **speculative)
    cached.generate([history], params)  # (keeps the boundaries at 128 and 256)
    got = [cached.generate([prompt], params)[0] for prompt in (other_at_256, same_at_256)]
    assert [r["output_ids"] for r in got] == expected
    assert [r["num_cached_tokens"] for r in got] == [128, 256]
    # A prompt of exactly 256 tokens: its boundary at 256 is where its chunk ends, and the token there is the first
    # one it drew (known as the step is taken in, before it is appended).
    exact = tokens(256, 12)
    (first,) = cached.generate([exact], params)
    drew = first["output_ids"][0]
    got = [cached.generate([exact + [token] + tokens(11, 13)], params)[0]["num_cached_tokens"]
           for token in ((drew + 1) % 500 + 2, drew)]
    assert got == [128, 256]


def test_two_continuations_of_one_end_state_in_a_partly_filled_window_page(tiny_checkpoint):
    """A request's end (105 positions: its window's last page partly filled) cached, then continued by two prompts in
    one batch: each must get its own copy of that page before writing past the shared positions. (Copying only
    full pages went unnoticed while every cached end the tests used was page-aligned.) Nothing is held after."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, 500, (100,), generator=gen).tolist()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cached = _engine(tiny_checkpoint, enable_prefix_caching=True)
    (first,) = cached.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))
    history = prompt + first["output_ids"]
    prompts = [history + torch.randint(2, 500, (n,), generator=gen).tolist() for n in (3, 7)]
    got = cached.generate(prompts, params)
    assert cached.kv.prefix_cache.stats.hits == 2 and cached.kv.prefix_cache.stats.cached_tokens >= 2 * 100
    uncached = _engine(tiny_checkpoint)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in uncached.generate(prompts, params)]
    assert not uncached.kv._live and not cached.kv._live  # (every request's handle dropped when it ended)
