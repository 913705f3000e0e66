"""Chat prompts: a chat template, or DeepSeek-V4's own format, renders `messages`; malformed messages and options get
clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from backend.chat import DEEPSEEK_V4_TEMPLATE, ChatTemplate, chat_format
from backend.chat_output import AnswerParser
from backend.serving import triton_io

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"
# DeepSeek's encoding_dsv4.py's texts: its maximum reasoning effort's instruction, and its tools section.
MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{D}tool_calls>" block like the following:

<{D}tool_calls>
<{D}invoke name="$TOOL_NAME">
<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>
...
</{D}invoke>
<{D}invoke name="$TOOL_NAME2">
...
</{D}invoke>
</{D}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501


@pytest.fixture(scope="module")
def template(tiny_checkpoint) -> ChatTemplate:
    found = chat_format(tiny_checkpoint)
    assert found.source == DEEPSEEK_V4_TEMPLATE.read_text(), "the built-in checkpoint, as V4's, has no template"
    return found


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."},
        {"role": "user", "content": "Again"}]


@pytest.mark.parametrize("options,expected", [
    (None, f"{B}Be brief.{U}Hi{A}</think>Hello.{E}{U}Again{A}</think>"),  # chat mode
    ({"thinking": True}, f"{B}Be brief.{U}Hi{A}</think>Hello.{E}{U}Again{A}<think>"),  # earlier reasoning dropped
    ({"enable_thinking": True, "drop_thinking": False},
     f"{B}Be brief.{U}Hi{A}<think>A greeting.</think>Hello.{E}{U}Again{A}<think>"),
    ({"thinking": True, "reasoning_effort": "none"}, f"{B}Be brief.{U}Hi{A}</think>Hello.{E}{U}Again{A}</think>"),
    ({"thinking": True, "reasoning_effort": "high"}, f"{B}Be brief.{U}Hi{A}</think>Hello.{E}{U}Again{A}<think>"),
    ({"thinking": True, "reasoning_effort": "minimal", "drop_thinking": None},  # (any other effort: as "high")
     f"{B}Be brief.{U}Hi{A}</think>Hello.{E}{U}Again{A}<think>"),
    ({"thinking": None, "reasoning_effort": "max"}, f"{B}Be brief.{U}Hi{A}</think>Hello.{E}{U}Again{A}</think>"),
    ({"thinking": True, "reasoning_effort": "xhigh"},
     f"{B}{MAX_EFFORT}Be brief.{U}Hi{A}</think>Hello.{E}{U}Again{A}<think>"),
])
def test_deepseek_v4s_chat_format_in_chat_and_thinking_modes(template, options, expected):
    """DeepSeek's encoding_dsv4.py's prompts, with vLLM's and SGLang's options (chat_template_kwargs)."""
    assert template.render(CHAT, options) == expected


def test_deepseek_v4s_chat_format_merges_user_turns_and_drops_earlier_developer_turns(template):
    """Consecutive user messages are one turn (a blank line between); in thinking mode with dropped reasoning a
    developer turn before the last user turn is dropped, while the reasoning of an answer after it is kept."""
    parts = [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]
    merged = [{"role": "user", "content": "a"}, {"role": "user", "content": parts}]
    assert template.render(merged) == f"{B}{U}a\n\nb\nc{A}</think>"
    turns = [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "Q"},
             {"role": "assistant", "content": "Part", "reasoning_content": "R"}]
    assert template.render(turns) == f"{B}{U}Rules.{U}Q{A}</think>Part{E}"
    assert template.render(turns, {"thinking": True}) == f"{B}{U}Q{A}<think>R</think>Part{E}"


WEATHER = {"type": "function", "function": {"name": "weather", "description": "Today's weather in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}}
TOOL_CHAT = [{"role": "user", "content": "Oslo and Bergen?"},
             {"role": "assistant", "content": "Looking.", "reasoning_content": "Two calls.", "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
                 {"id": "c2", "type": "function",
                  "function": {"name": "weather", "arguments": '{"city": "Bergen", "days": [1, 2], "exact": true}'}}]},
             {"role": "tool", "tool_call_id": "c2", "content": "5 C"},
             {"role": "tool", "tool_call_id": "c1", "content": "3 C"}]


def test_deepseek_v4s_chat_format_renders_tools_tool_calls_and_tool_results(template):
    """DeepSeek's encoder's tool use, with the tools in a system message of their own at the front as vLLM's
    DeepSeek-V4 tokenizer puts them: the tools section with each function's JSON, an answer's calls as a DSML block
    (a string argument as it is, others as JSON), the results in the calls' order inside one user turn, and with
    tools every answer's reasoning kept."""
    schema = json.dumps(WEATHER["function"], ensure_ascii=False)
    calls = (f'\n\n<{D}tool_calls>\n<{D}invoke name="weather">\n'
             f'<{D}parameter name="city" string="true">Oslo</{D}parameter>\n</{D}invoke>\n<{D}invoke name="weather">\n'
             f'<{D}parameter name="city" string="true">Bergen</{D}parameter>\n'
             f'<{D}parameter name="days" string="false">[1, 2]</{D}parameter>\n'
             f'<{D}parameter name="exact" string="false">true</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>')
    expected = (f"{B}\n\n{TOOLS_SECTION.format(schemas=schema)}{U}Oslo and Bergen?{A}<think>Two calls.</think>Looking."
                f"{calls}{E}{U}<tool_result>3 C</tool_result>\n\n<tool_result>5 C</tool_result>{A}<think>")
    assert template.render(TOOL_CHAT, {"thinking": True}, [WEATHER]) == expected
    assert template.render(TOOL_CHAT, {}, [WEATHER]) == expected.replace(  # chat mode
        f"{A}<think>Two calls.</think>", f"{A}</think>").replace(f"{A}<think>", f"{A}</think>")
    # without tools in the request, the calls and results still render; the reasoning of the answer before the last
    # user turn is dropped (drop_thinking), and an argument that is not JSON is DeepSeek's {"arguments": text}
    odd = [dict(TOOL_CHAT[1], tool_calls=[{"function": {"name": "weather", "arguments": "Oslo"}}]), TOOL_CHAT[3]]
    assert template.render(odd, {"thinking": True}) == (
        f"{B}Looking.\n\n<{D}tool_calls>\n<{D}invoke name=\"weather\">\n<{D}parameter name=\"arguments\" "
        f"string=\"true\">Oslo</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{E}"
        f"{U}<tool_result>3 C</tool_result>{A}<think>")
    # so is one nested deeper than a request's JSON may (it would render, but past the renderer's stack)
    deep = '{"a": ' + "[" * 300 + "]" * 300 + "}"
    odd[0]["tool_calls"][0]["function"]["arguments"] = deep
    assert f'<{D}parameter name="arguments" string="true">{deep}</{D}parameter>' in template.render(odd, {})


