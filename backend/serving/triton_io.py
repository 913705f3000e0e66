"""Request parsing and response building for the Triton adapter (model_repository/dsv4/1/model.py).

Nothing here imports tritonserver: a request is a dict of numpy arrays (input name -> array, as
`pb_utils.get_input_tensor_by_name(...).as_numpy()` gives them) plus the request's JSON parameters,
and a response is a dict of numpy arrays. A malformed request raises `ValueError` with a message
meant for the client. This module checks the form of the tensors (dtypes, shapes, UTF-8, JSON);
the values are checked once, by `SamplingParams` and by the engine's admission gate
(`LLMEngine.submit`: vocabulary, limits, capacity).

The interface follows Triton's vLLM backend so genai-perf and perf_analyzer work unchanged:
- exactly one of `text_input` (STRING [1]) and `input_ids` (INT32 [-1]);
- `sampling_parameters` (STRING [1]): a JSON object; when absent, the request's own parameters
  (`request.parameters()`, e.g. the `parameters` object of an HTTP generate call) are used instead;
- `max_tokens` and `timeout_ms` (INT32 [1]) may also come as inputs (TRT-LLM style), agreeing with
  sampling_parameters where both are given; `priority` (INT32 [1]) orders the waiting queue;
- `stream` (BOOL [1]) and `exclude_input_in_output` (BOOL [1]); when not streaming the prompt text
  is prepended to `text_output` unless `exclude_input_in_output` is true; streaming never repeats it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from backend.chat import chat_prompt_ids, checked_tools
from backend.chat_output import THINK_START, AnswerParser
from backend.errors import load_json
from backend.request import FinishReason, SamplingParams, without_unset_nulls
from backend.tool_choice import ToolChoice, parse_tool_choice

INPUT_NAMES = (
    "text_input",
    "input_ids",
    "messages",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_tokens",
    "stream",
    "sampling_parameters",
    "exclude_input_in_output",
    "priority",
    "timeout_ms",
    "return_logprobs",
    "top_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_num_cached_tokens",
    "return_finish_reason",
    "return_cumulative_logprob",
    "parse_chat_output",
)

# INT32 [1] inputs that are also sampling_parameters keys (TRT-LLM style): input name -> key; both given, they
# must agree. `top_logprobs` is the `logprobs` key (vLLM's meaning: how many top log-probabilities per token).
_SAMPLING_INPUTS = {"max_tokens": "max_tokens", "timeout_ms": "timeout_ms", "top_logprobs": "logprobs"}

# Request-level parameters that are not sampling parameters: `stream` (as in the vLLM backend's
# HTTP example) and Triton's own `triton_*` keys (e.g. triton_enable_empty_final_response).
_REQUEST_ONLY_KEYS = frozenset({"stream"})


class ParsedRequest(NamedTuple):
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    priority: int
    prompt_text: str | None  # the text prompt; None for input_ids (decoded when prepended)
    return_logprobs: bool = False  # the vLLM backend's `logprobs` JSON output (Triton's OpenAI frontend reads it)
    return_num_input_tokens: bool = True  # False only when the client sends the input false
    return_num_output_tokens: bool = True
    return_num_cached_tokens: bool = False  # opt-in, like the vLLM backend's additional outputs
    return_cumulative_logprob: bool = False  # the vLLM backend's: the generated tokens' log-probabilities summed
    parse_chat_output: bool = False  # the answer split into reasoning_content, content, tool_calls (DeepSeek-V4's)
    thinking: bool = False  # the prompt asks the model to reason first (it ends with <think>)
    parse_tool_calls: bool = True  # parse_chat_output reads tool calls (not with tool_choice "none")
    first_tool_call_only: bool = False  # parallel_tool_calls false: parse_chat_output gives the first call only


def parse_request(
    inputs: Mapping[str, np.ndarray],
    tokenizer,
    request_parameters: str | Mapping[str, Any] | None = None,
    chat_template=None,
) -> ParsedRequest:
    """Validate one request's tensors; raise ValueError with a client-facing message. `chat_template`
    (backend/chat.py) turns a `messages` input into the prompt; None: `messages` is refused."""
    unknown = sorted(set(inputs) - set(INPUT_NAMES))
    if unknown:
        raise ValueError(f"unknown input(s) {unknown}; expected some of {list(INPUT_NAMES)}")
    prompt_ids, prompt_text, tool_choice = _parse_prompt(inputs, tokenizer, chat_template)

    request_params = _load_request_parameters(request_parameters)
    stream = _optional_bool(inputs, "stream")
    if "stream" in request_params:
        param_stream = request_params["stream"]
        if not isinstance(param_stream, bool):
            raise ValueError(f"parameter 'stream' must be a boolean, got {param_stream!r}")
        if stream is not None and stream != param_stream:
            raise ValueError("the 'stream' input and the 'stream' parameter disagree")
        stream = param_stream
    stream = bool(stream)

    exclude = _optional_bool(inputs, "exclude_input_in_output")
    if stream and exclude is False:
        raise ValueError("exclude_input_in_output=false is not supported when streaming")
    exclude = stream if exclude is None else exclude

    sampling = _parse_sampling(inputs, request_params)
    if tool_choice is not None and tool_choice.constrains:
        sampling = _with_tool_calls(sampling, tool_choice, chat_template, prompt_text)
    priority = _optional_int(inputs, "priority")
    parse_chat_output = bool(_optional_bool(inputs, "parse_chat_output"))
    if parse_chat_output and "messages" not in inputs:
        raise ValueError("'parse_chat_output' splits a chat's answer: give it with 'messages'")
    if parse_chat_output and not chat_template.deepseek_v4_format:
        raise ValueError("'parse_chat_output' reads DeepSeek-V4's chat format, and this model's chat template is "
                         "another (the chat_template parameter's or the checkpoint's)")
    return ParsedRequest(
        prompt_ids=prompt_ids,
        sampling=sampling,
        stream=stream,
        exclude_input_in_output=exclude,
        priority=0 if priority is None else priority,
        prompt_text=prompt_text,
        return_logprobs=bool(_optional_bool(inputs, "return_logprobs")),
        return_num_input_tokens=_optional_bool(inputs, "return_num_input_tokens") is not False,
        return_num_output_tokens=_optional_bool(inputs, "return_num_output_tokens") is not False,
        return_num_cached_tokens=bool(_optional_bool(inputs, "return_num_cached_tokens")),
        return_cumulative_logprob=bool(_optional_bool(inputs, "return_cumulative_logprob")),
        parse_chat_output=parse_chat_output,
        thinking=parse_chat_output and prompt_text.endswith(THINK_START),
        parse_tool_calls=tool_choice is None or tool_choice.parses_calls,
        first_tool_call_only=tool_choice is not None and not tool_choice.parallel,
    )


def _with_tool_calls(sampling: SamplingParams, tool_choice: ToolChoice, chat_template,
                     prompt_text: str) -> SamplingParams:
    """The request's sampling, its answer constrained to the tool calls its tool_choice asks for."""
    if sampling.guided_decoding is not None:
        raise ValueError("tool_choice constrains the answer to tool calls: send no other output constraint with it")
    return dataclasses.replace(sampling,
                               guided_decoding=tool_choice.constraint(prompt_text, chat_template.deepseek_v4_format))


