"""backend/serving/triton_io.py: the form of request tensors and response building, without a server.

The values (vocabulary, limits, capacity) are the engine's admission gate: tests/test_request.py.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from google.protobuf import text_format
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import triton_to_np_dtype

from backend.chat import BOS, DEEPSEEK_V4_TEMPLATE, EOS, ChatTemplate
from backend.request import FinishReason, SamplingParams, TokenLogprobs
from backend.serving.triton_io import ParsedRequest, ResponseBuilder, parse_request, response_arrays

REPO = Path(__file__).resolve().parents[2]
WORDS = ["[UNK]", "hello", "world", "the", "quick", "brown", "fox", "é"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def text(value: str | bytes) -> np.ndarray:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)


def parse(tokenizer, params=None, **inputs) -> ParsedRequest:
    return parse_request(inputs, tokenizer, params)


def sampling(params: dict) -> np.ndarray:
    return text(json.dumps(params))


# --- prompts ----------------------------------------------------------------------------------


def test_text_prompt_with_defaults(tokenizer):
    req = parse(tokenizer, text_input=text("hello world"))
    assert req.prompt_ids == [1, 2]
    assert req.prompt_text == "hello world"
    assert req.sampling == SamplingParams()
    assert (req.stream, req.exclude_input_in_output, req.priority) == (False, False, 0)


def test_a_text_starting_with_the_bos_a_tokenizer_adds_keeps_one():
    """With a tokenizer that adds a BOS (as DeepSeek's do), a plain text gets it, and a text that starts with it (a
    chat rendered by a template, as Triton's OpenAI frontend sends it) is not given a second."""
    vocab = {w: i for i, w in enumerate(WORDS + ["<bos>"])}
    adds_bos = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    adds_bos.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    adds_bos.add_special_tokens(["<bos>"])
    bos = vocab["<bos>"]
    adds_bos.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    assert parse(adds_bos, text_input=text("hello world")).prompt_ids == [bos, 1, 2]
    assert parse(adds_bos, text_input=text("<bos> hello world")).prompt_ids == [bos, 1, 2]
    assert parse(adds_bos, text_input=text("<bos> <bos> hello")).prompt_ids == [bos, bos, 1]  # (the text's two)
    assert parse(adds_bos, text_input=text("hello hello")).prompt_ids == [bos, 1, 1]


def test_input_ids_prompt_int32_and_int64(tokenizer):
    for dtype in (np.int32, np.int64):
        req = parse(tokenizer, input_ids=np.array([3, 4, 5], dtype=dtype))
        assert req.prompt_ids == [3, 4, 5]
        assert all(type(t) is int for t in req.prompt_ids)
        assert req.prompt_text is None  # decoded only when prepended, once the engine accepted the ids


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({}, "exactly one of"),
        ({"text_input": text("hello"), "input_ids": np.array([1], np.int32)}, "got text_input, input_ids"),
        ({"text_input": text("")}, "text_input is empty"),
        ({"text_input": text("\xff".encode("latin-1"))}, "not valid UTF-8"),
        ({"text_input": np.array([1], np.int32)}, "STRING"),
        ({"text_input": np.array([b"a", b"b"], np.object_)}, "exactly one string"),
        ({"input_ids": np.array([1.0, 2.0], np.float32)}, "INT32"),
        ({"input_ids": np.array([[1, 2]], np.int32)}, "one-dimensional"),
        ({"text_input": text("hello"), "bogus": np.array([1])}, "unknown input"),
    ],
)
def test_bad_prompts_are_rejected(tokenizer, inputs, message):
    with pytest.raises(ValueError, match=message):
        parse_request(inputs, tokenizer)


def test_utf8_prompt_is_decoded(tokenizer):
    assert parse(tokenizer, text_input=text("é fox")).prompt_ids == [7, 6]


def test_whitespace_only_prompt_has_no_tokens(tokenizer):
    with pytest.raises(ValueError, match="no tokens"):
        parse(tokenizer, text_input=text("   "))