def test_tools_join_a_leading_system_or_developer_message_and_results_follow_the_last_call_of_an_id(tmp_path):
    """Tools after a leading system (or developer) message's text, as DeepSeek's golden prompts have them; tool
    results in the order of the calls they answer, an id given twice counting at its last call (DeepSeek's encoder
    keeps them in a dict); the template file named as the deployment's chat_template is still DeepSeek-V4's format
    (its tool calls' JSON arguments parsed, its answers parseable)."""
    template = chat_format(tmp_path, DEEPSEEK_V4_TEMPLATE)
    assert template.deepseek_v4_format
    schema = json.dumps(WEATHER["function"], ensure_ascii=False)
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"}]
    assert template.render(system, None, [WEATHER]) == (
        f"{B}Be brief.\n\n{TOOLS_SECTION.format(schemas=schema)}{U}Q{A}</think>")
    developer = [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "Q"}]
    assert template.render(developer, None, [WEATHER]) == (
        f"{B}{U}Rules.\n\n{TOOLS_SECTION.format(schemas=schema)}{U}Q{A}</think>")
    calls = [{"id": i, "function": {"name": "f", "arguments": "{}"}} for i in ("a", "b", "a")]
    chat = [{"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "a", "content": "A"},
            {"role": "tool", "tool_call_id": "b", "content": "B"}]
    assert template.render(chat).endswith(f"{U}<tool_result>B</tool_result>\n\n<tool_result>A</tool_result>{A}</think>")


def test_a_tool_results_text_parts_are_joined_by_a_blank_line_as_deepseeks_encoder_joins_them(template):
    """(A user message's parts by a newline, as vLLM joins them: DeepSeek's encoder takes no parts there.)"""
    parts = [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}]
    chat = [{"role": "user", "content": parts},
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": parts}]
    assert template.render(chat).endswith(f"{U}<tool_result>p1\n\np2</tool_result>{A}</think>")
    assert template.render(chat).startswith(f"{B}{U}p1\np2{A}")


def _reference_v4_prompt(messages, tools=None, thinking=False, drop_thinking=True, effort=None) -> str:
    """DeepSeek's encoding_dsv4.encode_messages as vLLM's DeepSeek-V4 tokenizer calls it (tools on a leading system
    or developer message, else on an empty system message inserted first; "max" and "xhigh" the maximum effort),
    written out in Python from its rules: tool and user messages merged into user turns of blocks, tool results
    ordered by the calls of the answer before them, reasoning dropped before the last user turn (with developer
    turns) unless tools are given."""
    messages = [dict(m) for m in messages]
    if tools and messages[0]["role"] in ("system", "developer"):
        messages[0]["tools"] = tools
    elif tools:
        messages.insert(0, {"role": "system", "content": "", "tools": tools})
    turns = []
    for m in messages:
        if m["role"] in ("user", "tool"):
            block = (m["role"], m.get("tool_call_id"), m["content"])
            if turns and turns[-1]["role"] == "user":
                turns[-1]["blocks"].append(block)
            else:
                turns.append({"role": "user", "blocks": [block]})
        else:
            turns.append(dict(m))
    order = {}
    for turn in turns:
        if turn["role"] == "assistant" and turn.get("tool_calls"):
            order = {call["id"]: k for k, call in enumerate(turn["tool_calls"]) if call.get("id")}
        elif turn["role"] == "user":
            results = iter(sorted((b for b in turn["blocks"] if b[0] == "tool"), key=lambda b: order.get(b[1], 0)))
            turn["blocks"] = [next(results) if b[0] == "tool" else b for b in turn["blocks"]]
    drop = drop_thinking and not tools

    def last_user(turns):
        return max((k for k, t in enumerate(turns) if t["role"] in ("user", "developer")), default=-1)

    if thinking and drop:
        turns = [t for k, t in enumerate(turns) if t["role"] != "developer" or k >= last_user(turns)]
    last = last_user(turns)
    out = B + (MAX_EFFORT if thinking and effort in ("max", "xhigh") else "")
    for k, turn in enumerate(turns):
        role = turn["role"]
        if role == "system":
            out += turn["content"] + _tools_section(turn)
        elif role == "developer":
            out += U + turn["content"] + _tools_section(turn)
        elif role == "user":
            out += U + "\n\n".join(f"<tool_result>{text}</tool_result>" if kind == "tool" else text
                                    for kind, _, text in turn["blocks"])
        else:
            if thinking and (not drop or k > last):
                out += (turn.get("reasoning_content") or "") + "</think>"
            out += turn.get("content") or ""
            if turn.get("tool_calls"):
                invokes = []
                for call in turn["tool_calls"]:
                    raw = call["function"]["arguments"] or {}
                    try:
                        arguments = json.loads(raw) if isinstance(raw, str) else raw
                    except ValueError:
                        arguments = None
                    arguments = arguments if isinstance(arguments, dict) else {"arguments": raw}
                    params = [f'<{D}parameter name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
                              f'{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</{D}parameter>'
                              for key, v in arguments.items()]
                    invokes.append(f'<{D}invoke name="{call["function"]["name"]}">\n' + "\n".join(params)
                                   + f"\n</{D}invoke>")
                out += f"\n\n<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"
            out += E
        following = turns[k + 1]["role"] if k + 1 < len(turns) else None
        if role in ("user", "developer") and following in (None, "assistant"):
            out += A + ("<think>" if thinking and (not drop or k >= last) else "</think>")
    return out


def _tools_section(turn) -> str:
    schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in turn.get("tools") or [])
    return f"\n\n{TOOLS_SECTION.format(schemas=schemas)}" if turn.get("tools") else ""


