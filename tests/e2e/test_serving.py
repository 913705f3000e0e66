"""The real engine served by a real tritonserver, checked against scripts/generate.py (offline).

At temperature 0 the served tokens must equal the offline engine's, whatever the transport
(gRPC streaming, HTTP generate, HTTP generate_stream) and however many requests share a batch.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from .conftest import CHECKPOINT
from .triton_helpers import (
    REPO_ROOT,
    GrpcStreams,
    as_list,
    grpc_inputs,
    http_generate,
    http_generate_stream,
    server_env,
    settled,
    stream_all,
    stub_argv,
    wait_for,
)

MAX_TOKENS = 8
PROMPTS = [
    "Hello world",
    "The quick brown fox",
    "a",
    "DeepSeek V4 serving test",
    "Once upon a time, in a land far away,",
    "1 2 3 4 5",
    "def main():",
    "Triton Inference Server",
    "The capital of France is",
    "zzz",
    "Paged attention keeps memory in pages.",
    "Q: what is 2+2? A:",
    "lorem ipsum dolor sit amet",
    "\u00e9t\u00e9 caf\u00e9",
    "x" * 40,
    "Many requests share one batch",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """scripts/generate.py's output for every prompt, at temperature 0."""
    prompts_file = tmp_path_factory.mktemp("prompts") / "prompts.json"
    prompts_file.write_text(json.dumps(PROMPTS))
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "generate.py"), "--checkpoint", str(CHECKPOINT),
           "--prompts-file", str(prompts_file), "--max-tokens", str(MAX_TOKENS), "--device", "cpu"]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300, env=server_env())
    results = json.loads(done.stdout)
    assert len(results) == len(PROMPTS)
    return dict(zip(PROMPTS, results))



def test_grpc_streaming_matches_offline_generation(server, reference):
    prompt = PROMPTS[0]
    (res,) = stream_all(server, [prompt], MAX_TOKENS)
    expected = reference[prompt]
    assert res.error is None
    assert res.ids == expected["output_ids"]
    assert res.text == expected["text"]
    assert res.finish_reason == expected["finish_reason"]
    assert res.num_finals == 1


def test_sixteen_concurrent_streams_all_complete_correctly(server, reference):
    results = stream_all(server, PROMPTS, MAX_TOKENS)
    for prompt, res in zip(PROMPTS, results):
        expected = reference[prompt]
        assert res.error is None, (prompt, res.error)
        assert (res.ids, res.text, res.finish_reason) == (
            expected["output_ids"], expected["text"], expected["finish_reason"]), prompt
        assert res.num_finals == 1


def test_http_generate_matches_offline_generation(server, reference):
    prompt = PROMPTS[1]
    body = {"text_input": prompt, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"temperature": 0})}
    status, out = http_generate(server, body)
    assert status == 200, out
    assert as_list(out["output_ids"]) == reference[prompt]["output_ids"]
    assert out["text_output"] == reference[prompt]["text"]
    assert out["finish_reason"] == reference[prompt]["finish_reason"]


def test_http_generate_stream_matches_offline_generation(server, reference):
    prompt = PROMPTS[2]
    events = http_generate_stream(server, {"text_input": prompt, "max_tokens": MAX_TOKENS, "stream": True})
    assert [t for e in events for t in as_list(e["output_ids"])] == reference[prompt]["output_ids"]
    assert "".join(e["text_output"] for e in events) == reference[prompt]["text"]
    assert events[-1]["finish_reason"] == reference[prompt]["finish_reason"]



def test_a_stop_string_ends_the_stream_and_nothing_past_it_is_sent(server, reference):
    """Stop strings are applied on the adapter's response thread (the engine reports token ids): the text is cut
    before the stop string, the finish reason is "stop", and the engine's outputs after it never reach the client."""
    prompt = max(PROMPTS, key=lambda p: len(reference[p]["text"]))
    text = reference[prompt]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip() and len(text) >= 6
    events = http_generate_stream(server, {"text_input": prompt, "max_tokens": MAX_TOKENS, "stream": True,
                                           "sampling_parameters": json.dumps({"temperature": 0, "stop": [stop]})})
    assert "".join(e["text_output"] for e in events) == text[:text.index(stop)]
    assert [e["finish_reason"] for e in events] == [""] * (len(events) - 1) + ["stop"]
    streamed = [t for e in events for t in as_list(e["output_ids"])]
    assert streamed == reference[prompt]["output_ids"][:len(streamed)] and len(streamed) < MAX_TOKENS


