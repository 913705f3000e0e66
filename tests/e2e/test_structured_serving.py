"""Structured outputs through a real tritonserver: vLLM's guided_decoding and structured_outputs in
sampling_parameters (as objects and as the JSON strings Triton's OpenAI frontend sends), over gRPC streaming, HTTP
generate and generate_stream, beside unconstrained requests; a bad constraint gets an error and harms nothing; the
grammar metrics count."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np

from structured_schemas import SCHEMAS

from .triton_helpers import (GrpcStreams, as_list, grpc_inputs, http_generate, http_generate_stream, http_post,
                             settled)

REGEX = r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ["approve", "reject", "escalate"]


def _sampling(constraint: dict | None, temperature: float = 0.0, key: str = "guided_decoding", **extra) -> dict:
    params = {"temperature": temperature, "seed": 7, **extra}
    if constraint is not None:
        params[key] = constraint
    return params


def test_constrained_and_unconstrained_streams_share_the_server(server):
    """Eight concurrent gRPC streams: four JSON schemas (greedy and sampled), a regex, a choice and two
    unconstrained requests."""
    names = ["tool_call", "nested", "array_of_objects", "enum"]
    requests = {f"json-{n}": (_sampling({"json": SCHEMAS[n], "disable_any_whitespace": i % 2 == 0}, i % 2), 256)
                for i, n in enumerate(names)}
    requests["regex"] = (_sampling({"regex": REGEX}, 1.0), 64)
    requests["choice"] = (_sampling({"choice": CHOICES}), 16)
    requests["free-0"] = (_sampling(None, ignore_eos=True), 12)
    requests["free-1"] = (_sampling(None, 1.0, ignore_eos=True), 12)
    streams = GrpcStreams(server.grpc_url)
    try:
        for rid, (sampling, max_tokens) in requests.items():
            streams.send(rid, grpc_inputs("Answer in the format asked:", max_tokens, sampling=sampling))
        results = streams.wait(list(requests), timeout=300)
    finally:
        streams.close()
    for rid, r in results.items():
        assert r.error is None and r.num_finals == 1, (rid, r)
        if rid.startswith("free"):
            assert r.finish_reason == "length" and len(r.ids) == 12
            continue
        assert r.finish_reason == "stop", (rid, r)
        if rid.startswith("json"):
            jsonschema.validate(json.loads(r.text), SCHEMAS[rid[len("json-"):]])
        elif rid == "regex":
            assert re.fullmatch(REGEX, r.text)
        else:
            assert r.text in CHOICES


def test_the_openai_frontends_structured_outputs_over_grpc(server):
    """What Triton's OpenAI frontend sends for a named tool choice: structured_outputs, a JSON string of vLLM's
    StructuredOutputsParams whose `json` is the schema as a string, inside the sampling_parameters string."""
    schema = SCHEMAS["tool_call"]
    params = json.dumps({"json": json.dumps(schema), "regex": None, "choice": None, "grammar": None,
                         "json_object": None, "disable_any_whitespace": False, "disable_additional_properties": False,
                         "whitespace_pattern": None, "structural_tag": None, "_backend": None,
                         "_backend_was_auto": False})
    streams = GrpcStreams(server.grpc_url)
    try:
        sampling = {"temperature": 0, "structured_outputs": params}
        streams.send("tool", grpc_inputs("Call a tool:", 256, sampling=sampling))
        result = streams.wait(["tool"], timeout=120)["tool"]
    finally:
        streams.close()
    assert result.error is None and result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), schema)


def test_http_generate_and_generate_stream(server):
    body = {"text_input": "Reply:", "max_tokens": 256, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(_sampling({"json": SCHEMAS["person"], "disable_any_whitespace": True}))}
    status, answer = http_generate(server, body)
    assert status == 200 and as_list(answer["finish_reason"]) == ["stop"]
    jsonschema.validate(json.loads(as_list(answer["text_output"])[0]), SCHEMAS["person"])
    events = http_generate_stream(server, {"text_input": "Pick:", "max_tokens": 16, "stream": True,
                                           "sampling_parameters": json.dumps(_sampling({"choice": CHOICES}, 1.0))})
    assert "".join(as_list(e["text_output"])[0] for e in events) in CHOICES
    assert as_list(events[-1]["finish_reason"]) == ["stop"]


def test_log_probabilities_of_masked_tokens_stay_valid_json(server):
    """With a grammar most top tokens are excluded (log-probability -inf): the HTTP answer is still strict JSON."""
    body = {"text_input": "Pick:", "max_tokens": 16, "exclude_input_in_output": True, "return_logprobs": True,
            "top_logprobs": 4, "sampling_parameters": json.dumps(_sampling({"choice": CHOICES}))}
    status, raw = http_post(f"http://{server.http_url}/v2/models/dsv4/generate", body)

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    answer = json.loads(raw, parse_constant=refuse)
    assert status == 200, answer
    assert as_list(answer["text_output"])[0] in CHOICES
    per_token = json.loads(as_list(answer["logprobs"])[0], parse_constant=refuse)
    assert any(entry["logprob"] == -9999.0 for token in per_token for entry in token.values())


def test_a_bad_constraint_is_refused_and_harms_nothing(server):
    streams = GrpcStreams(server.grpc_url)
    try:
        streams.send("good", grpc_inputs("Pick:", 16, sampling=_sampling({"choice": CHOICES})))
        bad = {"schema": {"json": {"type": "nope"}}, "regex": {"regex": "(("},
               "two kinds": {"regex": "a", "choice": ["a"]}, "empty choice": {"choice": []}}
        errors = {}
        for name, constraint in bad.items():
            refused = GrpcStreams(server.grpc_url)  # its own stream: errors carry no request id
            try:
                refused.send(name, grpc_inputs("x", 8, sampling=_sampling(constraint)))
                errors[name] = refused.wait([name], timeout=60)[name].error
            finally:
                refused.close()
        good = streams.wait(["good"], timeout=120)["good"]
    finally:
        streams.close()
    assert "invalid JSON schema" in errors["schema"] and "invalid regex" in errors["regex"]
    assert "exactly one of" in errors["two kinds"] and "non-empty list" in errors["empty choice"]
    assert good.error is None and good.text in CHOICES and server.is_ready()


def test_grammar_metrics(server):
    constraint = {"json": {**SCHEMAS["date_like"], "title": "only this test's"}, "disable_any_whitespace": True}
    before = {name: settled(lambda: server.metric_values(name).get('{model="dsv4",version="1"}', 0))
              for name in ("dsv4_grammar_cache_hits_total", "dsv4_grammar_compiles_total",
                           "dsv4_grammar_compile_seconds_count")}
    for rid in ("first", "again"):  # the second finds the first's grammar in the cache
        streams = GrpcStreams(server.grpc_url)
        try:
            streams.send(rid, grpc_inputs("Date:", 64, sampling=_sampling(constraint)))
            assert streams.wait([rid], timeout=120)[rid].finish_reason == "stop"
        finally:
            streams.close()
    after = {name: settled(lambda: server.metric_values(name)['{model="dsv4",version="1"}']) for name in before}
    assert {name: after[name] - before[name] for name in before} == {
        "dsv4_grammar_cache_hits_total": 1, "dsv4_grammar_compiles_total": 1, "dsv4_grammar_compile_seconds_count": 1}
    compile_seconds = server.metric_values("dsv4_grammar_compile_seconds_sum")['{model="dsv4",version="1"}']
    np.testing.assert_array_less(0, compile_seconds)
