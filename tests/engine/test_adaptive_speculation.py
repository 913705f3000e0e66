"""adaptive_speculation: at each batch size the engine drafts while its verify steps emit more tokens per second than
plain decode steps (`SpeculationGate`). The gate's choices are the policy's alone (fake rates stand for the measured
ones); the engine's outputs are those without speculation whichever mode runs, plain steps overlap as without
speculation, steps that prefill keep the draft layer's window, and no page is left held."""

from __future__ import annotations

import pytest

from backend.engine_core import SpeculationGate, VerifyOverlap
from backend.request import SamplingParams
from backend.scheduler.scheduler import Scheduler

from .test_speculative import OracleDrafter, _engine, _ids, _prompts

MIN, PROBE = SpeculationGate.MIN_STEPS, SpeculationGate.PROBE_INTERVAL


def _drive(gate: SpeculationGate, rates: dict[bool, float], rows: int, steps: int) -> list[bool]:
    """`steps` decisions at `rows` rows, each step observed at `rates[mode]` tokens/s (its rows carry drafts where the
    step before proposed them)."""
    modes, proposed_before = [], False
    for _ in range(steps):
        mode = gate.drafts(rows)
        gate.observe(rows, proposed_before, mode, rows, rows / rates[mode])
        modes.append(mode)
        proposed_before = mode
    return modes


@pytest.mark.parametrize("verify_faster", [True, False])
def test_the_gate_measures_both_modes_then_follows_the_faster_and_probes_the_other(verify_faster):
    gate = SpeculationGate()
    rates = {True: 300.0 if verify_faster else 100.0, False: 200.0}
    modes = _drive(gate, rates, rows=8, steps=3 * MIN + 6 + PROBE + 100)  # (one probe)
    # each mode measured first (a mode's first two steps are not counted), then the faster
    assert modes[:MIN + 2] == [True] * (MIN + 2) and modes[MIN + 2:2 * MIN + 4] == [False] * (MIN + 2)
    rest = modes[2 * MIN + 4:]
    assert rest[:PROBE] == [verify_faster] * PROBE
    # every PROBE_INTERVAL steps the other mode runs MIN_STEPS counted steps again, then the faster again
    assert rest[PROBE:PROBE + MIN + 2] == [not verify_faster] * (MIN + 2)
    assert rest[PROBE + MIN + 2:] == [verify_faster] * (len(rest) - PROBE - MIN - 2)


def test_the_gate_decides_per_batch_size_and_sees_a_change():
    """Buckets apart (drafts pay at 1 row, not at 32); drafts accepted less at 1 row: it stops drafting there; verify
    steps cheaper at 32 rows: only a probe can see it, and the gate drafts there after it."""
    gate = SpeculationGate()
    assert _drive(gate, {True: 300.0, False: 200.0}, rows=1, steps=40)[-10:] == [True] * 10
    assert _drive(gate, {True: 1000.0, False: 3000.0}, rows=32, steps=40)[-10:] == [False] * 10
    assert _drive(gate, {True: 300.0, False: 200.0}, rows=1, steps=10) == [True] * 10  # (1 row's own state)
    assert _drive(gate, {True: 100.0, False: 200.0}, rows=1, steps=30)[-10:] == [False] * 10
    modes = _drive(gate, {True: 3000.0, False: 2000.0}, rows=32, steps=PROBE + 30)
    assert modes[:100] == [False] * 100 and modes[-10:] == [True] * 10


def test_near_a_tie_the_gate_keeps_its_mode():
    gate = SpeculationGate()
    assert _drive(gate, {True: 200.0, False: 205.0}, rows=4, steps=40)[-10:] == [False] * 10
    assert _drive(gate, {True: 200.0, False: 195.0}, rows=4, steps=40)[-10:] == [False] * 10  # (within 5 %)
    assert _drive(gate, {True: 200.0, False: 180.0}, rows=4, steps=40)[-10:] == [True] * 10