# ---------------------------------------------------------------------------------------------
# The prompt.


# What `messages` takes beside it: STRING [1] inputs holding JSON (tool_choice: or a bare word), and a BOOL [1].
_CHAT_INPUTS = ("chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls")


def _chat_prompt(inputs: Mapping[str, np.ndarray], tokenizer, chat_template) -> tuple[list[int], str, ToolChoice]:
    """A `messages` input (STRING [1], a JSON list of {role, content}) rendered by the chat format (backend/chat.py),
    with the `chat_template_kwargs` input's options (a JSON object) and the `tools` input's tools (a JSON list of
    OpenAI tools) if given, as the `tool_choice` input has them shown (backend/tool_choice.py); and that
    tool_choice."""
    if chat_template is None:
        raise ValueError("'messages' needs a chat template, and this model has none; send text_input instead")
    messages = load_json(_single_string(inputs["messages"], "messages"), "messages")
    options, tools = (load_json(_single_string(inputs[name], name), name) if name in inputs else None
                      for name in ("chat_template_kwargs", "tools"))
    choice = ToolChoice.of(parse_tool_choice(_single_string(inputs["tool_choice"], "tool_choice"))
                           if "tool_choice" in inputs else None, checked_tools(tools),
                           parallel=_optional_bool(inputs, "parallel_tool_calls") is not False)
    text = chat_template.render(messages, options, choice.shown_tools)
    return chat_prompt_ids(tokenizer, text), text, choice


