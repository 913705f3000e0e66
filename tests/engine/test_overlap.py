"""The overlap loop: step N+1 is scheduled and launched while step N runs, and nothing a client sees changes.

With `overlap_scheduling` the engine learns what a step sampled one step late: a request that stopped in
step N may already have a decode in step N+1 (its token is dropped), a cancel or a deadline lands while a
step of the request is in flight. These tests compare the two loops output for output over requests that end
every way a request can (a stop token, a stop string, a cancel, a deadline, max_tokens: tests/engine/endings.py)
beside others that go on (greedy and seeded sampling, log-probabilities, preemption, the prefix cache, static
decode steps, prefill_first), check that nothing is ever reported after a request's final output, that every
page is freed exactly once, and that on CPU the forward really runs on the executor's thread beside the
scheduling one.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.request import FinishReason, RequestOutput, SamplingParams, Sequence
from tests.engine import endings


def _engine(checkpoint, **settings) -> LLMEngine:
    base = dict(checkpoint=str(checkpoint), device="cpu", page_size=16, max_running_requests=4,
                prefill_chunk_tokens=64)
    return LLMEngine(EngineConfig(**{**base, **settings}))


def _prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    return torch.randint(2, 512, (count, length), generator=torch.Generator().manual_seed(seed)).tolist()


def _shared_prefixes() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    history = torch.randint(2, 500, (300,), generator=gen).tolist()
    return [history[:n] + torch.randint(2, 500, (k,), generator=gen).tolist() for n, k in
            ((300, 5), (256, 1), (129, 70), (100, 40), (300, 20), (200, 9))]


def _all_pages_free(engine: LLMEngine) -> bool:
    engine.kv.check()
    return all(held == 0 for held in engine.kv.pages_held_by_requests().values())


GREEDY = SamplingParams(max_tokens=30, ignore_eos=True)
SAMPLED = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, top_k=50, seed=s, logprobs=2,
                          repetition_penalty=1.2, frequency_penalty=0.3) for s in range(6)]

CASES = {
    # (four prompts of 120 fill the pool's 32 pages of 16 positions: the running requests outgrow it at once)
    "preemption": (dict(num_tokens=512, swa_full_tokens_ratio=1.0), lambda: _prompts(6, 120), GREEDY),
    "prefix cache": (dict(prefill_chunk_tokens=48, num_tokens=4096), _shared_prefixes, GREEDY),
    "static decode steps": (dict(cuda_graphs=True, num_tokens=512, swa_full_tokens_ratio=1.0),
                            lambda: _prompts(6, 90, seed=3), GREEDY),
    "prefill_first": (dict(policy="prefill_first", decode_interleave_every=2), lambda: _prompts(6, 150, 1), GREEDY),
    "sampled, penalties, logprobs": (dict(), lambda: _prompts(6, 70, seed=2), SAMPLED),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_are_the_same_with_overlap_on_and_off(tiny_checkpoint, monkeypatch, case):
    """Six requests, ending by a stop token, a stop string, a cancel, a deadline and max_tokens, among others that
    go on: the same outputs (tokens, text, log-probabilities, finish reasons, nothing after a final) with either
    loop, although with overlap each ending is learnt while the request's next step is in flight."""
    settings, prompts, params = CASES[case]
    prompts = prompts()
    params = params if isinstance(params, list) else [params] * len(prompts)
    free_runs = _engine(tiny_checkpoint, **settings).generate(prompts, params)
    requests = endings.with_endings(prompts, params, free_runs)
    off = _engine(tiny_checkpoint, overlap_scheduling=False, **settings)
    on = _engine(tiny_checkpoint, **settings)
    assert on.overlap and not off.overlap
    expected = endings.run(off, requests, endings.FakeClock(monkeypatch))
    got = endings.run(on, requests, endings.FakeClock(monkeypatch))
    assert got == expected and all(stream.ends_once for stream in got)
    endings.assert_same_logprobs(got, expected)
    assert endings.finish_reasons(expected) == {"stop", "cancelled", "timeout", "length"}
    if case == "preemption":
        assert on.stats()["num_preemptions"] > 0
    if case == "prefix cache":  # (how much is restored may differ: with overlap an entry is kept a step later)
        assert on.stats()["prefix_cache"]["hits"] > 0
    for engine in (on, off):
        assert _all_pages_free(engine)
        engine.shutdown()


