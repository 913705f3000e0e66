"""tool_choice (backend/tool_choice.py): what it accepts, what the prompt shows, and the constraint of "required" and
of a named function, checked against the chat template's own rendering of tool calls and run on the built-in
checkpoint, whose random weights call a tool only where the constraint makes them."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr

from tokenizers import Tokenizer

from backend.chat import ChatTemplate, chat_format, checked_tools
from backend.chat_output import THINK_END, THINK_START, AnswerParser
from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.serving.triton_io import parse_request
from backend.structured.grammar import structural_tag_grammar
from backend.tool_choice import ToolChoice, parse_tool_choice

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "enum": ["Oslo", "Bergen"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                                "metric": {"type": "boolean"},
                                                "hours": {"type": "array", "items": {"type": "integer"}},
                                                "where": {"type": "object", "properties": {"lat": {"type": "number"}}}},
                                                "required": ["city", "metric"]}}}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, NOOP]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def chat(tiny_checkpoint) -> ChatTemplate:
    return chat_format(tiny_checkpoint)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu"))
    yield engine
    engine.shutdown()


def _call(name: str, arguments: dict, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _template_answer(chat, calls: list[dict], thinking: bool, reasoning: str = "", content: str = "") -> str:
    """What the chat template renders for an assistant's answer with these calls, after the generation prompt (up to
    its end-of-sentence token): what the model is to write."""
    options = {"thinking": thinking}
    prompt = chat.render(QUESTION, options, TOOLS)
    turn = {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": calls}
    full = chat.render(QUESTION + [turn, {"role": "user", "content": "Thanks."}], options, TOOLS)
    opener = "<think>" if thinking else "</think>"
    assert prompt.endswith(opener) and full.startswith(prompt[:-len(opener)])
    start = len(prompt) if full.startswith(prompt) else len(prompt) - len(opener)  # (an earlier answer: </think>)
    return full[start:full.index(chat.eos_token, start)]


def _constraint(choice, thinking: bool, tools: list[dict] = TOOLS):
    """The constraint of `choice` on an answer to a prompt in thinking or chat mode."""
    prompt = "<｜User｜>Hi<｜Assistant｜>" + (THINK_START if thinking else THINK_END)
    return ToolChoice.of(choice, checked_tools(tools)).constraint(prompt, deepseek_v4_format=True)


def _accepts(guided, text: str) -> bool:
    """Whether the constraint's grammar takes exactly `text` and may end there (as text: no vocabulary needed)."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(structural_tag_grammar(guided.spec)))
    return matcher.accept_string(text) and matcher.is_completed()


# ---------------------------------------------------------------------------------------------
# What it accepts.

@pytest.mark.parametrize("text,expected", [("auto", "auto"), (" none ", "none"), ('"required"', "required"),
                                           (json.dumps(NAMED), NAMED)])
def test_tool_choice_is_a_bare_word_or_json(text, expected):
    assert parse_tool_choice(text) == expected


def test_a_function_is_named_as_chat_completions_or_the_responses_api_name_it():
    responses_form = {"type": "function", "name": "get_weather"}
    assert ToolChoice.of(NAMED, TOOLS).choice == ToolChoice.of(responses_form, TOOLS).choice == NAMED