def test_steps_changing_mode_are_not_counted():
    gate = SpeculationGate()
    for _ in range(3 * MIN):  # verifies that stop drafting, plain steps that start: neither mode's price
        gate.observe(4, True, False, 4, 1.0)
        gate.observe(4, False, True, 4, 10.0)  # (counted, drafting would look 10x slower)
    assert [gate.drafts(4) for _ in range(MIN)] == [True] * MIN  # still measuring verify steps first


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    prompts = _prompts([3, 9, 40, 17, 70, 5], seed=11)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (150, 120, 150, 150, 150, 150)]
    return prompts, params, _ids(_engine(tiny_checkpoint, max_running_requests=8).generate(prompts, params))


class Steps:
    """The engine's gate made to see `rates` (tokens/s, drafting and plain); counts the steps scheduled while another
    was in flight, by whether that one was plain."""

    def __init__(self, monkeypatch, rates: dict[bool, float]):
        self.ahead_of_plain = 0
        observe, schedule = SpeculationGate.observe, Scheduler.schedule

        def fake_rates(gate, num_rows, verified, proposed, tokens, seconds):
            return observe(gate, num_rows, verified, proposed, tokens, tokens / rates[proposed])

        def counting_schedule(scheduler, *args, **kwargs):
            self.ahead_of_plain += bool(scheduler._inflight) and scheduler._inflight[-1].plan.plain_decoding
            return schedule(scheduler, *args, **kwargs)

        monkeypatch.setattr(SpeculationGate, "observe", fake_rates)
        monkeypatch.setattr(Scheduler, "schedule", counting_schedule)


@pytest.mark.parametrize("k, verify_faster, cuda_graphs", [(1, False, True), (1, True, True), (2, False, False),
                                                           (2, True, False)])
def test_the_engine_drafts_where_the_gate_says_and_emits_the_tokens_without_speculation(
        tiny_checkpoint, reference, monkeypatch, k, verify_faster, cuda_graphs):
    prompts, params, expected = reference
    steps = Steps(monkeypatch, {True: 300.0 if verify_faster else 100.0, False: 200.0})
    engine = _engine(tiny_checkpoint, num_speculative_tokens=k, adaptive_speculation=True, cuda_graphs=cuda_graphs,
                     max_running_requests=8)
    engine.executor.drafter = OracleDrafter(engine.executor.drafter, dict(enumerate(expected)), 0.3,
                                            engine.vocab_size, dict(enumerate(map(len, prompts))))
    results = engine.generate(prompts, params)
    assert _ids(results) == expected
    engine.kv.check()
    assert all(held == 0 for held in engine.kv.pages_held_by_requests().values())  # nothing leaked
    decodes = [r for r in engine.scheduler.records if not r.num_prefill_tokens]
    verifies = sum(r.num_verifies > 0 for r in decodes)
    if verify_faster:  # (plain only while the gate measures them, and in a step after each row's prefill)
        assert verifies > 0.6 * len(decodes) and engine.stats()["num_accepted_tokens"] > 0
    else:  # (verifies while the gate measures them)
        assert verifies < 0.4 * len(decodes) and steps.ahead_of_plain > 0.5 * (len(decodes) - verifies)


def test_steps_that_prefill_keep_the_draft_windows_while_the_gate_keeps_decodes_plain(tiny_checkpoint, reference,
                                                                                     monkeypatch):
    """A gate that never drafts: no draft pass in a step of decodes, one over every step that prefills (its positions
    into the draft layer's window, which the requests' later drafts read), and the tokens those without speculation."""
    from backend.runner import ModelRunner

    prompts, params, expected = reference
    passes = []
    draft = ModelRunner.draft
    monkeypatch.setattr(SpeculationGate, "drafts", lambda gate, num_rows: False)
    monkeypatch.setattr(ModelRunner, "draft", lambda runner, step: passes.append(step.batch.num_tokens)
                        or draft(runner, step))
    engine = _engine(tiny_checkpoint, num_speculative_tokens=1, adaptive_speculation=True, max_running_requests=8)
    assert _ids(engine.generate(prompts, params)) == expected
    prefills = [r for r in engine.scheduler.records if r.num_prefill_tokens]
    assert len(passes) == len(prefills) and not any(r.num_verifies for r in engine.scheduler.records)
    assert passes == [r.num_prefill_tokens + r.num_decode_tokens for r in prefills]