def _parse_prompt(inputs: Mapping[str, np.ndarray], tokenizer,
                  chat_template=None) -> tuple[list[int], str | None, ToolChoice | None]:
    given = [name for name in ("text_input", "input_ids", "messages") if name in inputs]
    if len(given) != 1:
        raise ValueError("give exactly one of 'text_input', 'input_ids' and 'messages'"
                         + (f" (got {', '.join(given)})" if given else ""))
    for name in _CHAT_INPUTS:
        if name in inputs and given[0] != "messages":
            raise ValueError(f"{name!r} is an option of 'messages' (the chat template's); it was given with "
                             f"{given[0]!r}")
    if given[0] == "messages":
        return _chat_prompt(inputs, tokenizer, chat_template)
    has_text = given[0] == "text_input"
    if has_text:
        text = _single_string(inputs["text_input"], "text_input")
        if not text:
            raise ValueError("text_input is empty")
        ids = _text_prompt_ids(tokenizer, text)
        if not ids:
            raise ValueError("text_input tokenizes to no tokens")
    else:
        ids, text = _token_ids(inputs["input_ids"]), None
    return ids, text, None


def _text_prompt_ids(tokenizer, text: str) -> list[int]:
    """`text_input` tokenized as vLLM tokenizes a completion's prompt: with the tokenizer's special tokens (a BOS where
    it adds one). A text that already starts with that token (a chat rendered by its template, which is what Triton's
    OpenAI frontend sends) keeps only its own: the model was never trained on two."""
    ids = list(tokenizer.encode(text).ids)
    if len(ids) >= 2 and ids[0] == ids[1]:
        plain = list(tokenizer.encode(text, add_special_tokens=False).ids)
        if ids[1:] == plain:  # (the first was the tokenizer's, the second the text's own)
            return plain
    return ids