def test_a_chat_turn_is_served_from_the_prefix_cache_exactly(server, tmp_path):
    """The next turn resends the conversation: the server restores the previous request's end (every position
    but the last reply token), reports it per request (num_cached_tokens), and streams what offline generation
    without the cache gives."""
    def counter(name):
        return server.metric_values(f"dsv4_prefix_cache_{name}_tokens_total").get('{model="dsv4",version="1"}', 0)

    gen = np.random.default_rng(12)
    history = gen.integers(2, _vocab_size(), 300).tolist()
    hits_before, queried_before = settled(lambda: (counter("hit"), counter("queried")))
    report = {"return_num_cached_tokens": np.array([True])}
    (first,) = stream_all(server, [history], MAX_TOKENS, extra=report)
    turn = history + first.ids + gen.integers(2, _vocab_size(), 20).tolist()
    (second,) = stream_all(server, [turn], MAX_TOKENS, extra=report)
    restored = len(history) + len(first.ids) - 1  # every position but the last reply token
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, restored)
    assert wait_for(lambda: counter("hit") - hits_before == restored)
    assert wait_for(lambda: counter("queried") - queried_before == len(history) + len(turn)), counter("queried")
    ids_file = tmp_path / "turn.json"
    ids_file.write_text(json.dumps([turn]))
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "generate.py"), "--checkpoint", str(CHECKPOINT),
           "--input-ids-file", str(ids_file), "--max-tokens", str(MAX_TOKENS), "--device", "cpu",
           "--no-enable-prefix-caching"]
    (expected,) = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    assert second.error is None and second.ids == expected["output_ids"]


def test_cancelling_a_stream_frees_its_pages(server):
    def pages_used():  # by requests: the pages in use that no prefix-cache entry holds
        cached = server.metric_values("dsv4_prefix_cache_pages")
        return sum(used - cached.get(labels, 0) for labels, used in server.metric_values("dsv4_pool_pages_used").items())

    def cancelled():
        return server.metric_values("dsv4_requests_finished_total").get(
            '{finish_reason="cancelled",model="dsv4",version="1"}', 0)

    assert wait_for(lambda: pages_used() == 0), "pages in use before the test"
    before = settled(cancelled)
    streams = GrpcStreams(server.grpc_url)
    streams.send("long", grpc_inputs("tell me a very long story", max_tokens=4000,
                                     sampling={"temperature": 0, "ignore_eos": True}))
    deadline = time.monotonic() + 60
    while streams.results["long"].num_responses < 3 and time.monotonic() < deadline:
        streams._take(timeout=60)
    assert streams.results["long"].num_finals == 0, "finished before it could be cancelled"
    assert wait_for(lambda: pages_used() > 0)
    streams.close(cancel=True)
    assert wait_for(lambda: pages_used() == 0), server.metrics_text()
    assert wait_for(lambda: cancelled() == before + 1)
    assert wait_for(lambda: sum(server.metric_values("dsv4_num_requests_running").values()) == 0)


def test_a_cpu_server_runs_single_threaded_mkl_and_steps_on_every_cpu(server):
    """model.py sets MKL_NUM_THREADS=1 before torch loads (MKL's threads slowed the engine thread's prefill 2x,
    docs/host-loop.md#threads) and, as torch then defaults to one thread, gives the engine the CPUs as cpu_threads."""
    if "MKL_NUM_THREADS" in os.environ:
        pytest.skip("the server inherits this run's MKL_NUM_THREADS, which model.py keeps")
    log = server.log_path.read_text()  # the model logs both as it builds the engine
    assert "MKL_NUM_THREADS=1;" in log
    assert f"cpu_threads={len(os.sched_getaffinity(0))}," in log


def test_sigusr1_writes_the_stubs_python_stacks_to_the_log_and_the_server_serves_on(server, reference):
    """`kill -USR1` of the stub (docs/serving.md#when-the-server-hangs) prints every Python thread's stack in the
    server's log, the engine's loop and the response thread among them, and the model goes on serving."""
    stub_pid, _ = stub_argv(server.process.pid)
    logged = server.log_path.stat().st_size
    os.kill(stub_pid, signal.SIGUSR1)
    new_lines = lambda: server.log_path.read_bytes()[logged:].decode(errors="replace")  # noqa: E731
    assert wait_for(lambda: "in _response_loop" in new_lines() and "most recent call first" in new_lines())
    assert "backend/serving/adapter.py" in new_lines()
    prompt = PROMPTS[3]
    (res,) = stream_all(server, [prompt], MAX_TOKENS)
    assert (res.error, res.ids) == (None, reference[prompt]["output_ids"])


def _vocab_size() -> int:
    return json.loads((CHECKPOINT / "config.json").read_text())["vocab_size"]


