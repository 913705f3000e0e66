"""Chat prompts: a chat template, or DeepSeek-V4's own format, renders `messages`; malformed messages and options get
clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from backend.chat import DEEPSEEK_V4_TEMPLATE, ChatTemplate, chat_format
from backend.serving import triton_io

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


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


def test_transformers_apply_chat_template_renders_the_same_prompt_from_the_template_file(tiny_checkpoint, template):
    """What takes a template file (Triton's OpenAI frontend's `--chat-template`, a client's tokenizer) renders it
    through transformers' apply_chat_template: deepseek_v4_chat.jinja gives it the prompt this server renders, and
    refuses request-level tools, which it cannot render (the frontend passes them to the template)."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    source = DEEPSEEK_V4_TEMPLATE.read_text()
    for options in ({}, {"thinking": True}, {"enable_thinking": True, "drop_thinking": False}):
        assert template.render(CHAT, options) == reference.apply_chat_template(
            CHAT, chat_template=source, tokenize=False, add_generation_prompt=True, **options)
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    with pytest.raises(Exception, match="renders no tools"):
        reference.apply_chat_template(CHAT, chat_template=source, tools=[tool], tokenize=False)


@pytest.mark.parametrize("messages,options,message", [
    ([{"role": "tool", "content": "3 C", "tool_call_id": "c1"}], None, "no tool calls or tool results"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}], None, "no tool calls"),
    ([{"role": "developer", "content": ""}], None, "developer message needs content"),
    (CHAT, {"thinking": "yes"}, "thinking must be true or false"),
    (CHAT, {"thinking": False, "enable_thinking": 1}, "enable_thinking must be true or false"),
    (CHAT, {"drop_thinking": 0}, "drop_thinking must be true or false"),
    (CHAT, {"thinking": True, "reasoning_effort": "max"}, "reasoning_effort \"max\": DeepSeek's maximum-effort"),
    (CHAT, {"enable_thinking": True, "reasoning_effort": "xhigh"}, "reasoning_effort \"xhigh\""),
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


@pytest.mark.parametrize("inputs,message", [
    ({"text_input": [b"Hi"], "chat_template_kwargs": [b"{}"]}, "an option of 'messages'.*given with 'text_input'"),
    ({"messages": [b'[{"role": "user", "content": "x"}]'], "chat_template_kwargs": [b"{"]}, "not valid JSON"),
    ({"messages": [b'[{"role": "user", "content": "x"}]'], "chat_template_kwargs": [b"[]"]}, "JSON object"),
])
def test_malformed_chat_template_kwargs_are_refused(tiny_checkpoint, template, inputs, message):
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    arrays = {name: np.array(value, dtype=np.object_) for name, value in inputs.items()}
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