def _collect(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    """Every output the engine reports for one request, the engine running its own loop thread."""
    outputs: list[RequestOutput] = []
    done = threading.Event()

    def on_output(out: RequestOutput) -> None:
        outputs.append(out)
        if out.finished:
            done.set()

    engine.start()
    try:
        engine.submit(Sequence(f"r-{time.monotonic_ns()}", prompt, params), on_output)
        assert done.wait(60)
        time.sleep(0.2)  # anything reported after the final would arrive now
    finally:
        engine.shutdown()
    return outputs


def test_nothing_is_reported_after_a_stop_token(tiny_checkpoint):
    """The stop token is learnt one step late, when the next decode is already launched: its token is dropped."""
    prompt = _prompts(1, 40)[0]
    free_run = _engine(tiny_checkpoint).generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))
    tokens = free_run[0]["output_ids"]
    stop_at = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    engine = _engine(tiny_checkpoint)
    outputs = _collect(engine, prompt, SamplingParams(max_tokens=20, stop_token_ids=[tokens[stop_at]]))
    assert [t for o in outputs for t in o.new_token_ids] == tokens[:stop_at + 1]
    assert [o.finished for o in outputs] == [False] * stop_at + [True]
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert _all_pages_free(engine)


def test_a_stop_string_ends_the_request_and_nothing_past_it_is_reported(tiny_checkpoint):
    """Stop strings are the output processor's: it cuts the text, ends the request and aborts it in the engine,
    whose later outputs for it are dropped."""
    prompt = _prompts(1, 40, seed=5)[0]
    free = _engine(tiny_checkpoint).generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    text = free["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip() and text.index(stop) > 0
    engine = _engine(tiny_checkpoint)
    (result,) = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))
    assert result["finish_reason"] == "stop" and result["text"] == text[:text.index(stop)]
    assert result["output_ids"] == free["output_ids"][:len(result["output_ids"])]
    assert len(result["output_ids"]) < 24 and not engine.scheduler.has_work()
    assert _all_pages_free(engine)


def test_a_deadline_while_a_step_is_in_flight_ends_the_request_cleanly(tiny_checkpoint):
    prompt = _prompts(1, 50, seed=6)[0]
    expected = _engine(tiny_checkpoint).generate([prompt], SamplingParams(max_tokens=300, ignore_eos=True))[0]
    engine = _engine(tiny_checkpoint)
    outputs = _collect(engine, prompt, SamplingParams(max_tokens=300, ignore_eos=True, timeout_ms=300))
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert outputs[-1].finish_reason is FinishReason.TIMEOUT and sum(o.finished for o in outputs) == 1
    assert 0 < len(tokens) < 300 and tokens == expected["output_ids"][:len(tokens)]
    assert _all_pages_free(engine)


def test_a_deadline_counts_from_the_submission_not_from_the_schedulers_take_in(tiny_checkpoint, monkeypatch):
    """The scheduler takes arrivals in at its next step, which may come a long prefill later: a request whose
    timeout_ms passed meanwhile ends at that step, with no token; one submitted beside it without a deadline runs."""
    clock = endings.FakeClock(monkeypatch)
    engine = _engine(tiny_checkpoint)
    late, other = [], []
    engine.submit(Sequence("late", [5, 6, 7], SamplingParams(max_tokens=8, timeout_ms=1000)), late.append)
    engine.submit(Sequence("other", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True)), other.append)
    clock.advance(1.5)
    for _ in range(100):
        if not engine.step():
            break
    assert [(o.new_token_ids, o.finish_reason) for o in late] == [([], FinishReason.TIMEOUT)]
    assert other[-1].finish_reason is FinishReason.LENGTH and sum(len(o.new_token_ids) for o in other) == 8
    assert _all_pages_free(engine)


def test_a_step_failing_while_the_next_is_in_flight_fails_only_its_requests(tiny_checkpoint, monkeypatch):
    """The fourth forward raises: its requests fail (the step launched after it is dropped for them), a request
    submitted later is served, and no page stays held."""
    engine = _engine(tiny_checkpoint)
    real_forward, calls = engine.model.forward, []

    def flaky_forward(batch, kv):
        calls.append(batch.num_tokens)
        if len(calls) == 4:
            raise RuntimeError("injected fault")
        return real_forward(batch, kv)

    monkeypatch.setattr(engine.model, "forward", flaky_forward)
    _assert_the_fault_ends_only_its_requests(engine, "injected fault")


def _assert_the_fault_ends_only_its_requests(engine: LLMEngine, fault: str) -> None:
    """Two requests of 10 tokens meet the fault: both end with it, after some tokens; no page stays held; a request
    submitted later is served."""
    results = engine.generate(_prompts(2, 30), SamplingParams(max_tokens=10, ignore_eos=True))
    assert [r["finish_reason"] for r in results] == ["error", "error"]
    assert all(fault in r["error"] and 0 < len(r["output_ids"]) < 10 for r in results)
    assert _all_pages_free(engine)
    _assert_a_later_request_is_served(engine)


