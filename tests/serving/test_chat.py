"""Chat prompts: the checkpoint's chat template renders `messages`; malformed messages get clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from backend.chat import ChatTemplate
from backend.serving import triton_io


@pytest.fixture(scope="module")
def template(tiny_checkpoint) -> ChatTemplate:
    found = ChatTemplate.from_checkpoint(tiny_checkpoint)
    assert found is not None, "the built-in checkpoint ships a chat template"
    return found


def test_the_built_in_template_renders_deepseeks_chat_format(template):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]
    assert template.render(messages) == ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>Hello."
                                         "<｜end▁of▁sentence｜><｜User｜>Again<｜Assistant｜>")


def test_the_template_matches_transformers_apply_chat_template(tiny_checkpoint, template):
    """The same rendering as transformers' tokenizer (what Triton's OpenAI frontend applies itself)."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is 2+2?"}]
    reference = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    assert template.render(messages) == reference.apply_chat_template(messages, tokenize=False,
                                                                      add_generation_prompt=True)


def test_messages_input_becomes_the_rendered_prompt_without_extra_special_tokens(tiny_checkpoint, template):
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    messages = [{"role": "user", "content": "Hi"}]
    inputs = {"messages": np.array([json.dumps(messages).encode()], dtype=np.object_)}
    parsed = triton_io.parse_request(inputs, tokenizer, None, template)
    assert parsed.prompt_text == template.render(messages)
    assert parsed.prompt_ids == tokenizer.encode(parsed.prompt_text, add_special_tokens=False).ids
    assert parsed.prompt_ids[0] == 0  # the template's BOS, once


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