@pytest.mark.parametrize("choice,tools,message", [
    ("sometimes", TOOLS, 'tool_choice must be "auto", "none", "required"'),
    ("required", None, 'tool_choice "required" needs tools'),
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, "'nope', which is not among the tools ('get_weather', "
                                                                 "'noop')"),
    ({"type": "function"}, TOOLS, "tool_choice must be"),
    ({"type": "function", "function": {"name": "noop"}}, TOOLS + [NOOP],
     "tools\\[2\\] repeats the function name 'noop' of tools\\[1\\]"),
    ({"type": "allowed_tools", "function": {"name": "noop"}}, TOOLS, "tool_choice must be"),
    (["required"], TOOLS, "tool_choice must be"),
])
def test_a_bad_tool_choice_is_refused_naming_it(choice, tools, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ToolChoice.of(choice, checked_tools(tools))


def test_an_unreadable_tool_choice_is_refused_with_the_forms_it_takes():
    with pytest.raises(ValueError, match=r'tool_choice must be .* \(as JSON, or one of the words bare\), got'):
        parse_tool_choice("{required")


def test_none_leaves_the_tools_out_of_the_prompt_and_auto_keeps_them(chat):
    history = QUESTION + [{"role": "assistant", "content": "", "tool_calls": [_call("noop", {}, "c1")]},
                          {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    without = chat.render(history, {}, ToolChoice.of("none", TOOLS).shown_tools)
    with_tools = chat.render(history, {}, ToolChoice.of("auto", TOOLS).shown_tools)
    assert "## Tools" not in without and "get_weather" not in without
    assert "## Tools" in with_tools and "get_weather" in with_tools
    assert '<｜DSML｜invoke name="noop">' in without and "<tool_result>done</tool_result>" in without
    assert _constraint("none", False) is None and _constraint("auto", True) is None


def test_under_none_a_tool_call_block_the_model_writes_anyway_is_content(chat):
    """As vLLM, which runs no tool parser then: nothing the model wrote is taken for a call."""
    answer = _template_answer(chat, CALLS[1:], False)
    parser = AnswerParser(thinking=False, tool_calls=False)
    parts = [parser.feed(answer[:7]), parser.feed(answer[7:]), parser.finish()]
    assert "".join(part.content for part in parts) == answer and not any(part.tool_calls for part in parts)


def test_a_prompt_that_does_not_end_where_an_answer_starts_is_refused():
    with pytest.raises(ValueError, match="does not end where one starts"):
        ToolChoice.of("required", TOOLS).constraint("<｜User｜>Hi<｜Assistant｜>Sure<｜end▁of▁sentence｜>", True)


@pytest.mark.parametrize("parameters,message", [
    ({"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}},
     r"the parameters of tool 'f': .*\['not'\] cannot be enforced"),
    ({"type": "string"}, "the parameters of tool 'f' must be a JSON schema of an object .*got type 'string'"),
    ([1], "the parameters of tool 'f' must be a JSON schema of an object .*got \\[1\\]"),
    ('{"type": "object"}', "the parameters of tool 'f' must be a JSON schema of an object"),
    (True, "the parameters of tool 'f' must be a JSON schema of an object .*got true"),
])
def test_a_function_schema_the_constraint_cannot_hold_is_refused(parameters, message):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(ValueError, match=message):
        _constraint("required", False, tools)


def test_a_function_without_parameters_takes_none_and_strict_false_is_still_enforced(chat):
    lax = {"type": "function", "function": {**WEATHER["function"], "strict": False}}
    bare = [{"type": "function", "function": {"name": "noop"}}, {"type": "function",
                                                                  "function": {"name": "noop2", "parameters": None}}]
    guided = _constraint("required", False, [lax, *bare])
    assert _accepts(guided, _template_answer(chat, [_call("noop", {}, "a"), _call("noop2", {}, "b")], False))
    assert not _accepts(guided, _template_answer(chat, [_call("noop", {"x": 1}, "a")], False))  # an argument
    assert not _accepts(guided, _template_answer(chat, [_call("get_weather", {"city": "Rome", "metric": True}, "a")],
                                                 False))  # strict=false: the schema still holds


# ---------------------------------------------------------------------------------------------
# The constraint against the template's own rendering of tool calls.

CALLS = [_call("get_weather", {"city": "Oslo", "days": 3, "metric": True, "hours": [6, 12],
                               "where": {"lat": 59.9}}, "c1"),
         _call("noop", {}, "c2")]


@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
def test_required_takes_the_calls_as_the_template_renders_them(chat, thinking):
    guided = _constraint("required", thinking)
    answer = _template_answer(chat, CALLS, thinking, reasoning="Oslo: look it up." if thinking else "")
    assert _accepts(guided, answer), answer
    assert _accepts(guided, _template_answer(chat, CALLS[1:], thinking))  # one call is enough
    parser = AnswerParser(thinking)  # (and parse_chat_output reads them back)
    calls = [call for part in (parser.feed(answer), parser.finish()) for call in part.tool_calls]
    assert [call["function"]["name"] for call in calls] == ["get_weather", "noop"]


@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
def test_a_named_function_takes_one_call_of_it(chat, thinking):
    guided = _constraint(NAMED, thinking)
    assert _accepts(guided, _template_answer(chat, CALLS[:1], thinking))
    assert not _accepts(guided, _template_answer(chat, CALLS[1:], thinking))  # another function
    assert not _accepts(guided, _template_answer(chat, CALLS, thinking))  # two calls


def test_parallel_tool_calls_false_makes_one_call_and_reads_only_the_first(chat):
    """OpenAI's parallel_tool_calls: false. "required" takes one call, not two; where the answer holds more (auto),
    parse_chat_output gives the first, as vLLM does."""
    guided = ToolChoice.of("required", TOOLS, parallel=False).constraint("<｜Assistant｜>" + THINK_END, True)
    assert _accepts(guided, _template_answer(chat, CALLS[:1], False))
    assert not _accepts(guided, _template_answer(chat, CALLS, False))
    parser = AnswerParser(thinking=False, first_call_only=True)
    answer = _template_answer(chat, CALLS, False)
    calls = [call for part in (parser.feed(answer), parser.feed(answer), parser.finish()) for call in part.tool_calls]
    assert [call["function"]["name"] for call in calls] == ["get_weather"]


def test_the_calls_come_at_once_and_follow_the_schema(chat):
    guided = _constraint("required", False)
    assert not _accepts(guided, _template_answer(chat, [], False, content="Sunny."))  # no call
    assert not _accepts(guided, _template_answer(chat, CALLS, False, content="Let me look."))  # text before them
    assert not _accepts(guided, _template_answer(chat, [_call("get_weather", {"city": "Rome", "metric": True}, "c")],
                                                 False))  # not in the enum
    assert not _accepts(guided, _template_answer(chat, [_call("get_weather", {"city": "Oslo"}, "c")], False))
    assert not _accepts(guided, _template_answer(chat, [_call("get_weather", {"city": "Oslo", "metric": "yes"}, "c")],
                                                 False))  # not a boolean


# ---------------------------------------------------------------------------------------------
# As a request.

def _text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def _request(chat, tokenizer, choice: str, **extra):
    inputs = {"messages": _text(json.dumps(QUESTION)), "tools": _text(json.dumps(TOOLS)),
              "tool_choice": _text(choice), **{k: _text(v) for k, v in extra.items()}}
    return parse_request(inputs, tokenizer, None, chat)


def test_a_request_with_tool_choice_carries_its_constraint(chat, tokenizer):
    required = _request(chat, tokenizer, "required")
    assert required.sampling.guided_decoding == _constraint("required", False) and required.parse_tool_calls
    thinking = _request(chat, tokenizer, json.dumps(NAMED), chat_template_kwargs='{"thinking": true}')
    assert thinking.sampling.guided_decoding == _constraint(NAMED, True)
    assert _request(chat, tokenizer, "auto").sampling.guided_decoding is None
    none = _request(chat, tokenizer, "none")
    assert none.sampling.guided_decoding is None and not none.parse_tool_calls
    assert not required.first_tool_call_only
    single = parse_request({"messages": _text(json.dumps(QUESTION)), "tools": _text(json.dumps(TOOLS)),
                            "tool_choice": _text("required"), "parallel_tool_calls": np.array([False])},
                           tokenizer, None, chat)
    assert single.first_tool_call_only
    assert single.sampling.guided_decoding == ToolChoice.of("required", TOOLS, parallel=False).constraint(
        "<｜Assistant｜>" + THINK_END, True) != required.sampling.guided_decoding


def test_tool_choice_is_refused_beside_another_constraint_or_another_chat_format(chat, tokenizer):
    with pytest.raises(ValueError, match="send no other output constraint with it"):
        _request(chat, tokenizer, "required", sampling_parameters='{"guided_decoding": {"regex": "a+"}}')
    other = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="DeepSeek-V4's tool-call syntax, and this model's chat template is another"):
        _request(other, tokenizer, "required")
    assert _request(other, tokenizer, "none").sampling.guided_decoding is None
    for name, value in (("tool_choice", _text("auto")), ("parallel_tool_calls", np.array([False]))):
        with pytest.raises(ValueError, match=f"'{name}' is an option of 'messages'"):
            parse_request({"text_input": _text("Hi"), name: value}, tokenizer, None, chat)


@pytest.mark.parametrize("choice,temperature", [("required", 0.0), (json.dumps(NAMED), 1.0)], ids=["required", "named"])
def test_the_random_checkpoint_calls_a_tool_when_it_must(chat, engine, choice, temperature):
    """Random weights, in chat mode: the answer is a tool call whose arguments follow its function's schema, and the
    request ends as an answer that called tools does."""
    request = _request(chat, engine.tokenizer, choice,
                       sampling_parameters=json.dumps({"max_tokens": 1000, "temperature": temperature, "seed": 2}))
    [result] = engine.generate([request.prompt_ids], request.sampling)
    assert result["finish_reason"] == "stop", result["text"][-300:]
    parser = AnswerParser(thinking=False)
    parts = [parser.feed(result["text"]), parser.finish()]
    calls = [call for part in parts for call in part.tool_calls]
    assert calls and "".join(part.content for part in parts) == ""
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    if choice != "required":
        assert [call["function"]["name"] for call in calls] == ["get_weather"]


@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
def test_tool_calls_drafted_by_the_mtp_layer_are_the_same(chat, engine, tiny_checkpoint, thinking):
    """With two drafts a step, the constrained answer's tokens are those of decoding without drafts: the drafts are
    drawn under the structural tag's masks and its matcher rolled back past the rejected ones (in thinking mode
    through the free reasoning too, which the random weights never end)."""
    request = _request(chat, engine.tokenizer, "required", chat_template_kwargs=json.dumps({"thinking": thinking}),
                       sampling_parameters=json.dumps({"max_tokens": 120 if thinking else 400, "temperature": 0}))
    drafting = LLMEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", num_speculative_tokens=2))
    try:
        [with_drafts] = drafting.generate([request.prompt_ids], request.sampling)
        stats = drafting.stats()
    finally:
        drafting.shutdown()
    [without] = engine.generate([request.prompt_ids], request.sampling)
    assert with_drafts["finish_reason"] == ("length" if thinking else "stop")
    assert with_drafts["output_ids"] == without["output_ids"]
    assert stats["num_draft_tokens"] > 0 and 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