class PatternGate(SpeculationGate):
    """Decides by a repeating pattern of modes, whatever the rates; `will_draft` says what its next decision is."""

    def __init__(self, pattern: list[bool]):
        super().__init__()
        self.pattern, self.decided = pattern, 0

    def will_draft(self, num_rows: int) -> bool:
        return self.pattern[self.decided % len(self.pattern)]

    def drafts(self, num_rows: int) -> bool:
        mode = self.will_draft(num_rows)
        self.decided += 1
        return mode


def _optimistic_steps(monkeypatch) -> list[int]:
    """Counts (one entry a step) the steps scheduled ahead as verifies of the step in flight."""
    ahead, schedule = [], Scheduler.schedule

    def counting(scheduler, *args, **kwargs):
        plan = schedule(scheduler, *args, **kwargs)
        if plan is not None and any(chunk.optimistic for chunk in plan.chunks):
            ahead.append(plan.step_index)
        return plan

    monkeypatch.setattr(Scheduler, "schedule", counting)
    return ahead


def test_the_gate_stopping_drafts_while_verify_steps_overlap(tiny_checkpoint, reference, monkeypatch):
    """k = 1 with overlapped verify steps (made to pay): where the gate turns drafting off, the verify in flight is
    taken in first and the next step decodes plainly (a verify scheduled ahead must chain its drafts on the device);
    the tokens are those without speculation, every request ends as they do, no page is held."""
    prompts, params, expected = reference
    monkeypatch.setattr(VerifyOverlap, "pays", lambda overlap: True)
    ahead = _optimistic_steps(monkeypatch)
    engine = _engine(tiny_checkpoint, num_speculative_tokens=1, adaptive_speculation=True, cuda_graphs=True,
                     max_running_requests=8)
    engine.core.gate = PatternGate([True] * 5 + [False])
    engine.executor.drafter = OracleDrafter(engine.executor.drafter, dict(enumerate(expected)), 0.1,
                                            engine.vocab_size, dict(enumerate(map(len, prompts))))
    results = engine.generate(prompts, params)
    assert [r.get("error") for r in results] == [None] * len(prompts)
    assert _ids(results) == expected
    assert len(ahead) > 20 and any(r.num_verifies == 0 and not r.num_prefill_tokens for r in engine.scheduler.records)
    engine.kv.check()
    assert all(held == 0 for held in engine.kv.pages_held_by_requests().values())


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_drafting_again_after_plain_steps_while_requests_stop(tiny_checkpoint, reference, monkeypatch, cuda_graphs):
    """k = 2: a step after a plain one in flight is scheduled before that one is taken in only as a plain step, so the
    draft passes of a step that drafts never read the pages of a request the plain step ended (its stop token)."""
    prompts, params, expected = reference
    stops = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, stop_token_ids=[out[8 + 4 * i]])
             for i, (p, out) in enumerate(zip(params, expected))]
    stopped = _ids(_engine(tiny_checkpoint, max_running_requests=8).generate(prompts, stops))
    steps = Steps(monkeypatch, {True: 100.0, False: 200.0})
    engine = _engine(tiny_checkpoint, num_speculative_tokens=2, adaptive_speculation=True, cuda_graphs=cuda_graphs,
                     max_running_requests=8)
    engine.core.gate = PatternGate([False, False, False, True])
    engine.executor.drafter = OracleDrafter(engine.executor.drafter, dict(enumerate(stopped)), 0.3,
                                            engine.vocab_size, dict(enumerate(map(len, prompts))))
    results = engine.generate(prompts, stops)
    assert [(r.get("error"), r["finish_reason"]) for r in results] == [(None, "stop")] * len(prompts)
    assert _ids(results) == stopped
    assert steps.ahead_of_plain > 3 and any(r.num_verifies for r in engine.scheduler.records)
    engine.kv.check()
    assert all(held == 0 for held in engine.kv.pages_held_by_requests().values())
