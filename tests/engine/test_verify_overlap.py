"""Overlapped verify steps: with one greedy draft a row and static steps, the step after a verify is scheduled before
the verify is taken in, as if it accepted every draft; a row whose verify accepted fewer has its next chunk voided.

The engines run with `cuda_graphs=True` on CPU (static steps, the draft chain on the device: `Drafter.chain_early`)
and `OracleDrafter`'s drafts (the reference continuation, some corrupted), which it also leaves where an overlapped
verify reads them. Whatever the drafts, the tokens must be those without speculation, the log-probabilities those of
the same engine taking every step in before the next, and no page may be left held. Whether overlapping pays is the
engine's estimate from the steps' costs (`VerifyOverlap`): on CPU the forward dwarfs the host's work, so it would
not; these tests make it pay (a fake of that one part), but for `test_the_engine_overlaps_verify_steps_where_it_pays`,
where the draft layer's own drafts (all rejected) must keep the engine taking every step in first.
"""

from __future__ import annotations

import time

import pytest

from backend.engine_core import VerifyOverlap
from backend.request import FinishReason, SamplingParams, Sequence
from backend.scheduler.scheduler import Scheduler

from .test_speculative import OracleDrafter, _engine, _ids, _prompts

LENGTHS = [1, 7, 30, 12, 20, 64]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """The prompts and their tokens without speculation, max_tokens differing by request."""
    prompts = _prompts(LENGTHS, seed=5)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 5, 33, 17, 40, 26)]
    return prompts, params, _ids(_engine(tiny_checkpoint, max_running_requests=8).generate(prompts, params))


class Counts:
    """The verify chunks scheduled while the verify before them was in flight, and those of them voided (overlapping
    made to pay, unless `pays` is False)."""

    def __init__(self, monkeypatch, pays: bool = True):
        self.optimistic = self.void = 0
        if pays:
            monkeypatch.setattr(VerifyOverlap, "pays", lambda overlap: True)
        commit, void = Scheduler._commit, Scheduler._void_successor

        def counting_commit(scheduler, plan, now):
            self.optimistic += sum(chunk.optimistic for chunk in plan.chunks)
            return commit(scheduler, plan, now)

        def counting_void(scheduler, seq):
            chunk = scheduler._inflight[0].plan.chunk_of(seq) if scheduler._inflight else None
            self.void += chunk is not None and chunk.optimistic
            return void(scheduler, seq)

        monkeypatch.setattr(Scheduler, "_commit", counting_commit)
        monkeypatch.setattr(Scheduler, "_void_successor", counting_void)


def _run(checkpoint, prompts, params, expected, error_rate: float, overlap: bool, logprobs: int | None = None):
    engine = _engine(checkpoint, num_speculative_tokens=1, cuda_graphs=True, max_running_requests=8,
                     overlap_scheduling=overlap)
    engine.executor.drafter = OracleDrafter(engine.executor.drafter, dict(enumerate(expected)), error_rate,
                                            engine.vocab_size, dict(enumerate(map(len, prompts))))
    if logprobs is not None:
        params = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, logprobs=logprobs) for p in params]
    results = engine.generate(prompts, params)
    engine.kv.check()
    assert all(held == 0 for held in engine.kv.pages_held_by_requests().values())  # nothing leaked
    return results, engine


@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0])
def test_overlapped_verify_steps_emit_the_tokens_without_speculation(tiny_checkpoint, reference, monkeypatch,
                                                                     error_rate):
    """Drafts all right (nearly every overlapped verify stands), some wrong, all wrong (every one is voided): the
    tokens of every request are those without speculation, each request ending at its own max_tokens."""
    prompts, params, expected = reference
    counts = Counts(monkeypatch)
    results, engine = _run(tiny_checkpoint, prompts, params, expected, error_rate, overlap=True)
    assert _ids(results) == expected
    assert counts.optimistic > 20
    stood = counts.optimistic - counts.void
    if error_rate == 0.0:  # (a row's last verifies, past its max_tokens, verify padding drafts)
        assert stood > 4 * counts.void
    elif error_rate == 1.0:
        assert stood == 0 and engine.stats()["num_accepted_tokens"] == 0
    else:
        assert stood > 0 and counts.void > 0