def _single_string(array: np.ndarray, name: str) -> str:
    array = np.asarray(array)
    if array.dtype.kind not in ("O", "S", "U"):
        raise ValueError(f"{name} must be a STRING (BYTES) tensor, got dtype {array.dtype}")
    if array.size != 1:
        raise ValueError(f"{name} must hold exactly one string, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, np.bytes_)):
        raise ValueError(f"{name} must hold bytes, got {type(value).__name__}")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _token_ids(array: np.ndarray) -> list[int]:
    array = np.asarray(array)
    if array.dtype.kind not in ("i", "u"):
        raise ValueError(f"input_ids must be an INT32 tensor, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"input_ids must be one-dimensional, got shape {list(array.shape)}")
    return [int(t) for t in array]


# ---------------------------------------------------------------------------------------------
# Scalars.


def _scalar(inputs: Mapping[str, np.ndarray], name: str, kinds: str, type_name: str):
    if name not in inputs:
        return None
    array = np.asarray(inputs[name])
    if array.dtype.kind not in kinds:
        raise ValueError(f"{name} must be a {type_name} tensor, got dtype {array.dtype}")
    if array.size != 1:
        raise ValueError(f"{name} must hold exactly one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0].item()


def _optional_bool(inputs: Mapping[str, np.ndarray], name: str) -> bool | None:
    return _scalar(inputs, name, "b", "BOOL")


def _optional_int(inputs: Mapping[str, np.ndarray], name: str) -> int | None:
    return _scalar(inputs, name, "iu", "INT32")


# ---------------------------------------------------------------------------------------------
# Sampling parameters.


def _load_request_parameters(raw: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        params = dict(raw)
    else:
        params = load_json(raw, "request parameters")
        if not isinstance(params, dict):
            raise ValueError("request parameters must be a JSON object")
    return {k: v for k, v in params.items() if not k.startswith("triton_")}


def _parse_sampling(inputs: Mapping[str, np.ndarray], request_params: dict[str, Any]) -> SamplingParams:
    """sampling_parameters (or the request's own parameters), plus the max_tokens input."""
    if "sampling_parameters" in inputs:
        raw = _single_string(inputs["sampling_parameters"], "sampling_parameters")
        params = load_json(raw, "sampling_parameters") if raw.strip() else {}
        if not isinstance(params, dict):
            raise ValueError("sampling_parameters must be a JSON object")
        where = "sampling_parameters"
    else:
        params = {k: v for k, v in request_params.items() if k not in _REQUEST_ONLY_KEYS}
        where = "request parameters"
    params = without_unset_nulls(params)  # (so that a null leaves the input of the same value standing)
    given = {key: (name, value) for name, key in _SAMPLING_INPUTS.items()
             if (value := _optional_int(inputs, name)) is not None}
    sampling = SamplingParams.from_dict({**{k: v for k, (_, v) in given.items()}, **params}, where)
    for key, (name, value) in given.items():
        if getattr(sampling, key) != value:
            raise ValueError(f"the {name} input ({value}) and {key} in {where} ({getattr(sampling, key)}) disagree")
    wants_logprobs = _optional_bool(inputs, "return_logprobs") or _optional_bool(inputs, "return_cumulative_logprob")
    if wants_logprobs and sampling.logprobs is None:
        sampling = dataclasses.replace(sampling, logprobs=0)  # the generated tokens' own log-probabilities
    return sampling


# ---------------------------------------------------------------------------------------------
# Responses.


def response_arrays(
    text: str, token_ids: list[int], finish_reason: FinishReason | None, num_input_tokens: int
) -> dict[str, np.ndarray]:
    """The output tensors of one response (names as in config.pbtxt)."""
    reason = "" if finish_reason is None else FinishReason(finish_reason).value
    return {
        "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": np.asarray(token_ids, dtype=np.int32).reshape(-1),
        "finish_reason": np.array([reason.encode("utf-8")], dtype=np.object_),
        "num_input_tokens": np.array([num_input_tokens], dtype=np.uint32),
        "num_output_tokens": np.array([len(token_ids)], dtype=np.uint32),
    }


# JSON has no -Infinity (and Triton's HTTP endpoints write tensors as JSON): a token the distribution excludes (cut by
# top-k / top-p / min-p, or not allowed by an output constraint) is reported as vLLM's OpenAI server reports it.
MIN_REPORTED_LOGPROB = -9999.0


def _reported_logprob(value: float) -> float:
    return value if value >= MIN_REPORTED_LOGPROB else MIN_REPORTED_LOGPROB  # (NaN too: JSON has no NaN)


def logprob_arrays(logprobs: list, top_logprobs: int) -> dict[str, np.ndarray]:
    """output_logprobs FP32 [n] (one per token id), and with top_logprobs = k > 0 output_top_logprob_ids INT32 [n, k]
    and output_top_logprobs FP32 [n, k] (best first); `logprobs` holds a TokenLogprobs per token."""
    arrays = {"output_logprobs": np.array([_reported_logprob(lp.logprob) for lp in logprobs], dtype=np.float32)}
    if top_logprobs:
        arrays["output_top_logprob_ids"] = np.array([[t for t, _ in lp.top] for lp in logprobs],
                                                    dtype=np.int32).reshape(-1, top_logprobs)
        arrays["output_top_logprobs"] = np.array([[_reported_logprob(v) for _, v in lp.top] for lp in logprobs],
                                                 dtype=np.float32).reshape(-1, top_logprobs)
    return arrays


def vllm_logprobs_json(token_ids: list[int], logprobs: list, tokenizer) -> np.ndarray:
    """The vLLM backend's `logprobs` output (what Triton's OpenAI frontend parses): one JSON string, a list with,
    per generated token, {token id: {"logprob", "rank", "decoded_token"}} for the token itself and the top ones
    (rank 1 = most likely). A special token's decoded_token is its text (vLLM's, where the output text skips it)."""
    def decoded(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False)

    entries = []
    for token, lp in zip(token_ids, logprobs):
        entry = {str(t): {"logprob": _reported_logprob(v), "rank": rank, "decoded_token": decoded(t)}
                 for rank, (t, v) in enumerate(lp.top, start=1)}
        entry[str(token)] = {"logprob": _reported_logprob(lp.logprob), "rank": lp.rank,
                             "decoded_token": decoded(token)}
        entries.append(entry)
    return np.array([json.dumps(entries).encode("utf-8")], dtype=np.object_)


@dataclass
class ResponseBuilder:
    """Turns a request's stream of engine `RequestOutput`s into the responses to send.

    Streaming: one response per non-empty text delta; token ids whose text is still incomplete
    (a split UTF-8 character) wait for the next delta, so the ids of all responses concatenate to
    the generated ids. Not streaming: one response with the whole text (prompt first unless
    `exclude_input_in_output`). The response that carries `finished` also carries `finish_reason`.
    An `input_ids` prompt is decoded with `tokenizer` only when its text is prepended (by then the
    engine has accepted its ids). With `parse_chat_output`, each response also carries its part of the answer
    (backend/chat_output.py: reasoning_content, content, tool_calls), of the generated text only.
    """

    request: ParsedRequest
    tokenizer: Any = None
    _answer: AnswerParser | None = None  # with parse_chat_output
    _pending_ids: list[int] = field(default_factory=list)
    _pending_text: list[str] = field(default_factory=list)
    _pending_logprobs: list = field(default_factory=list)
    _cumulative_logprob: float = 0.0  # of every token sent so far (return_cumulative_logprob)

    def __post_init__(self):
        if self.request.parse_chat_output:
            self._answer = AnswerParser(self.request.thinking, tool_calls=self.request.parse_tool_calls,
                                        first_call_only=self.request.first_tool_call_only)

    def on_output(self, output) -> dict[str, np.ndarray] | None:
        """Arrays of the response to send for `output`, or None when nothing is to be sent yet."""
        self._pending_ids.extend(output.new_token_ids)
        self._pending_text.append(output.new_text)
        self._pending_logprobs.extend(output.logprobs or [])
        if not output.finished and (not self.request.stream or not output.new_text):
            return None
        text = "".join(self._pending_text)
        answer = self._answer_arrays(text, output) if self._answer is not None else {}
        if not self.request.stream and not self.request.exclude_input_in_output:
            text = self._prompt_text() + text
        request = self.request
        arrays = response_arrays(
            text, self._pending_ids, output.finish_reason if output.finished else None, output.num_input_tokens
        )
        arrays.update(answer)
        if not request.return_num_input_tokens:
            del arrays["num_input_tokens"]
        if not request.return_num_output_tokens:
            del arrays["num_output_tokens"]
        if request.return_num_cached_tokens:  # the prompt positions the prefix cache served (OpenAI's cached_tokens)
            arrays["num_cached_tokens"] = np.array([output.num_cached_tokens], dtype=np.uint32)
        if request.sampling.logprobs is not None:
            arrays.update(logprob_arrays(self._pending_logprobs, request.sampling.logprobs))
        if request.return_logprobs:
            arrays["logprobs"] = vllm_logprobs_json(self._pending_ids, self._pending_logprobs, self.tokenizer)
        if request.return_cumulative_logprob:  # (as the vLLM backend: the total so far, in every response)
            self._cumulative_logprob += sum(lp.logprob for lp in self._pending_logprobs)
            arrays["cumulative_logprob"] = np.array([self._cumulative_logprob], dtype=np.float32)
        self._pending_ids, self._pending_text, self._pending_logprobs = [], [], []
        return arrays

    def _answer_arrays(self, text: str, output) -> dict[str, np.ndarray]:
        """reasoning_content, content and tool_calls (a JSON list of OpenAI tool calls) of this response's text; at
        the end of an answer that made tool calls and stopped, finish_reason "tool_calls", as OpenAI's API says."""
        part = self._answer.feed(text)
        if output.finished:
            rest = self._answer.finish()
            part.reasoning, part.content = part.reasoning + rest.reasoning, part.content + rest.content
            part.tool_calls += rest.tool_calls
        values = {"reasoning_content": part.reasoning, "content": part.content,
                  "tool_calls": json.dumps(part.tool_calls, ensure_ascii=False)}
        if output.finished and self._answer.called and output.finish_reason == FinishReason.STOP:
            values["finish_reason"] = "tool_calls"
        return {name: np.array([value.encode("utf-8")], dtype=np.object_) for name, value in values.items()}

    def _prompt_text(self) -> str:
        if self.request.prompt_text is not None:
            return self.request.prompt_text
        return self.tokenizer.decode(self.request.prompt_ids, skip_special_tokens=False)


def to_numpy_inputs(names: list[str], get_tensor: Callable[[str], Any]) -> dict[str, np.ndarray]:
    """Collect the present inputs: `get_tensor(name)` returns an object with `.as_numpy()`, or None."""
    arrays = {}
    for name in names:
        tensor = get_tensor(name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy()
    return arrays