def _random_chat(rng):
    """A chat of every kind of message DeepSeek's format takes, in any order it can come: tool results answering
    the last answer's calls (in any order, some answering none), arguments as JSON text, objects, or not JSON."""
    values = ["Oslo", "naïve \"quoted\"", 3, 2.5, True, None, [1, "a"], {"k": {"deep": [False]}}]
    messages, calls = [], []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(["Be brief.", "", "Sys\nprompt"])})
    for _ in range(rng.randint(1, 7)):
        role = rng.choice(["user", "user", "assistant", "tool", "developer"])
        if role == "assistant":
            message = {"role": "assistant", "content": rng.choice(["Answer.", "", "Ok"]),
                       "reasoning_content": rng.choice([None, "", "Because."])}
            if rng.random() < 0.5:
                calls = [f"id{rng.randint(0, 3)}" for _ in range(rng.randint(1, 3))]  # (ids may repeat)
                tool_calls = []
                for call_id in calls:
                    arguments = {f"p{j}": rng.choice(values) for j in range(rng.randint(0, 3))}
                    form = rng.choice(["json", "object", "text", "empty"])
                    arguments = (json.dumps(arguments) if form == "json" else arguments if form == "object"
                                 else rng.choice(["not json {", "[1]", "5"]) if form == "text"
                                 else rng.choice(["", None]))
                    tool_calls.append({"id": call_id, "type": "function",
                                       "function": {"name": rng.choice(["weather", "search"]), "arguments": arguments}})
                message["tool_calls"] = tool_calls
            messages.append(message)
        elif role == "tool":
            messages.append({"role": "tool", "content": rng.choice(["3 C", "", "{\"ok\": 1}"]),
                             "tool_call_id": rng.choice(calls + ["unknown"])})
        else:
            messages.append({"role": role, "content": rng.choice(["Q?", "More", "Rules."])})
    return messages