# --- scalars ----------------------------------------------------------------------------------


def test_stream_priority_and_exclude(tokenizer):
    req = parse(
        tokenizer,
        text_input=text("hello"),
        stream=np.array([True]),
        priority=np.array([-3], np.int32),
    )
    assert (req.stream, req.exclude_input_in_output, req.priority) == (True, True, -3)
    req = parse(tokenizer, text_input=text("hello"), exclude_input_in_output=np.array([True]))
    assert (req.stream, req.exclude_input_in_output) == (False, True)


def test_streaming_with_prompt_in_output_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="not supported when streaming"):
        parse(tokenizer, text_input=text("hello"), stream=np.array([True]), exclude_input_in_output=np.array([False]))


@pytest.mark.parametrize(
    "name, array, message",
    [
        ("stream", np.array([1], np.int32), "BOOL"),
        ("stream", np.array([True, False]), "exactly one value"),
        ("max_tokens", np.array([1.5], np.float32), "INT32"),
        ("priority", np.array([True]), "INT32"),
    ],
)
def test_bad_scalar_inputs(tokenizer, name, array, message):
    with pytest.raises(ValueError, match=message):
        parse(tokenizer, text_input=text("hello"), **{name: array})


# --- sampling parameters ----------------------------------------------------------------------


def test_sampling_parameters_json(tokenizer):
    params = {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
        "min_p": 0.1,
        "seed": 11,
        "stop": "fox",
        "stop_token_ids": [2],
        "ignore_eos": True,
    }
    req = parse(tokenizer, text_input=text("hello"), sampling_parameters=sampling(params))
    assert req.sampling == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=4, min_p=0.1, seed=11, stop=["fox"], stop_token_ids=[2],
        ignore_eos=True,
    )


def test_genai_perf_style_string_numbers_and_min_tokens(tokenizer):
    """genai-perf sends {"max_tokens": "12", "min_tokens": "12"} for a deterministic output length."""
    params = sampling({"max_tokens": "12", "min_tokens": "12"})
    req = parse(tokenizer, text_input=text("hello"), sampling_parameters=params)
    assert (req.sampling.max_tokens, req.sampling.min_tokens, req.sampling.ignore_eos) == (12, 12, False)


def test_max_tokens_input(tokenizer):
    req = parse(tokenizer, text_input=text("hello"), max_tokens=np.array([9], np.int32))
    assert req.sampling.max_tokens == 9
    req = parse(
        tokenizer, text_input=text("hello"), max_tokens=np.array([9], np.int32),
        sampling_parameters=sampling({"max_tokens": 9}),
    )
    assert req.sampling.max_tokens == 9


@pytest.mark.parametrize(
    "raw, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"max_token": 3}', "unknown key"),
        ('{"max_tokens": 0}', "max_tokens must be a positive"),
        ('{"max_tokens": -5}', "max_tokens must be a positive"),
        ('{"max_tokens": 2.5}', "integer"),
        ('{"max_tokens": true}', "integer"),
        ('{"max_tokens": "many"}', "integer"),
        ('{"temperature": -1}', "temperature"),
        ('{"temperature": NaN}', "finite"),
        ('{"temperature": "hot"}', "finite"),
        ('{"top_p": 0}', "top_p"),
        ('{"top_k": -2}', "top_k"),
        ('{"min_p": 2}', "min_p"),
        ('{"seed": 9223372036854775808}', "seed must be a 64-bit signed integer"),
        ('{"skip_special_tokens": false}', "skip_special_tokens=false is not supported"),
        ('{"stop": [""]}', "stop"),
        ('{"stop": 3}', "stop"),
        ('{"stop_token_ids": "1"}', "stop_token_ids must be a list"),
        ('{"stop_token_ids": [-1]}', "stop_token_ids must be a list"),
        ('{"ignore_eos": "yes"}', "boolean"),
        ('{"min_tokens": -1, "max_tokens": 8}', "min_tokens must be a non-negative integer"),
        ('{"temperature": 1' + "0" * 400 + "}", "temperature must be a finite number"),  # (past float's range)
        ("[" * 100_000 + "]" * 100_000, "sampling_parameters nests too deeply"),
        ('{"x": ' + "[" * 300 + "]" * 300 + "}", "sampling_parameters nests 300 levels deep, more than 200"),
        ('{"timeout_ms": 0}', "timeout_ms must be a positive integer"),
        ('{"timeout_ms": ' + "9" * 400 + "}", "timeout_ms must be a positive integer \\(milliseconds\\) up to 2\\^53"),
    ],
)
def test_bad_sampling_parameters(tokenizer, raw, message):
    with pytest.raises(ValueError, match=message):
        parse(tokenizer, text_input=text("hello"), sampling_parameters=text(raw))


