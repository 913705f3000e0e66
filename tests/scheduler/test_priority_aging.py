"""Priority without starvation (priority_aging_s: a worse priority waits a bounded time) and request deadlines.

Time is simulated: one engine step is one second (FakeEngine.step(now=t)).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_scheduler import FakeEngine, FakeMemory, batch_of, make_scheduler, make_seq  # tests/scheduler: on sys.path

from backend.request import FinishReason, SamplingParams, Sequence


def _admissions(scheduler, engine, arrivals, horizon):
    """Run `horizon` steps (1 s each), adding arrivals[t] (a list of (rid, priority)) at step t; returns
    {rid: step at which its first chunk ran} and {rid: arrival step}."""
    admitted, arrived = {}, {}
    for t in range(horizon):
        for rid, priority in arrivals.get(t, []):
            scheduler.add(make_seq(rid, 1, max_tokens=1, priority=priority))
            arrived[rid] = t
        plan = engine.step(now=float(t))
        for rid, _ in batch_of(plan) if plan else []:
            admitted.setdefault(rid, t)
    return admitted, arrived


def _stream_with_one_low_priority_request(aging):
    """One priority-0 request a step (the server's whole capacity: one request per step) and a backlog of 5;
    at step 10 a priority-3 request arrives."""
    scheduler = make_scheduler(max_running_requests=1, priority_aging_s=aging)
    arrivals = {t: [(f"p0-{t}", 0)] for t in range(400)}
    arrivals[0] += [(f"backlog-{i}", 0) for i in range(5)]
    arrivals[10].append(("low", 3))
    return _admissions(scheduler, FakeEngine(scheduler), arrivals, 400)


def test_a_low_priority_request_is_admitted_within_the_documented_bound():
    """With priority_aging_s = 10 the priority-3 request is overtaken only by priority-0 requests that arrived
    at most 3 * 10 s after it: it runs by 10 + 30 + the 6 requests queued ahead of it at most."""
    admitted, arrived = _stream_with_one_low_priority_request(aging=10.0)
    assert arrived["low"] + 3 * 10 <= admitted["low"] <= arrived["low"] + 3 * 10 + 6 + 1
    overtook = [rid for rid, t in admitted.items() if t < admitted["low"] and arrived[rid] > arrived["low"]]
    assert overtook and all(arrived[rid] <= arrived["low"] + 30 for rid in overtook)


@pytest.mark.parametrize("strict", [None, 0.0])
def test_strict_priority_starves_the_same_request(strict):
    """The failure the aging prevents: with strict priority (priority_aging_s 0, or None in code) the stream keeps
    it waiting for the whole run."""
    admitted, _ = _stream_with_one_low_priority_request(aging=strict)
    assert "low" not in admitted


requests = st.lists(st.tuples(st.integers(0, 40), st.integers(-1, 3)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(requests=requests, aging=st.sampled_from([1.0, 5.0, 20.0]), max_running=st.integers(1, 3))
def test_no_request_is_overtaken_by_one_that_arrived_past_its_aging_bound(requests, aging, max_running):
    """For any arrivals and priorities: whenever B is admitted after A although B was already waiting when A
    was admitted, A's key (priority * aging + arrival) was not larger than B's: so B is overtaken only by
    requests arriving less than (p_B - p_A) * aging after it, and every request is eventually admitted."""
    scheduler = make_scheduler(max_running_requests=max_running, priority_aging_s=aging)
    arrivals: dict[int, list] = {}
    for i, (t, priority) in enumerate(requests):
        arrivals.setdefault(t, []).append((f"r{i}", priority))
    priority = {f"r{i}": p for i, (_, p) in enumerate(requests)}
    admitted, arrived = _admissions(scheduler, FakeEngine(scheduler), arrivals, 200)
    assert set(admitted) == set(priority)  # nobody waits forever
    key = {rid: priority[rid] * aging + arrived[rid] for rid in priority}
    for a in admitted:
        for b in admitted:
            if admitted[a] < admitted[b] and arrived[b] <= admitted[a]:
                assert key[a] <= key[b] or arrived[a] < arrived[b] and key[a] == key[b], (a, b)


# --- deadlines --------------------------------------------------------------------------------------------------


def test_requests_past_their_timeout_end_waiting_or_running_and_free_their_pages():
    memory = FakeMemory()
    scheduler = make_scheduler(memory, max_running_requests=1)
    engine = FakeEngine(scheduler)
    running = Sequence("running", [1, 2, 3], SamplingParams(max_tokens=100, timeout_ms=2500))
    waiting = Sequence("waiting", [1, 2], SamplingParams(max_tokens=5, timeout_ms=1500))
    patient = Sequence("patient", [1], SamplingParams(max_tokens=2))
    for seq in (running, waiting, patient):
        scheduler.add(seq)
    for t in range(6):
        engine.step(now=float(t))
    assert engine.finals["running"] == [FinishReason.TIMEOUT] and len(running.output_ids) == 3  # t = 0, 1, 2
    assert engine.finals["waiting"] == [FinishReason.TIMEOUT] and not waiting.output_ids  # never admitted
    assert engine.finals["patient"] == [FinishReason.LENGTH]
    assert scheduler.counters.num_timed_out == 2
    engine.run_until_idle()
    assert memory.num_used == 0 and memory.num_free == memory.num_pages
