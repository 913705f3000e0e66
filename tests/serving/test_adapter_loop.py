"""backend/serving/adapter.py in-process: a fake pb_utils, the deterministic fake engine, real threads.

The contract checked here is the one tritonserver's clients rely on: every request ends with
exactly one FINAL response, whatever happens — a bad request, an engine refusal, cancellation, a
failing send, shutdown — and nothing is left in the adapter's table. The same adapter runs in a
real tritonserver in tests/e2e/test_adapter.py.
"""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
from fake_pb_utils import FakePbUtils, Request, Sender

from backend.config import EngineConfig
from backend.serving.adapter import TritonAdapter
from tests.e2e.fake_engine import LLMEngine as FakeEngine
from tests.e2e.fake_engine import expected_ids


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def request(prompt: str = "hello", max_tokens: int = 5, stream: bool = True, **extra) -> Request:
    inputs = {"text_input": text(prompt), "max_tokens": np.array([max_tokens], np.int32),
              "stream": np.array([stream])}
    inputs.update(extra)
    return Request(inputs)


@pytest.fixture
def adapter():
    engine = FakeEngine(EngineConfig(max_tokens_limit=1000))
    adapter = TritonAdapter(engine, FakePbUtils, "dsv4", poll_s=0.005, stats_s=0.01)
    adapter.start()
    Sender.made.clear()
    yield adapter
    adapter.shutdown()
    assert not any(sender.asked_after_final for sender in Sender.made), "is_cancelled() after a FINAL"


def finished(adapter, reason: str) -> float:
    """dsv4_requests_finished_total{finish_reason=reason} as the adapter counted it."""
    metric = adapter.metrics._metrics.get(("dsv4_requests_finished_total", (("finish_reason", reason),)))
    return metric.value if metric is not None else 0