def test_a_null_in_the_json_leaves_the_input_of_the_same_value(tokenizer):
    """"logprobs": null means not given (as vLLM takes it), so the top_logprobs input stands alone."""
    nulls = sampling({"logprobs": None, "timeout_ms": None})
    req = parse(tokenizer, text_input=text("hello"), top_logprobs=np.array([3], np.int32),
                timeout_ms=np.array([500], np.int32), sampling_parameters=nulls)
    assert (req.sampling.logprobs, req.sampling.timeout_ms) == (3, 500)


def test_max_tokens_input_and_json_must_agree(tokenizer):
    with pytest.raises(ValueError, match="disagree"):
        parse(
            tokenizer,
            text_input=text("hello"),
            max_tokens=np.array([3], np.int32),
            sampling_parameters=sampling({"max_tokens": 4}),
        )


def test_max_tokens_input_out_of_range(tokenizer):
    for value in (0, -1):
        with pytest.raises(ValueError, match="max_tokens"):
            parse(tokenizer, text_input=text("hello"), max_tokens=np.array([value], np.int32))


def test_request_parameters_used_without_sampling_parameters(tokenizer):
    """HTTP generate's "parameters" object (vLLM style, with stream and Triton's own keys)."""
    params = json.dumps(
        {"max_tokens": 5, "temperature": 0, "stream": False, "triton_enable_empty_final_response": True})
    req = parse(tokenizer, params, text_input=text("hello"))
    assert (req.sampling.max_tokens, req.stream) == (5, False)
    req = parse(tokenizer, {"stream": True}, text_input=text("hello"))
    assert req.stream is True


def test_sampling_parameters_input_wins_over_request_parameters(tokenizer):
    req = parse(tokenizer, {"max_tokens": 5}, text_input=text("hello"), sampling_parameters=sampling({"max_tokens": 3}))
    assert req.sampling.max_tokens == 3


def test_bad_request_parameters(tokenizer):
    with pytest.raises(ValueError, match="unknown key"):
        parse(tokenizer, {"temprature": 0}, text_input=text("hello"))
    with pytest.raises(ValueError, match="disagree"):
        parse(tokenizer, {"stream": False}, text_input=text("hello"), stream=np.array([True]))
    with pytest.raises(ValueError, match="not valid JSON"):
        parse(tokenizer, "{", text_input=text("hello"))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                        "stop_token_ids", "ignore_eos", "min_tokens", "other"]), JSON_VALUES))
def test_any_json_is_accepted_valid_or_rejected_with_value_error(params):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    try:
        req = parse(tok, text_input=text("hello"), sampling_parameters=text(json.dumps(params)))
    except ValueError:
        return
    assert req.sampling.max_tokens >= 1 and isinstance(req.sampling.max_tokens, int)
    assert req.sampling == SamplingParams(**vars(req.sampling))  # what was built passes its own checks


# --- responses --------------------------------------------------------------------------------


def output(ids, new_text, finished=False, reason=None, num_cached_tokens=0):
    return SimpleNamespace(
        request_id="r", new_token_ids=ids, new_text=new_text, finished=finished, finish_reason=reason,
        num_input_tokens=2, num_output_tokens=0, error=None, logprobs=None, num_cached_tokens=num_cached_tokens,
    )