@pytest.mark.parametrize("seed", range(6))
def test_deepseek_v4s_chat_format_matches_deepseeks_encoder_rules_on_random_chats(template, seed):
    """The template against the encoder's rules written out in Python, on random chats with and without tools, in
    chat and thinking mode, dropping reasoning or keeping it, at every reasoning effort."""
    import random

    rng = random.Random(seed)
    search = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    for _ in range(60):
        messages = _random_chat(rng)
        tools = rng.choice([None, [WEATHER], [WEATHER, search]])
        options = {"thinking": rng.choice([True, False]), "drop_thinking": rng.choice([True, False]),
                   "reasoning_effort": rng.choice([None, "high", "max", "xhigh"])}
        expected = _reference_v4_prompt(messages, tools, options["thinking"], options["drop_thinking"],
                                        options["reasoning_effort"])
        assert template.render(messages, options, tools) == expected, (messages, tools, options)


def test_transformers_apply_chat_template_renders_the_same_prompt_from_the_template_file(tiny_checkpoint, template):
    """What takes a template file (Triton's OpenAI frontend's `--chat-template`, a client's tokenizer) renders it
    through transformers' apply_chat_template: deepseek_v4_chat.jinja gives it the prompt this server renders, tools
    included; tool calls whose arguments are JSON text, which Jinja cannot parse (the server parses them first), are
    refused, naming what to send."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    source = DEEPSEEK_V4_TEMPLATE.read_text()
    for options in ({}, {"thinking": True}, {"enable_thinking": True, "drop_thinking": False}):
        assert template.render(CHAT, options) == reference.apply_chat_template(
            CHAT, chat_template=source, tokenize=False, add_generation_prompt=True, **options)
        assert template.render(CHAT, options, [WEATHER]) == reference.apply_chat_template(
            CHAT, chat_template=source, tools=[WEATHER], tokenize=False, add_generation_prompt=True, **options)
    with pytest.raises(Exception, match="arguments as an object"):
        reference.apply_chat_template(TOOL_CHAT, chat_template=source, tokenize=False)


@pytest.mark.parametrize("messages,options,message", [
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}], None,
     "tool_calls\\[0\\] must be an object \\{\"function\""),
    ([{"role": "assistant", "content": None, "tool_calls": {"id": "c1"}}], None, "tool_calls must be a list"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]}], None,
     "messages\\[0\\].tool_calls\\[0\\].function.arguments must be a JSON object or a string holding one, got list"),
    ([{"role": "developer", "content": ""}], None, "developer message needs content"),
    (CHAT, {"thinking": "yes"}, "thinking must be true or false"),
    (CHAT, {"thinking": False, "enable_thinking": 1}, "enable_thinking must be true or false"),
    (CHAT, {"drop_thinking": 0}, "drop_thinking must be true or false"),
    (CHAT, {"reasoning_effort": 5}, "reasoning_effort must be a string"),
    (CHAT, {"add_generation_prompt": False}, "cannot set \\['add_generation_prompt'\\]"),
    (CHAT, {"namespace": 1, "self": 2}, "cannot set \\['namespace', 'self'\\]"),
    (CHAT, ["thinking"], "must be a JSON object"),
])
def test_what_deepseek_v4s_chat_format_cannot_render_is_refused_naming_it(template, messages, options, message):
    with pytest.raises(ValueError, match=message):
        template.render(messages, options)


def test_messages_input_becomes_the_rendered_prompt_without_extra_special_tokens(tiny_checkpoint, template):
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    messages = [{"role": "user", "content": "Hi"}]
    inputs = {"messages": np.array([json.dumps(messages).encode()], dtype=np.object_)}
    parsed = triton_io.parse_request(inputs, tokenizer, None, template)
    assert parsed.prompt_text == template.render(messages)
    assert parsed.prompt_ids == tokenizer.encode(parsed.prompt_text, add_special_tokens=False).ids
    assert parsed.prompt_ids[0] == 0  # the template's BOS, once
    inputs["chat_template_kwargs"] = np.array([b'{"thinking": true}'], dtype=np.object_)
    parsed = triton_io.parse_request(inputs, tokenizer, None, template)
    assert parsed.prompt_text == template.render(messages, {"thinking": True}) == f"{B}{U}Hi{A}<think>"


def test_a_tools_input_reaches_the_template_beside_messages(tiny_checkpoint, template):
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    inputs = {"messages": np.array([json.dumps(TOOL_CHAT).encode()], dtype=np.object_),
              "tools": np.array([json.dumps([WEATHER]).encode()], dtype=np.object_),
              "chat_template_kwargs": np.array([b'{"thinking": true}'], dtype=np.object_)}
    parsed = triton_io.parse_request(inputs, tokenizer, None, template)
    assert parsed.prompt_text == template.render(TOOL_CHAT, {"thinking": True}, [WEATHER])
    assert "## Tools" in parsed.prompt_text and parsed.prompt_text != template.render(TOOL_CHAT, {"thinking": True})


@pytest.mark.parametrize("inputs,message", [
    ({"text_input": [b"Hi"], "chat_template_kwargs": [b"{}"]}, "an option of 'messages'.*given with 'text_input'"),
    ({"input_ids": np.array([1, 2], dtype=np.int32), "tools": [b"[]"]}, "'tools' is an option of 'messages'"),
    ({"messages": [b'[{"role": "user", "content": "x"}]'], "tools": [b'{"name": "f"}']}, "tools must be a JSON list"),
    ({"messages": [b'[{"role": "user", "content": "x"}]'], "tools": [b'[{"type": "function"}]']},
     "tools\\[0\\] must be an object"),
    ({"messages": [b'[{"role": "user", "content": "x"}]'], "tools": [b'[{"type": "code", "function": {"name": "f"}}]']},
     "tools\\[0\\].type must be \"function\""),
    ({"messages": [b'[{"role": "user", "content": "x"}]'], "tools": [b"[{"]}, "tools is not valid JSON"),
    ({"messages": [b'[{"role": "user", "content": "x"}]'], "chat_template_kwargs": [b"{"]}, "not valid JSON"),
    ({"messages": [b'[{"role": "user", "content": "x"}]'], "chat_template_kwargs": [b"[]"]}, "JSON object"),
    ({"messages": [b'[{"role": "user", "content": "x"}]'],
      "tools": [b'[{"type": "function", "function": {"name": "f", "description": [1]}}]']},
     "tools\\[0\\].function.description must be a string, got list"),
    ({"messages": [b'[{"role": "user", "content": "x"}]'],
      "tools": [b'[{"function": {"name": "f"}}, {"function": {"name": "g"}}, {"function": {"name": "f"}}]']},
     "tools\\[2\\] repeats the function name 'f' of tools\\[0\\]"),
    # (deeper than 200 levels, short of Python's parser's limit: the template's renderer would run out of stack)
    ({"messages": [b'[{"role": "user", "content": "x", "extra": ' + b"[" * 600 + b"]" * 600 + b"}]"]},
     "messages nests 601 levels deep, more than 200"),
    ({"messages": [b'[{"role": "user", "content": "x"}]'],
      "tools": [b'[{"function": {"name": "f", "parameters": ' + b"[" * 600 + b"]" * 600 + b"}}]"]},
     "tools nests 602 levels deep, more than 200"),
    ({"messages": [b'[{"role": "user", "content": "x"}]'],
      "chat_template_kwargs": [b'{"reasoning_effort": ' + b"[" * 500 + b"]" * 500 + b"}"]},
     "chat_template_kwargs nests 500 levels deep, more than 200"),
])
def test_malformed_chat_template_kwargs_and_tools_are_refused(tiny_checkpoint, template, inputs, message):
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    arrays = {name: value if isinstance(value, np.ndarray) else np.array(value, dtype=np.object_)
              for name, value in inputs.items()}
    with pytest.raises(ValueError, match=message):
        triton_io.parse_request(arrays, tokenizer, None, template)


@pytest.mark.parametrize("messages,message", [
    ("not json", "not valid JSON"), ("[]", "non-empty"), ('[{"role": "robot", "content": "x"}]', "role"),
    ('[{"role": "user", "content": 3}]', "content must be a string"), ('{"role": "user"}', "non-empty JSON list"),
    ('[{"role": "user", "content": null}]', "messages\\[0\\].content must be a string or a list"),
    ('[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]', "only text parts"),
    ('[{"content": "x"}]', "messages\\[0\\] must be an object with 'role'"),
])
def test_malformed_messages_are_refused_naming_the_problem(tiny_checkpoint, template, messages, message):
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    inputs = {"messages": np.array([messages.encode()], dtype=np.object_)}
    with pytest.raises(ValueError, match=message):
        triton_io.parse_request(inputs, tokenizer, None, template)


def test_openai_messages_reach_the_template_as_transformers_passes_them():
    """Text parts joined with newlines (as vLLM joins them), the developer and tool roles, an assistant's tool calls
    with null content and a tool's call id: the template sees each message with its keys, and decides."""
    template = ChatTemplate("{% for m in messages %}[{{ m.role }}|{{ m.content }}|"
                            "{{ m.tool_calls[0].id if m.tool_calls else '' }}{{ m.tool_call_id or '' }}]{% endfor %}")
    parts = [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Oslo?"}]
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
                {"role": "tool", "content": "3 C", "tool_call_id": "c1", "name": "weather"}]
    assert template.render(messages) == ("[developer|Be brief.|][user|Weather\nin Oslo?|][assistant|None|c1]"
                                         "[tool|3 C|c1]")