def _bad_requests() -> dict:
    vocab = _vocab_size()
    text = lambda b: np.array([b], dtype=np.object_)  # noqa: E731
    return {
        "empty prompt": ("", {}),
        "non-utf8": ("x", {"text_input": text(b"\xc3\x28")}),
        "out-of-vocab ids": ([1, vocab], {}),
        "prompt too long": ([5] * 100_000, {}),
        "zero max_tokens": ("hi", {"max_tokens": np.array([0], np.int32)}),
        "absurd max_tokens": ("hi", {"max_tokens": np.array([2**31 - 1], np.int32)}),
        "malformed json": ("hi", {"sampling_parameters": text(b'{"temperature": ')}),
        "unknown key": ("hi", {"sampling_parameters": text(b'{"beam_width": 4}')}),
        "out-of-range top_p": ("hi", {"sampling_parameters": text(b'{"top_p": 1.5}')}),
        "wrong dtype": ("hi", {"max_tokens": np.array([1.0], np.float32)}),
    }


def test_bad_inputs_get_errors_while_a_good_stream_completes(server, reference):
    prompt = PROMPTS[3]
    good = GrpcStreams(server.grpc_url)
    good.send("good", grpc_inputs(prompt, MAX_TOKENS))
    errors = {}

    def send_bad(name, prompt_and_extra):
        bad_prompt, extra = prompt_and_extra
        streams = GrpcStreams(server.grpc_url)
        try:
            streams.send(name, grpc_inputs(bad_prompt, 4, extra=extra))
            errors[name] = streams.wait([name], timeout=60)[name].error
        except Exception as exc:  # e.g. Triton refusing a wrong dtype before the model sees it
            errors[name] = f"client-side: {exc}"
        finally:
            streams.close()

    threads = [threading.Thread(target=send_bad, args=item) for item in _bad_requests().items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    res = good.wait(["good"], timeout=120)["good"]
    good.close()
    assert res.error is None and res.ids == reference[prompt]["output_ids"]
    missing = [name for name in _bad_requests() if not errors.get(name)]
    assert not missing, f"no error response for {missing}: {errors}"
    assert "max_tokens" in errors["zero max_tokens"] and "vocabulary" in errors["out-of-vocab ids"]
    assert server.is_ready()
    (after,) = stream_all(server, [prompt], MAX_TOKENS)
    assert after.ids == reference[prompt]["output_ids"]


def test_metrics_endpoint(server):
    stream_all(server, [PROMPTS[4]], MAX_TOKENS)
    text = server.metrics_text()
    for family in ("dsv4_time_to_first_token_seconds", "dsv4_inter_token_latency_seconds",
                   "dsv4_requests_finished_total", "dsv4_engine_steps_total", "dsv4_longest_prefill_streak",
                   "dsv4_num_requests_running", "dsv4_num_requests_waiting", "dsv4_pool_usage_ratio",
                   "dsv4_pool_pages_used"):
        assert f"# TYPE {family}" in text, family
    assert server.metric_values("dsv4_time_to_first_token_seconds_count")['{model="dsv4",version="1"}'] >= 1
    steps = server.metric_values("dsv4_engine_steps_total")
    assert steps['{kind="prefill",model="dsv4",version="1"}'] >= 1
    assert steps['{kind="decode",model="dsv4",version="1"}'] >= 1
    assert "nv_inference_request_success" in text  # Triton's own metrics on the same port


def test_chat_messages_are_rendered_in_deepseek_v4s_chat_format(server, tmp_path):
    """A `messages` input (JSON list) is the prompt DeepSeek-V4's chat format renders (the built-in checkpoint, as
    the published ones, has no template of its own), with the request's `chat_template_kwargs` and `tools`: the
    served tokens are scripts/generate.py's for the same chat (--chats-file, --tools-file), and with
    parse_chat_output the answer comes in its parts too; malformed messages and tools get a clear error."""
    from backend.chat import chat_format

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3 C"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    status, out = http_generate(server, {"messages": json.dumps(messages), "max_tokens": MAX_TOKENS,
                                         "chat_template_kwargs": json.dumps({"thinking": True}),
                                         "tools": json.dumps(tools), "exclude_input_in_output": True,
                                         "parse_chat_output": True,
                                         "sampling_parameters": json.dumps({"temperature": 0})})
    assert status == 200, out
    # the answer in DeepSeek-V4's parts (thinking mode: reasoning first); the tiny model writes no </think>
    assert (out["reasoning_content"], out["content"], out["tool_calls"]) == (out["text_output"], "", "[]")
    streamed = stream_all(server, [None], MAX_TOKENS, extra={
        "messages": np.array([json.dumps(messages).encode()], dtype=np.object_),
        "tools": np.array([json.dumps(tools).encode()], dtype=np.object_),
        "chat_template_kwargs": np.array([b'{"thinking": true}'], dtype=np.object_),
        "parse_chat_output": np.array([True])})[0]
    assert streamed.error is None and streamed.text == out["text_output"]  # (streamed: the same answer, in parts)
    assert len(streamed.answer_parts) == streamed.num_responses > 1
    assert "".join(r for r, _, _ in streamed.answer_parts) == out["reasoning_content"]
    assert all(content == "" and calls == [] for _, content, calls in streamed.answer_parts)
    prompt = chat_format(CHECKPOINT).render(messages, {"thinking": True}, tools)
    assert "## Tools" in prompt and prompt.endswith("<｜User｜><tool_result>3 C</tool_result><｜Assistant｜><think>")
    (tmp_path / "chats.json").write_text(json.dumps([messages]))
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "generate.py"), "--checkpoint", str(CHECKPOINT), "--device",
           "cpu", "--chats-file", str(tmp_path / "chats.json"), "--tools-file", str(tmp_path / "tools.json"),
           "--chat-template-kwargs", '{"thinking": true}', "--max-tokens", str(MAX_TOKENS)]
    (offline,) = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300,
                                           env=server_env()).stdout)
    assert as_list(out["output_ids"]) == offline["output_ids"] and out["text_output"] == offline["text"]
    status, out = http_generate(server, {"messages": json.dumps(messages), "max_tokens": 4,
                                         "tools": json.dumps([{"type": "function", "function": {}}])})
    assert status == 400 and "tools[0] must be an object" in json.dumps(out)
    status, out = http_generate(server, {"messages": '[{"role": "robot", "content": "x"}]', "max_tokens": 4})
    assert status == 400 and "role must be one of" in json.dumps(out)