def decoded(arrays):
    return arrays["text_output"][0].decode(), arrays["output_ids"].tolist(), arrays["finish_reason"][0].decode()


def test_the_vllm_backends_finish_reason_and_cumulative_logprob_inputs(tokenizer):
    """return_finish_reason is taken (finish_reason is always sent); return_cumulative_logprob asks for the tokens'
    log-probabilities and sends their running total in every response, as the vLLM backend does."""
    req = parse(tokenizer, text_input=text("hello"), stream=np.array([True]), return_finish_reason=np.array([True]),
                return_cumulative_logprob=np.array([True]))
    assert req.sampling.logprobs == 0 and req.return_cumulative_logprob
    builder = ResponseBuilder(req)
    first = builder.on_output(with_logprobs(output([5, 6], "ab"), -0.5, -1.0))
    last = builder.on_output(with_logprobs(output([7], "c", finished=True, reason=FinishReason.LENGTH), -0.25))
    assert first["cumulative_logprob"].dtype == np.float32 and first["cumulative_logprob"].tolist() == [-1.5]
    assert last["cumulative_logprob"].tolist() == [-1.75] and last["finish_reason"].tolist() == [b"length"]
    assert "cumulative_logprob" not in ResponseBuilder(parse(tokenizer, text_input=text("hi"))).on_output(
        output([5], "a", finished=True, reason=FinishReason.LENGTH))


V4_CHAT = ChatTemplate(DEEPSEEK_V4_TEMPLATE.read_text(), BOS, EOS, deepseek_v4_format=True)  # DeepSeek-V4's own
D = "｜DSML｜"


@pytest.mark.parametrize("stream", [False, True])
def test_parse_chat_output_splits_the_answer_into_reasoning_content_and_tool_calls(tokenizer, stream):
    """With parse_chat_output a chat's answer also comes as DeepSeek-V4's parts (thinking mode: reasoning first),
    response by response when streaming; an answer that stopped after tool calls finishes with "tool_calls"."""
    req = parse_request({"messages": text('[{"role": "user", "content": "hello"}]'), "stream": np.array([stream]),
                         "chat_template_kwargs": text('{"thinking": true}'), "parse_chat_output": np.array([True])},
                        tokenizer, None, V4_CHAT)
    assert req.parse_chat_output and req.thinking
    deltas = ["Hm, ", "sun.</th", "ink>Let me ", "check.\n", f"\n<{D}tool_calls>\n<{D}invoke name=\"weather\">\n",
              f'<{D}parameter name="city" string="true">Oslo</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>']
    builder = ResponseBuilder(req, tokenizer)
    responses = [builder.on_output(output([5], delta)) for delta in deltas[:-1]]
    responses.append(builder.on_output(output([6], deltas[-1], finished=True, reason=FinishReason.STOP)))
    sent = [r for r in responses if r is not None]
    assert len(sent) == (len(deltas) if stream else 1)

    def joined(name):
        return "".join(r[name][0].decode() for r in sent)

    assert (joined("reasoning_content"), joined("content")) == ("Hm, sun.", "Let me check.")
    calls = [call for r in sent for call in json.loads(r["tool_calls"][0])]
    assert [c["function"] for c in calls] == [{"name": "weather", "arguments": '{"city": "Oslo"}'}]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert sent[-1]["finish_reason"].tolist() == [b"tool_calls"] and joined("text_output").endswith("".join(deltas))
    if stream:  # what may still be a marker's start waits for the next response
        assert [r["reasoning_content"][0].decode() for r in sent[:3]] == ["Hm, ", "sun.", ""]