def test_the_template_comes_from_the_parameter_then_chat_template_jinja_then_tokenizer_config(tiny_checkpoint,
                                                                                            tmp_path):
    """As transformers finds a checkpoint's template (chat_template.jinja first), and a deployment's chat_template
    file before either (vLLM's --chat-template); a chat_template file that is not there fails the load, naming it."""
    from backend.config import ConfigError

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config {{ messages[0].content }}",
                                                                  "bos_token": "<s>"}))
    assert ChatTemplate.from_checkpoint(checkpoint).render([{"role": "user", "content": "x"}]) == "config x"
    (checkpoint / "chat_template.jinja").write_text("jinja {{ bos_token }}{{ messages[0].content }}")
    assert ChatTemplate.from_checkpoint(checkpoint).render([{"role": "user", "content": "x"}]) == "jinja <s>x"
    (tmp_path / "mine.jinja").write_text("mine {{ messages[0].content }}")
    chosen = ChatTemplate.from_checkpoint(checkpoint, tmp_path / "mine.jinja")
    assert chosen.render([{"role": "user", "content": "x"}]) == "mine x"
    assert ChatTemplate.from_checkpoint(tmp_path / "nothing there") is None
    assert chat_format(tmp_path / "nothing there").source == DEEPSEEK_V4_TEMPLATE.read_text()
    assert chat_format(checkpoint).render([{"role": "user", "content": "x"}]) == "jinja <s>x"
    with pytest.raises(ConfigError, match="chat_template.*no file at"):
        ChatTemplate.from_checkpoint(checkpoint, tmp_path / "missing.jinja")


