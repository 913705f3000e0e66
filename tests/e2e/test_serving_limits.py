"""Deadlines and the queue limit through a real tritonserver: `timeout_ms` ends a request with finish_reason
"timeout" after the tokens it got, `max_queue_size` refuses arrivals at once with UNAVAILABLE, bad values
get clear errors, and the metrics count both."""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import CHECKPOINT, _make_repository, _serve
from .triton_helpers import GrpcStreams, grpc_inputs, wait_for

LONG = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory):
    repository = _make_repository(tmp_path_factory.mktemp("limits_repo"), f"checkpoint={CHECKPOINT}", "device=cpu",
                                  "max_running_requests=1", "max_queue_size=1")
    yield from _serve(repository, tmp_path_factory.mktemp("limits_log"))


def _timeout_input(ms: int):
    return {"timeout_ms": np.array([ms], dtype=np.int32)}


def test_timeout_ends_a_stream_after_the_tokens_it_got(limited_server):
    streams = GrpcStreams(limited_server.grpc_url)
    try:
        streams.send("slow", grpc_inputs("Once upon a time", 5000, sampling=LONG, extra=_timeout_input(400)))
        result = streams.wait(["slow"], timeout=60)["slow"]
    finally:
        streams.close()
    assert result.error is None, result.error
    assert result.finish_reason == "timeout" and result.num_finals == 1
    assert 0 < len(result.ids) < 5000
    assert wait_for(lambda: limited_server.metric_values("dsv4_requests_finished_total").get(
        '{finish_reason="timeout",model="dsv4",version="1"}', 0) >= 1)


def test_arrivals_beyond_the_queue_limit_are_refused_at_once(limited_server):
    """max_running_requests=1, max_queue_size=1: one request runs, one waits, the third is refused."""
    streams = GrpcStreams(limited_server.grpc_url)
    try:
        streams.send("running", grpc_inputs("a", 3000, sampling=LONG))
        while not streams.results["running"].ids:  # admitted and decoding
            streams._take(timeout=60)
        streams.send("waiting", grpc_inputs("b", 5, sampling=LONG))
        # Requests on two streams reach the model in no set order: send the third once the second is queued.
        assert wait_for(lambda: limited_server.metric_values("dsv4_num_requests_waiting").get(
            '{model="dsv4",version="1"}', 0) == 1)
        third = GrpcStreams(limited_server.grpc_url)  # its own stream: errors carry no request id
        try:
            third.send("refused", grpc_inputs("c", 5, sampling=LONG))
            refused = third.wait(["refused"], timeout=30)["refused"]
        finally:
            third.close()
        assert refused.error and "queue is full" in refused.error and not refused.ids
    finally:
        streams.close(cancel=True)
    assert wait_for(lambda: limited_server.metric_values("dsv4_requests_rejected_total").get(
        '{model="dsv4",reason="queue_full",version="1"}', 0) >= 1)


@pytest.mark.parametrize("sampling,extra,message", [
    ({"timeout_ms": -5}, {}, "timeout_ms must be a positive integer"),
    ({"timeout_ms": "soon"}, {}, "timeout_ms"),
    ({"timeout_ms": 100}, {"timeout_ms": np.array([200], dtype=np.int32)}, "disagree"),
])
def test_bad_timeouts_get_clear_errors(limited_server, sampling, extra, message):
    streams = GrpcStreams(limited_server.grpc_url)
    try:
        streams.send("bad", grpc_inputs("x", 4, sampling={"temperature": 0, **sampling}, extra=extra))
        result = streams.wait(["bad"], timeout=30)["bad"]
    finally:
        streams.close()
    assert result.error and message in result.error, result.error