def test_parse_chat_output_needs_deepseek_v4s_chat_format(tokenizer):
    chat = text('[{"role": "user", "content": "hello"}]')
    with pytest.raises(ValueError, match="give it with 'messages'"):
        parse(tokenizer, text_input=text("hello"), parse_chat_output=np.array([True]))
    other = ChatTemplate("{{ messages[0].content }}")
    with pytest.raises(ValueError, match="reads DeepSeek-V4's chat format.*another"):
        parse_request({"messages": chat, "parse_chat_output": np.array([True])}, tokenizer, None, other)
    chat_mode = parse_request({"messages": chat, "parse_chat_output": np.array([True])}, tokenizer, None, V4_CHAT)
    assert chat_mode.parse_chat_output and not chat_mode.thinking
    answer = ResponseBuilder(chat_mode, tokenizer).on_output(output([5], "Hi.", finished=True,
                                                                     reason=FinishReason.STOP))
    assert (answer["content"].tolist(), answer["reasoning_content"].tolist()) == ([b"Hi."], [b""])
    assert answer["tool_calls"].tolist() == [b"[]"] and answer["finish_reason"].tolist() == [b"stop"]
    assert "content" not in ResponseBuilder(parse_request({"messages": chat}, tokenizer, None, V4_CHAT)).on_output(
        output([5], "Hi.", finished=True, reason=FinishReason.STOP))


def with_logprobs(out, *values):
    """`out` with one TokenLogprobs a token."""
    return SimpleNamespace(**{**vars(out), "logprobs": [TokenLogprobs(v) for v in values]})


def test_response_arrays_types():
    arrays = response_arrays("héllo", [1, 2], FinishReason.LENGTH, 3)
    assert arrays["text_output"].dtype == np.object_ and arrays["text_output"].tolist() == ["héllo".encode()]
    assert arrays["output_ids"].dtype == np.int32 and arrays["output_ids"].tolist() == [1, 2]
    assert arrays["finish_reason"].tolist() == [b"length"]
    assert arrays["num_input_tokens"].dtype == np.uint32 and arrays["num_input_tokens"].tolist() == [3]
    assert arrays["num_output_tokens"].tolist() == [2]
    assert response_arrays("", [], None, 3)["finish_reason"].tolist() == [b""]
    assert response_arrays("", [], None, 3)["output_ids"].shape == (0,)