def test_messages_without_a_template_and_two_prompts_are_refused(tiny_checkpoint):
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    messages = np.array([b'[{"role": "user", "content": "x"}]'], dtype=np.object_)
    with pytest.raises(ValueError, match="needs a chat template"):
        triton_io.parse_request({"messages": messages}, tokenizer, None, None)
    with pytest.raises(ValueError, match="exactly one of"):
        triton_io.parse_request({"messages": messages, "text_input": np.array([b"x"], dtype=np.object_)}, tokenizer)


@pytest.mark.parametrize("source,expected", [
    ("{% for m in messages %}{{ m.content|tojson }}{% endfor %}", '"a<b & c""d"'),  # no HTML escapes
    ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}", "user"),
    ("{{ strftime_now('%Y') | length }}{{ bos_token }}", "4<s>"),
    ("{% generation %}{{ messages[0].content }}{% endgeneration %}", "a<b & c"),
])
def test_templates_written_for_transformers_render_as_there(source, expected):
    """What transformers' renderer adds to Jinja (loop controls, generation blocks, its tojson, strftime_now): a
    checkpoint's template that uses them renders as apply_chat_template renders it."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "user", "content": "a<b & c"}, {"role": "assistant", "content": "d"}]
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    (reference,), _ = render_jinja_template([messages], chat_template=source, add_generation_prompt=True,
                                            bos_token="<s>", eos_token="</s>")
    assert template.render(messages) == reference == expected


def test_a_template_that_refuses_the_messages_is_a_clear_error():
    template = ChatTemplate("{{ raise_exception('Conversation roles must alternate user/assistant') }}")
    with pytest.raises(ValueError, match="cannot render these messages: Conversation roles must alternate"):
        template.render([{"role": "user", "content": "x"}])


ENCODING_CASES = Path(__file__).with_name("deepseek_v4_encoding")


@pytest.mark.parametrize("case", ["tools", "thinking"])
def test_deepseeks_own_encoding_cases_render_character_for_character(template, case):
    """DeepSeek's published test cases of encoding_dsv4.py (tests/serving/deepseek_v4_encoding/README.md): its gold
    prompts, in thinking mode, with the tools on the leading system message as its test puts them; and the answers
    in them parse back to the messages they were rendered from, as its test parses them."""
    given = json.loads((ENCODING_CASES / f"{case}_input.json").read_text(encoding="utf-8"))
    messages, tools = (given["messages"], given["tools"]) if isinstance(given, dict) else (given, None)
    gold = (ENCODING_CASES / f"{case}_output.txt").read_text(encoding="utf-8")
    prompt = template.render(messages, {"thinking": True}, tools)
    assert prompt == gold
    answers = [m for m in messages if m["role"] == "assistant"]
    written = prompt.split(f"{A}<think>")[1:]  # (each answer kept in thinking mode: the last one's, with tools all)
    assert written and len(written) <= len(answers)
    for answer, text in zip(answers[-len(written):], written):
        parser = AnswerParser(thinking=True)  # (fed from inside <think>, as the model writes it)
        parts = [parser.feed(text.split(E)[0]), parser.finish()]
        assert "".join(p.reasoning for p in parts) == answer["reasoning_content"]
        assert "".join(p.content for p in parts) == answer.get("content", "")
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for p in parts for c in p.tool_calls]
        assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                         for c in answer.get("tool_calls", [])]