def test_overlapped_verify_steps_equal_steps_one_at_a_time(tiny_checkpoint, reference, monkeypatch):
    """The same engine and drafts with each step taken in before the next: the same tokens and log-probabilities
    (within rounding: a verify's batch holds other rows), fewer verifies of the requests' own (the overlapped ones
    that stood count once)."""
    prompts, params, expected = reference
    counts = Counts(monkeypatch)
    overlapped, engine = _run(tiny_checkpoint, prompts, params, expected, 0.3, overlap=True, logprobs=2)
    assert counts.optimistic > 0
    counts.optimistic = 0
    one_at_a_time, alone = _run(tiny_checkpoint, prompts, params, expected, 0.3, overlap=False, logprobs=2)
    assert counts.optimistic == 0
    for a, b in zip(overlapped, one_at_a_time):
        assert a["output_ids"] == b["output_ids"] and len(a["logprobs"]) == len(b["logprobs"])
        for x, y in zip(a["logprobs"], b["logprobs"]):
            assert abs(x.logprob - y.logprob) < 1e-4 and x.rank == y.rank
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_the_engine_overlaps_verify_steps_where_it_pays(tiny_checkpoint, reference, monkeypatch):
    """The estimate: with α the share of drafts accepted, overlapping pays where host + step > (2 - α) max(host, step).
    Host-bound steps with drafts accepted pay, device-bound ones or drafts rejected do not; nothing before 16 drafts.
    Through the engine, the draft layer's own drafts (nearly all rejected): every verify taken in before the next is
    scheduled, the tokens those without speculation."""
    def estimate(host_s, device_s, drafted, accepted, steps=4):
        overlap = VerifyOverlap()
        for _ in range(steps):
            overlap.observe(host_s, device_s, drafted, accepted)
        return overlap.pays()

    assert estimate(1.0, 1.0, 8, 6)  # balanced, 75 % accepted: 2 > 1.25
    assert not estimate(1.0, 1.0, 8, 0)  # all rejected: 2 > 2 fails
    assert not estimate(0.1, 1.0, 8, 6)  # device-bound: 1.1 > 1.25 fails
    assert estimate(0.1, 1.0, 8, 8)  # ... unless every draft stands
    assert not estimate(1.0, 1.0, 8, 6, steps=1)  # 8 drafts seen: not yet
    prompts, params, expected = reference
    counts = Counts(monkeypatch, pays=False)
    engine = _engine(tiny_checkpoint, num_speculative_tokens=1, cuda_graphs=True, max_running_requests=8)
    assert _ids(engine.generate(prompts, params)) == expected
    assert engine.core.overlap and engine.core.verify_overlap.seen > 16 and counts.optimistic == 0


def test_arrivals_aborts_and_preemptions_beside_overlapped_verify_steps(tiny_checkpoint, monkeypatch):
    """Requests that arrive while verifies run ahead (they wait one step: a step scheduled ahead holds the running
    verifies alone), one aborted, and pools too small for all at once (preemptions, the recompute of a request whose
    verify ran ahead): every finished request gets the tokens without speculation, nothing leaks."""
    prompts = _prompts([100, 100, 100, 100, 30], seed=1)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = _ids(_engine(tiny_checkpoint).generate(prompts, params))
    counts = Counts(monkeypatch)
    engine = _engine(tiny_checkpoint, num_speculative_tokens=1, cuda_graphs=True, num_tokens=512,
                     swa_full_tokens_ratio=1.0)
    engine.executor.drafter = OracleDrafter(engine.executor.drafter, dict(enumerate(expected)), 0.2,
                                            engine.vocab_size, dict(enumerate(map(len, prompts))))
    outputs = {i: [] for i in range(len(prompts))}
    ended = {}

    def submit(i):
        def on_output(out):
            outputs[i].extend(out.new_token_ids)
            if out.finished:
                ended[i] = out.finish_reason
        engine.submit(Sequence(f"offline-{i}-{time.monotonic_ns()}", list(prompts[i]), params), on_output)
        return i

    for i in range(3):
        submit(i)
    steps = 0
    while len(ended) < len(prompts):
        engine.step()
        steps += 1
        if steps == 12:  # while verifies run ahead
            submit(3)
            submit(4)
        if steps == 20:
            engine.abort(next(r for r in engine.scheduler._by_id if r.startswith("offline-4-")))
        assert steps < 2000
    engine.drain()
    assert ended[4] == FinishReason.CANCELLED and outputs[4] == expected[4][:len(outputs[4])]
    assert [outputs[i] for i in range(4)] == expected[:4] and all(ended[i] == FinishReason.LENGTH for i in range(4))
    assert engine.stats()["num_preemptions"] > 0 and counts.optimistic > 0
    engine.kv.check()
    assert all(held == 0 for held in engine.kv.pages_held_by_requests().values())
