"""The requests Triton's OpenAI-compatible frontend (`python/openai`, `--backend vllm`) sends, sent as it sends
them, and the responses read as it reads them (its source: engine/utils/triton.py `_create_vllm_generate_request`
and the response helpers, read at server commit e1db8a6).

It sends text_input (BYTES [1]; chat prompts already templated by the frontend), stream, exclude_input_in_output,
return_num_input_tokens, return_num_output_tokens, return_logprobs (BOOL [1]) and sampling_parameters (a JSON
string of every non-empty OpenAI field: n, frequency_penalty, presence_penalty, temperature, top_p, ignore_eos,
max_tokens, seed, stop, logprobs). It reads text_output (exactly one element; not streaming, only the first
response), num_input_tokens once and num_output_tokens summed over streamed responses (UINT32, element 0), and
`logprobs`: one JSON string, a list per generated token of {token id: {logprob, rank, decoded_token}}.
"""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest

from .triton_helpers import MODEL

OPENAI_DEFAULTS = {"frequency_penalty": 0, "ignore_eos": False, "n": 1, "presence_penalty": 0, "top_p": 1}


def _frontend_inputs(prompt: str, stream: bool, sampling: dict, logprobs: bool):
    import tritonclient.grpc as grpcclient

    tensors = {
        "text_input": (np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        "stream": (np.array([stream]), "BOOL"),
        "exclude_input_in_output": (np.array([True]), "BOOL"),
        "sampling_parameters": (np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
        "return_num_input_tokens": (np.array([True]), "BOOL"),
        "return_num_output_tokens": (np.array([True]), "BOOL"),
        "return_logprobs": (np.array([logprobs]), "BOOL"),
    }
    inputs = []
    for name, (array, dtype) in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _infer(server, inputs) -> list:
    """Every response of one request (the final one last); raises on an error response."""
    import tritonclient.grpc as grpcclient

    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        client.async_stream_infer(MODEL, inputs, request_id="openai", enable_empty_final_response=True)
        responses = []
        while True:
            result, error = events.get(timeout=120)
            if error is not None:
                raise RuntimeError(str(error))
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return responses
    finally:
        client.stop_stream()
        client.close()


def _text(result) -> str:
    """The frontend's _to_string: text_output must hold exactly one element."""
    array = result.as_numpy("text_output")
    if array is None:
        return ""
    assert array.size == 1
    return array[0].decode()


def test_chat_completion_as_the_frontend_sends_it(server):
    sampling = {**OPENAI_DEFAULTS, "temperature": 0.7, "seed": 3, "max_tokens": 12}
    responses = _infer(server, _frontend_inputs("<｜User｜>Hello<｜Assistant｜>", False, sampling, False))
    assert 1 <= len(responses) <= 2  # _validate_triton_responses_non_streaming
    first = responses[0]
    prompt_tokens = int(first.as_numpy("num_input_tokens")[0])
    completion_tokens = int(first.as_numpy("num_output_tokens")[0])
    assert prompt_tokens > 0 and completion_tokens == len(first.as_numpy("output_ids")) > 0
    assert isinstance(_text(first), str)


def test_streamed_completion_with_logprobs_as_the_frontend_reads_it(server):
    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from backend.request import SamplingParams

    from .conftest import CHECKPOINT

    sampling = {**OPENAI_DEFAULTS, "temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": 2}
    responses = _infer(server, _frontend_inputs("The quick brown fox", True, sampling, True))
    prompt_tokens = None
    completion_tokens, text, entries, token_logprobs, top_ids = 0, "", [], [], []
    for result in responses:
        if result.as_numpy("output_logprobs") is not None:  # this server's own FP32 outputs, beside the JSON
            token_logprobs += result.as_numpy("output_logprobs").tolist()
            top_ids += result.as_numpy("output_top_logprob_ids").tolist()
        if result.as_numpy("num_input_tokens") is not None:
            prompt_tokens = prompt_tokens or int(result.as_numpy("num_input_tokens")[0])  # read once
            completion_tokens += int(result.as_numpy("num_output_tokens")[0])  # summed per chunk
        text += _text(result)
        raw = result.as_numpy("logprobs")
        if raw is not None:
            assert raw.size == 1
            entries += [e for e in json.loads(raw[0].decode()) if e]
    assert completion_tokens == 6 == len(entries)
    engine = LLMEngine(EngineConfig(checkpoint=str(CHECKPOINT), device="cpu"))
    prompt_ids = engine.tokenizer.encode("The quick brown fox").ids
    (offline,) = engine.generate([prompt_ids], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))
    assert prompt_tokens == len(prompt_ids) and text == offline["text"]
    assert max(abs(a - b.logprob) for a, b in zip(token_logprobs, offline["logprobs"])) < 1e-4
    assert top_ids == [[t for t, _ in lp.top] for lp in offline["logprobs"]]
    for token, entry, want in zip(offline["output_ids"], entries, offline["logprobs"]):
        chosen = min(entry.items(), key=lambda item: item[1]["rank"])  # how the frontend picks the token
        assert int(chosen[0]) == token and chosen[1]["rank"] == 1  # greedy: the most likely token
        assert abs(chosen[1]["logprob"] - want.logprob) < 1e-4
        assert chosen[1]["decoded_token"] == engine.tokenizer.decode([token], skip_special_tokens=False)
        assert sorted(e["rank"] for e in entry.values()) == [1, 2]


@pytest.mark.parametrize("sampling,message", [({"n": 2}, "n must be 1"), ({"logprobs": 50}, "logprobs"),
                                              ({"presence_penalty": 7}, "presence_penalty")])
def test_what_the_engine_cannot_do_is_refused_clearly(server, sampling, message):
    with pytest.raises(RuntimeError, match=message):
        _infer(server, _frontend_inputs("x", False, {**OPENAI_DEFAULTS, "max_tokens": 4, **sampling}, False))