def _assert_a_later_request_is_served(engine: LLMEngine) -> None:
    (later,) = engine.generate(_prompts(1, 30, seed=9), SamplingParams(max_tokens=5, ignore_eos=True))
    assert later["finish_reason"] == "length" and len(later["output_ids"]) == 5


@pytest.mark.parametrize("overlap", [True, False])
def test_the_next_step_is_launched_while_a_step_runs(tiny_checkpoint, monkeypatch, overlap):
    """A forward slowed by a 20 ms sleep. With overlap the steps run on the executor's thread, and the engine
    thread has scheduled, built and launched step N+1 before step N ends; without overlap each step ends before
    the next is launched."""
    engine = _engine(tiny_checkpoint, overlap_scheduling=overlap)
    launches, steps = [], []
    real_forward, real_step, real_submit = engine.model.forward, engine.executor._step, engine.executor.submit

    def slow_forward(batch, kv):
        time.sleep(0.02)
        return real_forward(batch, kv)

    def timed_step(job):  # the whole device-side step: copies, forward, sampling
        result = real_step(job)
        steps.append((threading.current_thread().name, time.perf_counter()))
        return result

    def timed_submit(job):
        launches.append(time.perf_counter())
        return real_submit(job)

    monkeypatch.setattr(engine.model, "forward", slow_forward)
    monkeypatch.setattr(engine.executor, "_step", timed_step)
    monkeypatch.setattr(engine.executor, "submit", timed_submit)
    engine.generate(_prompts(2, 20), SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(launches) == len(steps) == 12
    ahead = sum(launch < end for launch, (_, end) in zip(launches[1:], steps))  # N+1 launched before N ended
    assert {name for name, _ in steps} == ({"dsv4-device"} if overlap else {threading.current_thread().name})
    assert ahead == (11 if overlap else 0), ahead


def test_a_step_that_cannot_even_be_built_fails_its_requests_and_the_engine_goes_on(tiny_checkpoint, monkeypatch):
    """An exception while building a step's batch (after the scheduler committed it) fails that step's requests
    like a failed forward; the scheduler is not left waiting for an output that never comes."""
    import backend.engine_core

    engine = _engine(tiny_checkpoint)
    real_build, calls = backend.engine_core.build_forward_batch, []

    def flaky_build(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected build fault")
        return real_build(*args, **kwargs)

    monkeypatch.setattr(backend.engine_core, "build_forward_batch", flaky_build)
    (failed,) = engine.generate(_prompts(1, 30), SamplingParams(max_tokens=10, ignore_eos=True))
    assert failed["finish_reason"] == "error" and "injected build fault" in failed["error"]
    assert _all_pages_free(engine)
    _assert_a_later_request_is_served(engine)


def test_a_step_log_that_cannot_be_written_loses_no_output(tiny_checkpoint, monkeypatch, tmp_path, caplog):
    """The step log's third write fails (a full disk): every request still gets all its tokens and its end, the log
    ends there with an error logged, and the engine serves on. (Before, the fault escaped the take-in of a step
    while the next was in flight, and every later step was refused: no request ever ended again.)"""
    from backend.scheduler.step_record import StepLog

    log, writes = tmp_path / "steps.jsonl", []
    real_write = StepLog.write

    def full_disk(self, record):
        writes.append(record.step_index)
        if len(writes) == 3:
            raise OSError(28, "No space left on device")
        real_write(self, record)

    monkeypatch.setattr(StepLog, "write", full_disk)
    engine = _engine(tiny_checkpoint, step_log=str(log))
    prompts, params = _prompts(2, 30), SamplingParams(max_tokens=10, ignore_eos=True)
    results = engine.generate(prompts, params)
    assert [(r["finish_reason"], len(r["output_ids"])) for r in results] == [("length", 10)] * 2
    assert len(writes) == 3 and len(log.read_text().splitlines()) == 2
    assert "writing the step log" in caplog.text and "No space left on device" in caplog.text
    assert _all_pages_free(engine)
    _assert_a_later_request_is_served(engine)


def test_a_step_whose_output_cannot_be_read_fails_only_its_requests(tiny_checkpoint, monkeypatch):
    """Reading the fourth step's output raises (on CUDA: the wait for its token copy, where an asynchronous device
    fault surfaces), with the fifth step in flight: the step's requests end with the error, their pages come back,
    and a later request is served."""
    from backend.executor import StepHandle

    engine = _engine(tiny_checkpoint)
    assert engine.core.overlap
    real_result, reads = StepHandle.result, []

    def faulty_result(self):
        reads.append(1)
        if len(reads) == 4:
            raise RuntimeError("injected device fault")
        return real_result(self)

    monkeypatch.setattr(StepHandle, "result", faulty_result)
    _assert_the_fault_ends_only_its_requests(engine, "injected device fault")