def test_tool_choice_makes_the_model_call_a_tool(server, tmp_path):
    """tool_choice "required" or a named function constrains the answer to DeepSeek-V4's tool calls (the built-in
    checkpoint's random weights write one only so): over HTTP and streamed over gRPC, parse_chat_output gives the
    calls, their arguments as the schema asks, and finish_reason tool_calls, and scripts/generate.py --tool-choice
    writes the same tokens offline; a function not among the tools is a clear error."""
    import jsonschema

    city = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Bergen"]}},
            "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": city}}]
    chat = {"messages": json.dumps([{"role": "user", "content": "Weather in Oslo?"}]), "tools": json.dumps(tools),
            "parse_chat_output": True, "exclude_input_in_output": True, "max_tokens": 200}
    named = json.dumps({"type": "function", "function": {"name": "weather"}})
    status, out = http_generate(server, {**chat, "tool_choice": named})
    assert status == 200 and out["finish_reason"] == "tool_calls", out
    [call] = json.loads(out["tool_calls"])
    assert call["function"]["name"] == "weather" and out["content"] == ""
    jsonschema.validate(json.loads(call["function"]["arguments"]), city)
    (tmp_path / "chats.json").write_text(json.dumps([json.loads(chat["messages"])]))
    (tmp_path / "tools.json").write_text(chat["tools"])
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "generate.py"), "--checkpoint", str(CHECKPOINT), "--device",
           "cpu", "--chats-file", str(tmp_path / "chats.json"), "--tools-file", str(tmp_path / "tools.json"),
           "--tool-choice", named, "--max-tokens", "200"]
    (offline,) = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300,
                                           env=server_env()).stdout)
    assert offline["output_ids"] == as_list(out["output_ids"]) and offline["finish_reason"] == "stop"
    (streamed,) = stream_all(server, [None], 200, extra={
        **{name: np.array([chat[name].encode()], dtype=np.object_) for name in ("messages", "tools")},
        "tool_choice": np.array([b"required"], dtype=np.object_), "parse_chat_output": np.array([True])})
    calls = [call for _, _, response_calls in streamed.answer_parts for call in response_calls]
    assert streamed.error is None and streamed.finish_reason == "tool_calls" and calls, streamed.text
    for call in calls:
        assert call["function"]["name"] == "weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), city)
    status, out = http_generate(server, {**chat, "tool_choice": "required", "parallel_tool_calls": False})
    assert status == 200 and out["finish_reason"] == "tool_calls" and len(json.loads(out["tool_calls"])) == 1, out
    status, out = http_generate(server, {**chat, "tool_choice": '{"type": "function", "function": {"name": "x"}}'})
    assert status == 400 and "names the function 'x', which is not among the tools ('weather')" in json.dumps(out)