def test_every_output_has_the_data_type_the_model_config_declares(tokenizer):
    """A response with every output asked for: each array's dtype is the one config.pbtxt declares for that output
    (the token counts UINT32, as the vLLM backend's), and no output is left out of the config or never sent."""
    config = text_format.Parse((REPO / "model_repository/dsv4/config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    types = {o.name: model_config_pb2.DataType.Name(o.data_type).removeprefix("TYPE_") for o in config.output}
    declared = {name: triton_to_np_dtype("BYTES" if type_ == "STRING" else type_) for name, type_ in types.items()}
    req = parse_request({"messages": text('[{"role": "user", "content": "hello"}]'),
                         "top_logprobs": np.array([2], np.int32), "return_logprobs": np.array([True]),
                         "return_num_cached_tokens": np.array([True]), "return_cumulative_logprob": np.array([True]),
                         "parse_chat_output": np.array([True])}, tokenizer, None, V4_CHAT)
    out = output([5, 6], "ab", finished=True, reason=FinishReason.LENGTH, num_cached_tokens=16)
    out.logprobs = [TokenLogprobs(-0.5, 1, [(5, -0.5), (6, -1.0)]), TokenLogprobs(-1.0, 2, [(5, -0.7), (6, -1.0)])]
    arrays = ResponseBuilder(req, tokenizer).on_output(out)
    assert set(arrays) == set(declared)
    assert {name: array.dtype.type for name, array in arrays.items()} == declared


def test_token_count_outputs_follow_their_return_inputs(tokenizer):
    """num_input_tokens and num_output_tokens are sent unless switched off; num_cached_tokens only when asked for."""
    def sent(**flags):
        builder = ResponseBuilder(parse(tokenizer, text_input=text("hello"), **{
            k: np.array([v]) for k, v in flags.items()}))
        return builder.on_output(output([5], "a", finished=True, reason=FinishReason.LENGTH, num_cached_tokens=128))

    default = sent()
    assert default["num_input_tokens"].tolist() == [2] and default["num_output_tokens"].tolist() == [1]
    assert "num_cached_tokens" not in default
    cached = sent(return_num_cached_tokens=True)
    assert cached["num_cached_tokens"].dtype == np.uint32 and cached["num_cached_tokens"].tolist() == [128]
    assert set(sent(return_num_input_tokens=False, return_num_output_tokens=False)) & {
        "num_input_tokens", "num_output_tokens"} == set()


def test_streaming_holds_ids_until_their_text_is_complete(tokenizer):
    req = parse(tokenizer, text_input=text("hello"), stream=np.array([True]))
    builder = ResponseBuilder(req)
    assert decoded(builder.on_output(output([5], "a"))) == ("a", [5], "")
    assert builder.on_output(output([6], "")) is None  # half a UTF-8 character
    assert decoded(builder.on_output(output([7], "é"))) == ("é", [6, 7], "")
    assert decoded(builder.on_output(output([8], "b", True, FinishReason.STOP))) == ("b", [8], "stop")


def test_streaming_final_without_new_tokens_still_carries_the_reason(tokenizer):
    builder = ResponseBuilder(parse(tokenizer, text_input=text("hello"), stream=np.array([True])))
    builder.on_output(output([5], "a"))
    assert decoded(builder.on_output(output([], "", True, FinishReason.LENGTH))) == ("", [], "length")


def test_non_streaming_sends_one_response_with_the_prompt(tokenizer):
    builder = ResponseBuilder(parse(tokenizer, text_input=text("hello")))
    assert builder.on_output(output([5], " a")) is None
    assert builder.on_output(output([6], " b")) is None
    final = builder.on_output(output([7], " c", True, FinishReason.LENGTH))
    assert decoded(final) == ("hello a b c", [5, 6, 7], "length")


def test_non_streaming_input_ids_prompt_is_decoded_for_the_response(tokenizer):
    builder = ResponseBuilder(parse(tokenizer, input_ids=np.array([3, 4], np.int32)), tokenizer)
    assert decoded(builder.on_output(output([5], " brown", True, FinishReason.LENGTH)))[0] == "the quick brown"


def test_non_streaming_excluding_the_prompt(tokenizer):
    req = parse(tokenizer, text_input=text("hello"), exclude_input_in_output=np.array([True]))
    builder = ResponseBuilder(req)
    builder.on_output(output([5], "a"))
    assert decoded(builder.on_output(output([6], "b", True, FinishReason.STOP))) == ("ab", [5, 6], "stop")


def test_vllm_logprobs_json_is_strict_json_with_excluded_tokens_at_minus_9999():
    """A masked or cut token's log-probability is -inf: JSON cannot hold it, so it is written as vLLM writes it."""
    from backend.serving.triton_io import vllm_logprobs_json

    class Tokens:  # (token 3 is special: the output text skips it)
        def decode(self, ids, skip_special_tokens=True):
            return "".join("<eos>" if i == 3 else chr(97 + i) for i in ids if not (skip_special_tokens and i == 3))

    logprobs = [TokenLogprobs(-0.25, 1, [(0, -0.25), (3, float("-inf"))])]
    raw = vllm_logprobs_json([0], logprobs, Tokens())[0].decode()

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    (entry,) = json.loads(raw, parse_constant=refuse)
    assert entry == {"0": {"logprob": -0.25, "rank": 1, "decoded_token": "a"},
                     "3": {"logprob": -9999.0, "rank": 2, "decoded_token": "<eos>"}}  # (vLLM's: the token's text)
    nan = vllm_logprobs_json([0], [TokenLogprobs(float("nan"), 1, [(0, float("nan"))])], Tokens())[0].decode()
    assert json.loads(nan, parse_constant=refuse) == [{"0": {"logprob": -9999.0, "rank": 1, "decoded_token": "a"}}]
