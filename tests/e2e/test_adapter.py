"""The Triton adapter (model.py) in a real tritonserver, over the deterministic fake engine.

What is checked here is the adapter's contract, independent of the model: streamed and
non-streamed responses, exactly one FINAL per request, cancellation reaching the engine, bad
requests answered with errors while the server stays up, and metrics.
"""

import json
import threading
import time

import numpy as np
import pytest

from .fake_engine import expected_ids
from .triton_helpers import (REPO_ROOT, GrpcStreams, as_list, grpc_inputs, http_generate, http_generate_stream,
                             settled, wait_for)



def expected_text(prompt: str, max_tokens: int) -> str:
    return bytes(expected_ids(list(prompt.encode()), max_tokens)).decode("utf-8", errors="ignore")


def test_grpc_streams_its_tokens_in_order_and_one_final(fake_server):
    streams = GrpcStreams(fake_server.grpc_url)
    try:
        prompts = {f"r{i}": f"prompt number {i}" for i in range(4)}
        for rid, prompt in prompts.items():
            streams.send(rid, grpc_inputs(prompt, max_tokens=6))
        results = streams.wait(prompts)
    finally:
        streams.close()
    for rid, prompt in prompts.items():
        res = results[rid]
        assert res.error is None
        assert res.ids == expected_ids(list(prompt.encode()), 6)
        assert res.text == expected_text(prompt, 6)
        assert (res.num_finals, res.finish_reason) == (1, "length")
        # A response a step, unless the response thread fell a step behind (then one carries what queued)
        assert 2 <= res.num_responses <= 6


def test_split_utf8_characters_are_sent_whole(fake_server):
    streams = GrpcStreams(fake_server.grpc_url)
    try:
        streams.send("u", grpc_inputs("café", max_tokens=5))
        res = streams.wait(["u"])["u"]
    finally:
        streams.close()
    assert res.text == "éé" and res.ids == [0xC3, 0xA9, 0xC3, 0xA9, 0xC3]
    assert all(res.texts[:-1]), "no response with empty text before the final one"
    assert res.num_responses <= 3 and res.texts[-1] in ("", "é")  # the final carries the dangling byte


def test_http_generate_is_one_response_with_the_prompt(fake_server):
    status, body = http_generate(fake_server, {"text_input": "hi", "max_tokens": 4, "sampling_parameters": "{}"})
    assert status == 200, body
    assert body["text_output"] == "hi" + expected_text("hi", 4)
    assert body["output_ids"] == expected_ids(list(b"hi"), 4)
    assert body["finish_reason"] == "length"
    assert body["num_input_tokens"] == 2 and body["num_output_tokens"] == 4


def test_http_generate_with_vllm_style_parameters(fake_server):
    body = {"text_input": "hi", "parameters": {"stream": False, "temperature": 0, "max_tokens": 3}}
    status, out = http_generate(fake_server, body)
    assert status == 200, out
    assert out["output_ids"] == expected_ids(list(b"hi"), 3)


def test_http_generate_stream(fake_server):
    events = http_generate_stream(fake_server, {"text_input": "hey", "max_tokens": 5, "stream": True})
    assert [as_list(e["output_ids"]) for e in events] == [[t] for t in expected_ids(list(b"hey"), 5)]
    assert "".join(e["text_output"] for e in events) == expected_text("hey", 5)
    assert events[-1]["finish_reason"] == "length"


def test_input_ids_prompt(fake_server):
    ids = list(b"abc")
    streams = GrpcStreams(fake_server.grpc_url)
    try:
        streams.send("ids", grpc_inputs(ids, max_tokens=3))
        res = streams.wait(["ids"])["ids"]
    finally:
        streams.close()
    assert res.ids == expected_ids(ids, 3)


def _pages_used(server) -> float:
    return sum(server.metric_values("dsv4_pool_pages_used").values())



