"""Deadlines (a request's, a grammar compile's) while verify steps are scheduled ahead, and the itl_target_ms budget
of a prefill that starts after a cached prefix, or that cannot start at all."""

from __future__ import annotations

import math
from concurrent.futures import Future

import pytest
from test_scheduler import FakeEngine, FakeMemory, make_scheduler, make_seq  # tests/scheduler: on sys.path

from backend.request import FinishReason, SamplingParams, Sequence
from backend.scheduler import StepOutput, StepTiming
from backend.scheduler.scheduler import NoPrefixCache


def _all_accepted(plan) -> StepOutput:
    """Every sampling row emits its drafts and the token after them, and drafts one more."""
    rows = [chunk for chunk in plan.chunks if chunk.samples]
    return StepOutput([[7] * (1 + len(c.drafts)) for c in rows], drafts={row: [7] for row in range(len(rows))},
                      timing=StepTiming(duration_s=0.01))


def test_a_deadline_ends_a_request_whose_verifies_are_scheduled_ahead():
    """k = 1, every draft accepted, the next verify scheduled before the one in flight is taken in (as the engine
    does while `can_schedule_ahead`): a request with timeout_ms ends TIMEOUT at its deadline, not at max_tokens."""
    scheduler = make_scheduler(FakeMemory(), policy="mixed", num_speculative_tokens=1, max_steps_in_flight=2)
    seq = Sequence("r", list(range(1, 9)), SamplingParams(max_tokens=200, timeout_ms=1000))
    scheduler.add(seq)
    now = 0.0
    plan = scheduler.schedule(now=now)
    scheduler.update_from_output(plan, _all_accepted(plan))
    in_flight, ahead = [scheduler.schedule(now=0.1)], 0
    in_flight[0].chains_on_device = True
    while seq.finish_reason is None and now < 10:
        now += 0.1
        plan = scheduler.schedule(now=now, ahead=True) if scheduler.can_schedule_ahead(now) else None
        ahead += plan is not None
        done = in_flight.pop(0)
        scheduler.update_from_output(done, _all_accepted(done))
        plan = plan or scheduler.schedule(now=now)
        if plan is not None and plan.chunks:
            plan.chains_on_device = True
            in_flight.append(plan)
    assert ahead > 3 and seq.finish_reason is FinishReason.TIMEOUT and now < 1.3


class _ExpiringGrammar:
    """RequestGrammar's contract as the scheduler reads it: ready once compiled, failed, or past its compile deadline
    (which no future's callback announces)."""

    def __init__(self):
        self.future, self.expired = Future(), False

    @property
    def ready(self) -> bool:
        return self.future.done() or self.expired

    @property
    def error(self) -> str | None:
        return "the output constraint did not compile within 60 s" if self.expired else None


def test_a_grammar_past_its_compile_deadline_ends_its_request_while_verifies_are_scheduled_ahead():
    """k = 1, every draft accepted, verifies scheduled ahead: a constrained request whose grammar passes its compile
    deadline is failed at the next step, not once the ahead streak ends (it went on for the other request's life)."""
    scheduler = make_scheduler(FakeMemory(), policy="mixed", num_speculative_tokens=1, max_steps_in_flight=2)
    runner, constrained = make_seq("runner", 8, max_tokens=400), make_seq("constrained", 8, max_tokens=5)
    constrained.grammar = _ExpiringGrammar()
    scheduler.add(runner)
    scheduler.add(constrained)
    plan = scheduler.schedule(now=0.0)
    scheduler.update_from_output(plan, _all_accepted(plan))
    in_flight = [scheduler.schedule(now=0.0)]
    in_flight[0].chains_on_device = True
    constrained.grammar.expired = True
    steps = 0
    while constrained.finish_reason is None and runner.finish_reason is None:
        steps += 1
        plan = scheduler.schedule(now=0.0, ahead=True) if scheduler.can_schedule_ahead(0.0) else None
        done = in_flight.pop(0)
        scheduler.update_from_output(done, _all_accepted(done))
        plan = plan or scheduler.schedule(now=0.0)
        if plan is not None and plan.chunks:
            plan.chains_on_device = True
            in_flight.append(plan)
    assert constrained.finish_reason is FinishReason.ERROR and "did not compile" in constrained.error
    assert steps <= 2 and runner.finish_reason is None


def _cost_of_pairs(plan) -> float:
    """A step at a fixed cost plus one per token and one per token pair attended."""
    pairs = sum(c.num_tokens * (c.start + (c.num_tokens + 1) / 2) for c in plan.chunks)
    return 0.005 + 20e-6 * plan.num_prefill_tokens + 1e-4 * plan.num_decode_tokens + 2e-9 * pairs


def _decoding_beside_a_learned_long_prefill():
    """Mixed steps under a 100 ms target: a request decoding, a 60,000-token prompt prefilled beside it (the cost
    model learns the machine), then a prefix cache holding the first 60,000 positions of a request named "turn"."""
    memory = FakeMemory()
    scheduler = make_scheduler(memory, prefill_chunk_tokens=8192, policy="mixed", itl_target_ms=100,
                               max_running_requests=8)
    engine = FakeEngine(scheduler, cost=_cost_of_pairs)
    scheduler.add(make_seq("decoding", 8, max_tokens=100000))
    scheduler.add(make_seq("first", 60_000, max_tokens=1))
    while "first" not in engine.finals:
        engine.step()
    scheduler.prefix_cache = OneHit(memory, "turn", 60_000)
    return scheduler, engine


