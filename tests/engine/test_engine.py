"""The engine as a whole: preemption under memory pressure, cancellation, bad requests, the step log."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from backend.config import ConfigError, EngineConfig
from backend.engine import LLMEngine, RequestOutput
from backend.request import FinishReason, SamplingParams, Sequence


def _prompts(count: int, length: int) -> list[list[int]]:
    return torch.randint(2, 512, (count, length), generator=torch.Generator().manual_seed(length)).tolist()


def _engine(checkpoint, **overrides) -> LLMEngine:
    settings = dict(checkpoint=str(checkpoint), device="cpu", page_size=16, max_running_requests=4,
                    prefill_chunk_tokens=64)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def _all_pages_free(engine: LLMEngine) -> bool:
    engine.kv.check()
    return all(held == 0 for held in engine.kv.pages_held_by_requests().values())  # the rest is the prefix cache's


def test_preempted_requests_recompute_and_produce_the_same_tokens(tiny_checkpoint):
    prompts = _prompts(4, 100)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    roomy = _engine(tiny_checkpoint, num_tokens=8192)
    expected = roomy.generate(prompts, params)
    assert roomy.stats()["num_preemptions"] == 0
    # 512 positions: the CSA pool holds 8 pages of 16 entries and the HCA pool one page, so four
    # requests of 140 positions cannot all run at once.
    tight = _engine(tiny_checkpoint, num_tokens=512, swa_full_tokens_ratio=1.0)
    got = tight.generate(prompts, params)
    assert tight.stats()["num_preemptions"] > 0
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in expected]
    assert all(r["finish_reason"] == "length" for r in got)
    assert _all_pages_free(tight)


def test_abort_takes_effect_at_the_next_step_and_frees_every_page(tiny_checkpoint):
    engine = _engine(tiny_checkpoint)
    outputs: list[RequestOutput] = []
    done = threading.Event()
    started = threading.Event()

    def on_output(out: RequestOutput):
        outputs.append(out)
        if len(outputs) == 3:
            started.set()
        if out.finished:
            done.set()

    engine.start()
    try:
        engine.submit(Sequence("long", _prompts(1, 200)[0], SamplingParams(max_tokens=5000, ignore_eos=True)),
                      on_output)
        assert started.wait(60)
        assert engine.abort("long")
        assert done.wait(60)
    finally:
        engine.shutdown()
    final = outputs[-1]
    assert final.finished and final.finish_reason is FinishReason.CANCELLED
    assert sum(1 for o in outputs if o.finished) == 1
    assert len(outputs) < 100  # stopped long before max_tokens
    assert _all_pages_free(engine)
    assert not engine.abort("long")  # already gone


def test_an_abort_while_the_request_is_being_queued_ends_it(tiny_checkpoint):
    """Placed but not yet in the scheduler (its grammar parsed, its stop ids resolved: `prepare`, slowed here), a
    request's abort found nothing to abort and returned False, and the request ran to its end."""
    engine = _engine(tiny_checkpoint)
    preparing, prepare = threading.Event(), engine.core.prepare

    def slow_prepare(seq, stop_ids):
        preparing.set()
        time.sleep(0.3)
        return prepare(seq, stop_ids)

    engine.core.prepare = slow_prepare
    aborted = []
    aborter = threading.Thread(target=lambda: preparing.wait(10) and aborted.append(engine.abort("r")))
    outputs: list[RequestOutput] = []
    engine.start()
    try:
        aborter.start()
        engine.submit(Sequence("r", _prompts(1, 20)[0], SamplingParams(max_tokens=200, ignore_eos=True)),
                      outputs.append)
        aborter.join(10)
        deadline = time.monotonic() + 60
        while not (outputs and outputs[-1].finished) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.shutdown()
    assert aborted == [True]
    assert outputs[-1].finish_reason is FinishReason.CANCELLED and sum(o.finished for o in outputs) == 1
    assert _all_pages_free(engine)