def test_cancel_frees_pages(fake_server):
    before = settled(lambda: fake_server.metric_values("dsv4_requests_finished_total").get(
        '{finish_reason="cancelled",model="dsv4",version="1"}', 0.0))
    streams = GrpcStreams(fake_server.grpc_url)
    streams.send("long", grpc_inputs("a long one", max_tokens=900))
    deadline = time.monotonic() + 30
    while streams.results["long"].num_responses < 3 and time.monotonic() < deadline:
        streams._take(timeout=30)
    assert streams.results["long"].num_responses >= 3
    assert wait_for(lambda: _pages_used(fake_server) >= 1, timeout=10.0)
    streams.close(cancel=True)
    assert wait_for(lambda: _pages_used(fake_server) == 0, timeout=10.0), fake_server.metrics_text()
    assert wait_for(lambda: fake_server.metric_values("dsv4_requests_finished_total").get(
        '{finish_reason="cancelled",model="dsv4",version="1"}', 0.0) == before + 1, timeout=10.0)


BAD_REQUESTS = {
    "empty prompt": {"text_input": np.array([b""], dtype=np.object_)},
    "non-utf8": {"text_input": np.array([b"\xff\xfe"], dtype=np.object_)},
    "zero max_tokens": {"max_tokens": np.array([0], dtype=np.int32)},
    "huge max_tokens": {"max_tokens": np.array([10**6], dtype=np.int32)},
    "bad json": {"sampling_parameters": np.array([b"{oops"], dtype=np.object_)},
    "unknown key": {"sampling_parameters": np.array([b'{"temp": 1}'], dtype=np.object_)},
    "negative temperature": {"sampling_parameters": np.array([b'{"temperature": -1}'], dtype=np.object_)},
    "too long prompt": {"text_input": np.array([b"x" * 1000], dtype=np.object_)},
    "engine refuses": {"text_input": np.array([b"NOFIT please"], dtype=np.object_)},
}


def test_bad_requests_get_errors_while_a_good_stream_completes(fake_server):
    good = GrpcStreams(fake_server.grpc_url)
    good.send("good", grpc_inputs("steady", max_tokens=40))
    errors = {}

    def send_bad(name, extra):
        streams = GrpcStreams(fake_server.grpc_url)
        try:
            streams.send(name, grpc_inputs("fine", max_tokens=4, extra=extra))
            errors[name] = streams.wait([name], timeout=30)[name].error
        finally:
            streams.close()

    threads = [threading.Thread(target=send_bad, args=item) for item in BAD_REQUESTS.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    res = good.wait(["good"])["good"]
    good.close()
    assert res.error is None and res.ids == expected_ids(list(b"steady"), 40)
    for name in BAD_REQUESTS:
        assert errors.get(name), f"{name}: expected an error response"
    assert "max_tokens" in errors["zero max_tokens"] and "never fit" in errors["engine refuses"]
    assert "positions" in errors["too long prompt"] and "at most 1000" in errors["huge max_tokens"]
    assert fake_server.is_ready()


def test_http_bad_request_is_a_400_with_the_message(fake_server):
    status, body = http_generate(fake_server, {"text_input": "hi", "sampling_parameters": json.dumps({"top_p": 0})})
    assert status == 400 and "top_p" in body["error"]


def test_metrics_are_exported(fake_server):
    text = fake_server.metrics_text()
    for family in ("dsv4_time_to_first_token_seconds", "dsv4_inter_token_latency_seconds",
                   "dsv4_requests_finished_total", "dsv4_engine_steps_total", "dsv4_longest_prefill_streak",
                   "dsv4_num_requests_running", "dsv4_num_requests_waiting", "dsv4_pool_usage_ratio"):
        assert f"# TYPE {family}" in text, family
    assert fake_server.metric_values("dsv4_time_to_first_token_seconds_count")['{model="dsv4",version="1"}'] >= 1


def test_a_bad_parameter_fails_the_model_load_naming_it(tmp_path, fake_repo_root):
    from .conftest import _make_repository
    from .triton_helpers import TritonServer

    repository = _make_repository(tmp_path / "repo")
    config = repository / "dsv4" / "config.pbtxt"
    text = config.read_text().replace(f'"{REPO_ROOT}"', f'"{fake_repo_root}"')
    old, new = 'key: "policy", value: { string_value: "" }', 'key: "policy", value: { string_value: "fastest" }'
    config.write_text(text.replace(old, new))
    server = TritonServer(repository, tmp_path / "tritonserver.log", ready_timeout_s=60)
    with pytest.raises(RuntimeError, match="exited") as failure:
        server.start()
    assert "parameter 'policy': invalid value 'fastest'" in str(failure.value)
    assert not server.stray_pids and not server.stray_shm