class OneHit(NoPrefixCache):
    """A prefix cache holding one prompt's first `length` positions (restored as FakeMemory pages)."""

    def __init__(self, memory: FakeMemory, request_id: str, length: int):
        self.memory, self.request_id, self.length = memory, request_id, length

    def cached_length(self, seq) -> int:
        return self.length if seq.request_id == self.request_id else 0

    def match(self, seq) -> int:
        n = self.cached_length(seq)
        if n:
            pages = math.ceil(n / self.memory.page_size)
            self.memory.pages[seq.request_id], self.memory.positions[seq.request_id] = pages, n
            self.memory.num_free -= pages
            seq.pages = object()
        return n


@pytest.mark.parametrize("short_prompt_first", [False, True])
def test_the_itl_budget_of_a_prefill_after_a_cached_prefix_counts_that_context(short_prompt_first):
    """A follow-up turn whose first 60,000 positions are cached: its first chunk attends to all of them, and is sized
    so (a step at a fixed cost plus one per token and one per token pair attended), under the 100 ms target. Also
    when a short prompt queued before it takes the step's first chunk: the step's budget was sized for that one at
    context 0, and the turn's chunk gets what is left at its own context (it got the rest: 570 ms)."""
    scheduler, engine = _decoding_beside_a_learned_long_prefill()
    if short_prompt_first:
        scheduler.add(make_seq("short", 40, max_tokens=1))
    scheduler.add(make_seq("turn", 68_000, max_tokens=1))
    start = len(engine.plans)
    while "turn" not in engine.finals:
        engine.step()
    steps = [(p, d) for p, d in zip(engine.plans[start:], engine.durations[start:])
             if any(c.seq.request_id == "turn" for c in p.chunks)]
    assert steps[0][0].chunks[-1].start == 60_000  # (the cached prefix was restored)
    assert max(d for _, d in steps) < 0.11  # (sized at context 0 it took 575 ms)


@pytest.mark.parametrize("cached", [True, False])
def test_a_quiet_stretch_of_decodes_leaves_what_prefill_costs_known(cached):
    """After the long prompt, 3,000 steps of the one request decoding alone (a quiet minute), then a follow-up turn
    whose first 60,000 positions are cached, or a new 30,000-token prompt: the first chunk is still sized under the
    100 ms target. (Decode-only steps discounted the prefill steps before them to nothing: the model took prefill as
    free, and the turn's first chunk of 4,708 tokens took 686 ms, the new prompt's 121 ms.)"""
    scheduler, engine = _decoding_beside_a_learned_long_prefill()
    for _ in range(3000):
        engine.step()
    if not cached:
        scheduler.prefix_cache = NoPrefixCache()
    scheduler.add(make_seq("turn", 68_000 if cached else 30_000, max_tokens=1))
    start = len(engine.plans)
    while "turn" not in engine.finals:
        engine.step()
    assert max(engine.durations[start:]) < 0.11


def test_a_step_that_cannot_admit_its_waiting_request_is_not_counted_over_the_itl_target():
    """max_running_requests decoding, one more waiting: the steps carry no prefill, so no prefill chunk can miss the
    target (each was flagged itl_infeasible, counted and warned about)."""
    scheduler = make_scheduler(FakeMemory(), prefill_chunk_tokens=256, policy="mixed", itl_target_ms=5,
                               max_running_requests=2)
    engine = FakeEngine(scheduler, cost=lambda plan: 0.006 + 1e-5 * plan.num_prefill_tokens)
    scheduler.add(make_seq("a", 4, max_tokens=200))
    scheduler.add(make_seq("b", 4, max_tokens=200))
    for _ in range(30):
        engine.step()
    scheduler.add(make_seq("waiting", 4, max_tokens=2))
    for _ in range(30):
        engine.step()
    tail = list(scheduler.records)[-30:]
    assert sum(r.num_prefill_tokens for r in tail) == 0 and not any(r.itl_infeasible for r in tail)


def test_each_further_chunk_gets_what_the_step_has_left_at_its_own_context():
    """A short prompt, a turn with 50 positions to compute after 60,000 cached, and a 6,000-token prompt, admitted in
    one step under a 100 ms target: each chunk after the first is sized at its own context from what the step has
    left, so the long prompt fills the step up to the target (it got what remained of the turn's allowance: 618
    tokens, a step predicted at 26 ms)."""
    from backend.scheduler.cost_model import StepFeatures

    scheduler, engine = _decoding_beside_a_learned_long_prefill()
    for name, length in (("short", 40), ("turn", 60_050), ("long", 6000)):
        scheduler.add(make_seq(name, length, max_tokens=1))
    plan = engine.step()
    assert [c.seq.request_id for c in plan.chunks] == ["decoding", "short", "turn", "long"]
    predicted = scheduler.cost_model.predict_upper(StepFeatures.of(plan.chunks))
    assert 0.09 <= predicted <= 0.1001 and plan.chunks[-1].num_tokens > 3000