def wait_final(*requests: Request, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(r.sender.num_finals for r in requests):
            time.sleep(0.05)  # a second FINAL, if the adapter were to send one, would show up by now
            return
        time.sleep(0.005)
    raise AssertionError("no FINAL response in time")


def tokens_of(req: Request) -> list[int]:
    return [int(t) for response, _ in req.sender.sent if response is not None and response.error is None
            for t in response.outputs["output_ids"]]


def errors_of(req: Request) -> list[str]:
    return [response.error.message for response, _ in req.sender.sent if response is not None and response.error]


def test_a_stream_sends_its_tokens_then_exactly_one_final(adapter):
    req = request("hello", max_tokens=6)
    adapter.submit(req)
    wait_final(req)
    assert tokens_of(req) == expected_ids(list(b"hello"), 6)
    # The FINAL alone, after the last response with tokens (adapter._send_output says why).
    final = FakePbUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert req.sender.num_finals == 1 and req.sender.sent[-1] == (None, final)
    assert req.sender.sent[-2][0].outputs["finish_reason"].tolist() == [b"length"]
    assert adapter._live == {}


@pytest.mark.parametrize("inputs, message", [
    ({"sampling_parameters": text("{oops")}, "not valid JSON"),
    ({"sampling_parameters": text(json.dumps({"top_p": 0}))}, "top_p"),
    ({"max_tokens": np.array([0], np.int32)}, "max_tokens"),
    ({"max_tokens": np.array([5000], np.int32)}, "at most 1000"),
    ({"text_input": text("NOFIT")}, "never fit"),
    ({"text_input": text("x" * 1000)}, "positions"),
])
def test_bad_requests_get_one_error_final_and_never_reach_the_engine(adapter, inputs, message):
    req = request(**inputs)
    adapter.submit(req)
    assert req.sender.num_finals == 1 and len(req.sender.sent) == 1  # answered at once, in submit()
    assert message in errors_of(req)[0]
    assert adapter.engine._running == {} and adapter._live == {}


def test_cancellation_reaches_the_engine_and_ends_with_one_cancelled_final(adapter):
    req = request("a long one", max_tokens=900)
    adapter.submit(req)
    deadline = time.monotonic() + 10
    while len(req.sender.sent) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    req.sender.cancelled = True
    wait_final(req)
    assert req.sender.num_finals == 1
    assert errors_of(req) == ["request cancelled"] and errors_of(req) == [req.sender.sent[-1][0].error.message]
    assert len(tokens_of(req)) < 900
    assert adapter.engine._running == {} and adapter._live == {}


def test_a_cancellation_while_the_request_is_being_submitted_is_not_lost(adapter, monkeypatch):
    """The client cancels while submit() is still placing the request (the engine has not got it: its abort finds
    nothing): the next poll asks again, and the request ends cancelled, not after all its tokens."""
    submit = adapter.engine.submit

    def slow_submit(seq, on_output):
        time.sleep(0.05)  # (several of the response loop's polls)
        return submit(seq, on_output)

    monkeypatch.setattr(adapter.engine, "submit", slow_submit)
    req = request("a long one", max_tokens=900)
    req.sender.cancelled = True
    adapter.submit(req)
    wait_final(req)
    assert req.sender.num_finals == 1 and errors_of(req) == ["request cancelled"]
    assert len(tokens_of(req)) < 900 and adapter.engine._running == {} and adapter._live == {}


def test_an_output_whose_text_fails_ends_that_request_and_the_others_go_on(adapter, monkeypatch):
    """The thread that answers every request survives an output it cannot make text of: that request ends with one
    error FINAL, the one beside it gets all its tokens."""
    process = adapter.processor.process
    bad, good = request("bad one", max_tokens=50), request("good one", max_tokens=50)
    bad._id, good._id = "bad", "good"

    def failing(output):
        if output.request_id.startswith(bad.request_id()) and output.num_output_tokens > 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken tokenizer")
        return process(output)

    monkeypatch.setattr(adapter.processor, "process", failing)
    adapter.submit(bad)
    adapter.submit(good)
    wait_final(bad, good)
    assert bad.sender.num_finals == 1 and "internal error" in errors_of(bad)[0]
    assert tokens_of(good) == expected_ids(list(b"good one"), 50) and good.sender.num_finals == 1
    assert adapter.engine._running == {} and adapter._live == {}


def test_an_abort_that_raises_leaves_the_thread_answering_every_request(adapter, monkeypatch):
    """engine.abort failing (a data-parallel rank gone while a Cancel is sent) on the paths the response thread calls
    it from, a failed send and a client's cancellation: those requests still end with one FINAL, and a request
    beside them gets all its tokens."""
    abort = adapter.engine.abort

    def failing_abort(request_id):
        abort(request_id)
        raise RuntimeError("rank 1 takes no requests")

    monkeypatch.setattr(adapter.engine, "abort", failing_abort)
    failing, cancelled, good = (request(p, max_tokens=50) for p in ("failing send", "cancelled one", "good one"))
    failing.sender.fail_sends = 1
    for req in (failing, cancelled, good):
        adapter.submit(req)
    cancelled.sender.cancelled = True
    wait_final(failing, cancelled, good)
    assert adapter._thread.is_alive()
    assert [r.sender.num_finals for r in (failing, cancelled, good)] == [1, 1, 1]
    assert tokens_of(good) == expected_ids(list(b"good one"), 50)


def test_time_to_first_token_counts_from_arrival_parsing_included(adapter, monkeypatch):
    """The request's clock starts when it arrives, before its prompt is tokenized and its chat template rendered (as
    vLLM's arrival time): a parse of 0.2 s is in its time to first token."""
    from backend.serving import triton_io

    parse = triton_io.parse_request
    monkeypatch.setattr(triton_io, "parse_request", lambda *args: time.sleep(0.2) or parse(*args))
    req = request("hello", max_tokens=3)
    adapter.submit(req)
    wait_final(req)
    assert adapter.metrics.ttft.observed[-1] >= 0.2


def test_a_failing_send_aborts_the_request_and_still_sends_one_final(adapter):
    req = request("hello", max_tokens=50)
    req.sender.fail_sends = 1  # the first token response raises
    adapter.submit(req)
    wait_final(req)
    assert req.sender.num_finals == 1
    assert errors_of(req)[0].startswith("internal error: the client went away")
    deadline = time.monotonic() + 5
    while adapter.engine._running and time.monotonic() < deadline:
        time.sleep(0.005)
    assert adapter.engine._running == {} and adapter._live == {}


def test_a_request_whose_error_response_fails_too_still_ends_with_that_error_counted_as_one(adapter):
    """The first token response raises, and so does the error response after it: the request is aborted, and at the
    abort's end the client gets the internal error (not "request cancelled": it never cancelled), counted `error`."""
    req = request("hello", max_tokens=50)
    req.sender.fail_sends = 2
    adapter.submit(req)
    wait_final(req)
    assert req.sender.num_finals == 1 and errors_of(req) == ["internal error: the client went away"]
    deadline = time.monotonic() + 2
    while finished(adapter, "error") == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert (finished(adapter, "error"), finished(adapter, "cancelled")) == (1, 0)


def test_a_refused_request_whose_error_response_fails_still_gets_a_final(adapter):
    """A bad request's one response is its error: when that send fails, a bare FINAL still ends the request (else it
    stays open in tritonserver, holding up an unload or a stop)."""
    req = request("hello", max_tokens=0)
    req.sender.fail_sends = 1
    adapter.submit(req)
    wait_final(req)
    assert req.sender.sent == [(None, FakePbUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)]


def test_a_sender_that_always_fails_leaves_nothing_behind(adapter):
    req = request("hello", max_tokens=50)
    req.sender.fail_sends = 10**6
    adapter.submit(req)
    deadline = time.monotonic() + 5
    while (adapter._live or adapter.engine._running) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert adapter._live == {} and adapter.engine._running == {}
    assert req.sender.sent == []


def test_shutdown_answers_every_live_request_with_one_final():
    engine = FakeEngine(EngineConfig(max_tokens_limit=1000))
    adapter = TritonAdapter(engine, FakePbUtils, "dsv4", poll_s=0.005)
    adapter.start()
    reqs = [request(f"p{i}", max_tokens=900) for i in range(3)]
    for req in reqs:
        adapter.submit(req)
    time.sleep(0.05)
    adapter.shutdown()
    for req in reqs:
        assert req.sender.num_finals == 1 and errors_of(req)[-1] == "the model is shutting down"


def test_shutdown_releases_the_metrics_and_later_updates_do_nothing():
    engine = FakeEngine(EngineConfig(max_tokens_limit=1000))
    adapter = TritonAdapter(engine, FakePbUtils, "dsv4", poll_s=0.005)
    adapter.start()
    req = request("hello", max_tokens=3)
    adapter.submit(req)
    wait_final(req)
    assert adapter.metrics._families
    adapter.shutdown()
    # Each metric object deletes itself in tritonserver when destroyed: finalize() must be where that happens.
    assert not adapter.metrics._families and not adapter.metrics._metrics and adapter.metrics.ttft is None
    adapter.metrics.update(engine.stats())
    adapter.metrics.on_finished("stop")
    assert not adapter.metrics._metrics


def test_many_requests_with_random_cancels_and_send_failures_each_end_exactly_once(adapter):
    rng = random.Random(0)
    reqs = []
    for i in range(40):
        req = request(f"prompt {i}", max_tokens=rng.randint(1, 30), stream=rng.random() < 0.7)
        req.sender.fail_sends = 1 if rng.random() < 0.2 else 0
        reqs.append(req)
        adapter.submit(req)
        if rng.random() < 0.3:
            req.sender.cancelled = True
    wait_final(*reqs, timeout=30)
    assert all(req.sender.num_finals == 1 for req in reqs)
    assert all(req.sender.sent[-1][1] == 1 for req in reqs)  # nothing after the FINAL
    deadline = time.monotonic() + 5
    while adapter.engine._running and time.monotonic() < deadline:
        time.sleep(0.005)
    assert adapter._live == {} and adapter.engine._running == {}


def test_a_stop_string_ends_the_stream_on_the_response_thread_and_aborts_the_engine(adapter):
    """The fake engine reports token ids only; the adapter's output processor finds the stop string, sends the
    text before it with finish_reason stop as the one FINAL, and asks the engine to abort the request."""
    prompt = "hello"
    full = bytes(expected_ids(list(prompt.encode()), 40)).decode()
    stop = full[10:12]
    req = request(prompt, max_tokens=40, sampling_parameters=text(json.dumps({"stop": [stop]})))
    adapter.submit(req)
    wait_final(req)
    sent = [response for response, _ in req.sender.sent if response is not None]
    assert "".join(r.outputs["text_output"][0].decode() for r in sent) == full[:full.index(stop)]
    assert req.sender.num_finals == 1 and sent[-1].outputs["finish_reason"].tolist() == [b"stop"]
    deadline = time.monotonic() + 5
    while adapter.engine._running and time.monotonic() < deadline:  # the abort lands at the engine's next step
        time.sleep(0.01)
    assert adapter.engine._running == {} and adapter._live == {}
    assert len(tokens_of(req)) < 40


def test_refused_requests_are_never_asked_about_cancellation_after_their_final(adapter):
    """A request the engine refuses is in the adapter's table while the engine checks it (a 200,000-token prompt:
    milliseconds) and its error FINAL goes out from the submitting thread; the response thread, polling
    cancellation meanwhile, must not ask a sender whose FINAL is out (the real server frees it and crashes).
    Refusals from several threads while polling every 0.1 ms."""
    import threading

    adapter.poll_s = 0.0001
    refused = [[request("x" * 200_000) for _ in range(10)] for _ in range(3)]

    def submit_all(reqs):
        for req in reqs:
            adapter.submit(req)

    threads = [threading.Thread(target=submit_all, args=(reqs,)) for reqs in refused]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(req.sender.num_finals == 1 for reqs in refused for req in reqs)
    assert not any(req.sender.asked_after_final for reqs in refused for req in reqs)


def test_shutdown_while_a_response_is_going_out_sends_the_final_after_it_and_only_one():
    """The response thread is still sending a token response when shutdown() has waited for it as long as it
    may: shutdown's error FINAL goes out after that send, never beside it, and nothing follows it."""
    engine = FakeEngine(EngineConfig(max_tokens_limit=1000))
    adapter = TritonAdapter(engine, FakePbUtils, "dsv4", poll_s=0.005)
    adapter.start()
    req = request("slow", max_tokens=900)
    send, sending = req.sender.send, []

    def slow_send(response=None, flags=0):
        if not sending:  # (the first response: the thread holds it 0.6 s)
            sending.append(True)
            time.sleep(0.6)
        send(response, flags)

    req.sender.send = slow_send
    adapter.submit(req)
    while not sending:
        time.sleep(0.005)
    adapter.shutdown(timeout_s=0.5)
    time.sleep(0.2)  # (a response the thread would send after the FINAL shows up by now)
    assert req.sender.num_finals == 1 and req.sender.sent[-1][1] == 1
    assert errors_of(req) == ["the model is shutting down"] and len(req.sender.sent) == 2


def test_a_request_the_engine_answers_and_then_refuses_gets_one_final(adapter, monkeypatch):
    """An engine that fails a request (an ERROR output: a rank lost while placing it) and then raises from submit:
    the one FINAL is the output's; submit() sends no second one, nor counts it twice."""
    from backend.request import EngineUnavailable, FinishReason, RequestOutput

    def answering_then_refusing(seq, on_output):
        on_output(RequestOutput(seq.request_id, [], "", True, FinishReason.ERROR, len(seq.prompt_ids), 0,
                                error="the rank serving it is gone"))
        time.sleep(0.1)  # (the response thread sends that FINAL first)
        raise EngineUnavailable("the model cannot serve")

    monkeypatch.setattr(adapter.engine, "submit", answering_then_refusing)
    req = request("hello")
    adapter.submit(req)
    wait_final(req)
    assert req.sender.num_finals == 1 and errors_of(req) == ["the rank serving it is gone"]
    assert finished(adapter, "error") == 1


def test_one_sender_failing_to_say_whether_it_was_cancelled_holds_up_no_other_cancellation(adapter, monkeypatch):
    """Requests that have no output yet (nothing else asks their senders): the poll asks each one apart."""
    aborted = []
    monkeypatch.setattr(adapter.engine, "submit", lambda seq, on_output: None)  # (queued, no output yet)
    monkeypatch.setattr(adapter.engine, "abort", lambda request_id: aborted.append(request_id) or True)
    first, second = request("first", max_tokens=900), request("second", max_tokens=900)

    def failing():
        raise RuntimeError("no answer")

    first.sender.is_cancelled = failing
    adapter.submit(first)
    adapter.submit(second)
    second.sender.cancelled = True
    deadline = time.monotonic() + 5
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [request_id.split("-")[0] for request_id in aborted] == ["r"] and len(adapter._live) == 2
    with adapter._lock:
        assert [live.cancelling for live in adapter._live.values()] == [False, True]


def test_cancellation_asks_stay_within_their_rate_however_many_requests_and_responses():
    """Each is_cancelled() is a round trip to tritonserver holding the GIL: asking every live request at every poll
    and before every response grew with streams x tokens/s. The asks stay within `max_cancel_asks_per_s` (plus the
    one a request's last output makes), and a cancellation is still seen."""
    engine = FakeEngine(EngineConfig(max_tokens_limit=1000))
    adapter = TritonAdapter(engine, FakePbUtils, "dsv4", poll_s=0.001, max_cancel_asks_per_s=200)
    adapter.start()
    try:
        reqs = [request(f"prompt {i}", max_tokens=60) for i in range(20)]
        start = time.monotonic()
        for req in reqs:
            adapter.submit(req)
        time.sleep(0.2)
        reqs[0].sender.cancelled = True
        wait_final(*reqs)
        elapsed = time.monotonic() - start
    finally:
        adapter.shutdown()
    asks = sum(req.sender.asks for req in reqs)
    assert sum(len(req.sender.sent) for req in reqs) > 20 * 30  # (the old asks were at least a response each)
    assert asks <= 200 * elapsed * 1.25 + len(reqs), (asks, elapsed)
    assert errors_of(reqs[0]) == ["request cancelled"] and len(tokens_of(reqs[0])) < 60
    assert all(len(tokens_of(req)) == 60 for req in reqs[1:])


def test_a_response_thread_behind_the_engine_sends_several_steps_tokens_in_one_response(adapter, monkeypatch):
    """Each send is a round trip to tritonserver; a thread that sends slower than the engine steps takes what queued
    meanwhile as one response, so it catches up: fewer responses than tokens, the same tokens and text, one FINAL."""
    req = request("slow client", max_tokens=30)
    send = req.sender.send

    def slow_send(response=None, flags=0):
        time.sleep(0.03)  # (three of the fake engine's steps)
        send(response, flags)

    monkeypatch.setattr(req.sender, "send", slow_send)
    adapter.submit(req)
    wait_final(req)
    assert tokens_of(req) == expected_ids(list(b"slow client"), 30)
    texts = "".join(r.outputs["text_output"][0].decode() for r, _ in req.sender.sent if r is not None)
    assert texts == bytes(expected_ids(list(b"slow client"), 30)).decode()
    assert req.sender.num_finals == 1 and len(req.sender.sent) < 20


def test_a_cancellation_that_meets_the_last_output_ends_cancelled(adapter, monkeypatch):
    """The client cancelled as the request finished: it hears CANCELLED, and is counted cancelled, as any
    cancelled request (not a bare FINAL counted by the output's reason)."""
    req = request("hello", max_tokens=3, stream=False)  # (one response: the last)
    req.sender.cancelled = True
    monkeypatch.setattr(adapter, "_poll_cancelled", lambda: None)  # (the cancellation is seen with the output)
    adapter.submit(req)
    wait_final(req)
    assert req.sender.num_finals == 1 and errors_of(req) == ["request cancelled"]
    assert finished(adapter, "cancelled") == 1 and finished(adapter, "length") == 0


def _idle_adapter_with(sender, max_tokens: int = 9):
    """An adapter whose response thread is not started, and one live request of `sender`: what `_handle` does with
    each output, step by step."""
    from backend.request import SamplingParams
    from backend.serving import triton_io
    from backend.serving.adapter import _Live

    engine = FakeEngine(EngineConfig(max_tokens_limit=1000))
    adapter = TritonAdapter(engine, FakePbUtils, "dsv4", poll_s=0.005, stats_s=0.01)
    parsed = triton_io.ParsedRequest([104, 105], SamplingParams(max_tokens=max_tokens), True, True, 0, "hi")
    adapter._live["r"] = _Live(sender, triton_io.ResponseBuilder(parsed, engine.tokenizer))
    adapter.processor.add("r", parsed.sampling)
    return adapter, engine


def test_after_a_cancellation_is_seen_no_more_tokens_go_out_before_the_cancelled_end():
    """The engine had made three outputs when the client cancelled: the first one's send sees the cancellation, and
    the two after it are not sent either (the client would get text with a hole in it); then CANCELLED."""
    from backend.request import FinishReason, RequestOutput

    sender = Sender()
    sender.cancelled = True
    adapter, engine = _idle_adapter_with(sender)
    engine.abort = lambda request_id: True
    for token in (97, 98, 99):
        adapter._handle(RequestOutput("r", [token], "", False, None, 2, 1))
    adapter._handle(RequestOutput("r", [], "", True, FinishReason.CANCELLED, 2, 3))
    assert [(None if response is None else response.error.message, flags) for response, flags in sender.sent] == [
        ("request cancelled", adapter.final_flag)]


def test_a_cancellation_after_the_last_output_was_asked_about_still_sends_it_whole():
    """The client cancels just after the request's last output was checked for a cancellation: that output goes out
    with its tokens and finish_reason, then one FINAL (before, a bare FINAL: the answer was lost)."""
    from backend.request import FinishReason, RequestOutput

    class CancelsAfterTheFirstAsk(Sender):
        asks = 0

        def is_cancelled(self):
            self.asks += 1
            return self.asks >= 2

    sender = CancelsAfterTheFirstAsk()
    adapter, _ = _idle_adapter_with(sender, max_tokens=3)
    adapter._handle(RequestOutput("r", [97], "", True, FinishReason.LENGTH, 2, 1))
    (response, flags), (bare, final) = sender.sent
    assert list(response.outputs["output_ids"]) == [97] and response.outputs["finish_reason"][0] == b"length"
    assert (flags, bare, final) == (0, None, adapter.final_flag)
    assert finished(adapter, "length") == 1


def test_a_metric_update_that_fails_neither_fails_a_request_nor_holds_back_its_final(adapter, monkeypatch):
    """Tokens and finishes are counted through Triton's metric API, which may fail (a new label's metric is made over
    IPC): logged, and the request's tokens and its one FINAL go out all the same."""
    def broken(*args):
        raise RuntimeError("metric gone")

    monkeypatch.setattr(adapter.metrics, "on_tokens", broken)
    monkeypatch.setattr(adapter.metrics, "on_finished", broken)
    req = request("hello", max_tokens=4)
    adapter.submit(req)
    wait_final(req)
    assert req.sender.num_finals == 1 and errors_of(req) == [] and len(tokens_of(req)) == 4