def test_a_rank_that_can_step_no_more_ends_its_requests_as_errors_naming_why(tiny_checkpoint):
    """fail_all (a rank of its group gone): the running and the waiting request end with ERROR (not CANCELLED: the
    metrics count them by finish reason, and no client cancelled) and the cause as their error."""
    engine = _engine(tiny_checkpoint, max_running_requests=1)
    outputs: dict[str, list[RequestOutput]] = {"running": [], "waiting": []}
    started, done = threading.Event(), threading.Event()

    def on_output(out: RequestOutput):
        outputs[out.request_id].append(out)
        started.set()
        if all(o and o[-1].finished for o in outputs.values()):
            done.set()

    engine.start()
    try:
        for request_id in outputs:
            engine.submit(Sequence(request_id, _prompts(1, 50)[0], SamplingParams(max_tokens=5000, ignore_eos=True)),
                          on_output)
        assert started.wait(60)
        engine.core.fail_all("rank 1 is gone")
        assert done.wait(60)
    finally:
        engine.shutdown()
    for request_id, got in outputs.items():
        assert got[-1].finish_reason is FinishReason.ERROR and got[-1].error == "rank 1 is gone", (request_id, got[-1])
    assert _all_pages_free(engine)


def test_a_shutdown_ends_every_live_request_once_and_refuses_later_ones(tiny_checkpoint):
    """Requests running or waiting when the engine shuts down each get one final output, an error saying so (a
    consumer other than the Triton adapter, which answers its own, waited for them forever); a submit during or
    after the shutdown is refused, not queued where no loop serves it."""
    from backend.request import EngineUnavailable

    engine = _engine(tiny_checkpoint, max_running_requests=1)
    outputs: dict[str, list[RequestOutput]] = {"running": [], "waiting": []}
    started = threading.Event()

    def on_output(out: RequestOutput):
        outputs[out.request_id].append(out)
        started.set()

    engine.start()
    for request_id in outputs:
        engine.submit(Sequence(request_id, _prompts(1, 50)[0], SamplingParams(max_tokens=5000, ignore_eos=True)),
                      on_output)
    assert started.wait(60)
    engine.shutdown()
    for request_id, got in outputs.items():
        assert [o.finished for o in got].count(True) == 1 and got[-1].finished, request_id
        assert got[-1].finish_reason is FinishReason.ERROR and got[-1].error == "the model is shutting down"
    with pytest.raises(EngineUnavailable, match="shutting down"):
        engine.submit(Sequence("late", [5, 6, 7], SamplingParams(max_tokens=4)), on_output)


@pytest.mark.parametrize("prompt,params,message", [
    ([], {}, "empty"),
    ([5, 600], {}, "out of the vocabulary"),
    ([5, 6], {"max_tokens": 0}, "max_tokens"),
    ([5, 6], {"max_tokens": 40000}, "max_tokens must be at most 32768"),
    ([5, 6], {"temperature": -1.0}, "temperature"),
    ([5, 6], {"stop_token_ids": [512]}, "stop_token_ids outside the vocabulary"),
    ([5] * 70000, {}, "positions"),
])
def test_bad_requests_are_refused_clearly_and_the_engine_keeps_working(tiny_checkpoint, prompt, params, message):
    engine = _shared_engine(tiny_checkpoint)
    with pytest.raises(ValueError, match=message):
        engine.submit(Sequence(f"bad-{message}", prompt, SamplingParams(**params)), lambda out: None)
    result = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(result[0]["output_ids"]) == 3
    assert _all_pages_free(engine)


_SHARED: dict = {}


def _shared_engine(checkpoint) -> LLMEngine:
    if "engine" not in _SHARED:
        _SHARED["engine"] = _engine(checkpoint)
    return _SHARED["engine"]


def test_every_step_is_logged_as_one_json_line(tiny_checkpoint, tmp_path):
    log = tmp_path / "steps.jsonl"
    engine = _engine(tiny_checkpoint, step_log=str(log), policy="prefill_first", decode_interleave_every=2)
    engine.generate(_prompts(2, 150) + _prompts(1, 20), SamplingParams(max_tokens=6, ignore_eos=True))
    engine.scheduler.close()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == engine.scheduler.counters.num_steps == len(engine.scheduler.records)
    assert [line["step_index"] for line in lines] == list(range(len(lines)))
    kinds = {line["kind"] for line in lines}
    assert {"prefill", "decode"} <= kinds
    assert all(line["duration_s"] > 0 for line in lines)


def test_a_failing_forward_fails_only_its_requests_and_frees_their_pages(tiny_checkpoint, monkeypatch):
    engine = _engine(tiny_checkpoint)
    real_forward = engine.model.forward
    failures = iter([RuntimeError("injected fault")])

    def flaky_forward(batch, kv):
        error = next(failures, None)
        if error is not None:
            raise error
        return real_forward(batch, kv)

    monkeypatch.setattr(engine.model, "forward", flaky_forward)
    outputs: list[RequestOutput] = []
    engine.submit(Sequence("victim", [5, 6, 7], SamplingParams(max_tokens=4)), outputs.append)
    while not outputs:  # with overlap the step's output is taken in at the next iteration
        assert engine.step()
    assert [(o.finished, o.finish_reason, o.error) for o in outputs] == [
        (True, FinishReason.ERROR, "internal error: injected fault")]
    assert _all_pages_free(engine)
    result = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(result[0]["output_ids"]) == 4 and result[0]["finish_reason"] == "length"


def test_a_duplicate_request_id_is_refused_and_the_first_request_is_untouched(tiny_checkpoint):
    engine = _shared_engine(tiny_checkpoint)
    outputs: list[RequestOutput] = []
    engine.submit(Sequence("same-id", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)), outputs.append)
    with pytest.raises(ValueError, match="already in use"):
        engine.submit(Sequence("same-id", [8, 9], SamplingParams(max_tokens=3)), lambda out: None)
    while not (outputs and outputs[-1].finished):
        assert engine.step()
    assert sum(len(o.new_token_ids) for o in outputs) == 3 and outputs[-1].finish_reason is FinishReason.LENGTH
    assert _all_pages_free(engine)


@pytest.mark.parametrize("settings, name", [
    (dict(num_tokens=512), "swa_full_tokens_ratio"),  # a window pool smaller than one window
    (dict(policy="mixed", decode_interleave_every=2), "decode_interleave_every"),
])
def test_a_deployment_that_cannot_work_fails_before_any_weight_is_read(tiny_checkpoint, monkeypatch, settings, name):
    import backend.deployment

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the deployment was checked")

    monkeypatch.setattr(backend.deployment, "load_weights", no_weights)
    with pytest.raises(ConfigError, match=f"'{name}'"):
        LLMEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", **settings))


def test_static_decode_steps_generate_the_same_tokens_as_dynamic_ones(tiny_checkpoint):
    """cuda_graphs=true on CPU: every decode step runs padded to its static shape (what a graph replays),
    including under preemption; as requests are preempted and resume, steps run at more than one row bucket.
    The 512-position pools hold the four prompts' compressed entries (2 CSA pages each) but not their growth."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (90, 100, 110, 120)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = _engine(tiny_checkpoint, num_tokens=8192, cuda_graphs=False).generate(prompts, params)
    static = _engine(tiny_checkpoint, num_tokens=512, swa_full_tokens_ratio=1.0, cuda_graphs=True)
    assert static.decode_graphs is not None and static.decode_graphs.capture  # (closures recorded as graphs)
    got = static.generate(prompts, params)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in expected]
    assert static.stats()["num_preemptions"] > 0
    buckets = {key.rows for key in static.decode_graphs.keys}
    assert 4 in buckets and len(buckets) >= 2, buckets
    assert len(static.decode_graphs.recorded) == len(static.decode_graphs.keys)  # every key's first step recorded
    assert _all_pages_free(static)


def test_a_second_engine_in_one_process_prefills_on_the_processs_threads(tiny_checkpoint):
    """Small steps run on one intra-op thread; the next engine must not take that for the process's count
    (a fresh process, so that no earlier engine has touched its threads)."""
    script = f"""
import torch
torch.set_num_threads(2)
from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.request import SamplingParams
# without overlap the steps run on this thread
config = EngineConfig(checkpoint={str(tiny_checkpoint)!r}, device="cpu", overlap_scheduling=False)
first = LLMEngine(config)
first.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
assert torch.get_num_threads() == 1, "small steps run on one thread"
print(first.executor.cpu_threads, LLMEngine(config).executor.cpu_threads)
"""
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.split() == ["2", "2"]
