"""Chat prompts: a list of messages turned into the prompt text, by a Jinja chat template or by DeepSeek-V4's own
chat format.

    chat = chat_format(checkpoint, template_file)      # a ChatTemplate: the deployment's, the checkpoint's, V4's
    text = chat.render([{"role": "user", "content": "Hi"}], {"thinking": True})   # options: chat_template_kwargs
    text = chat.render(messages, options, tools=[{"type": "function", "function": {"name": ..., "parameters": ...}}])

The template is the deployment's `chat_template` file if it names one (as vLLM's and Triton's OpenAI frontend's
--chat-template), else the checkpoint's, where transformers finds it: chat_template.jinja (which transformers v5
writes), else tokenizer_config.json's `chat_template`. It is rendered by transformers' own renderer (what
apply_chat_template calls: Jinja's immutable sandbox with transformers' loop controls, `{% generation %}` blocks,
`tojson` without HTML escapes, `raise_exception` and `strftime_now`; `messages`, `add_generation_prompt=True`,
`bos_token`, `eos_token`, and the request's `chat_template_kwargs` as further variables, as transformers passes
them), so that templates written for it render here as there. A template that refuses the messages
(`raise_exception`) or fails on them is a ValueError with its message.

DeepSeek-V4's published checkpoints ship no Jinja template: DeepSeek gives the format as Python
(encoding/encoding_dsv4.py). Without a template, deepseek_v4_chat.jinja beside this file renders that format, as
vLLM's and SGLang's DeepSeek-V4 tokenizers render it, with their request options (`thinking` / `enable_thinking`,
`reasoning_effort`, `drop_thinking`), tools, tool calls (DeepSeek's DSML) and tool results. Being Jinja, the same file
serves Triton's OpenAI frontend (--chat-template), which applies the template itself; the one thing it cannot do is
parse a tool call's `arguments` JSON string, which DeepSeek's format writes argument by argument: the server parses
them for it first, as DeepSeek's encoder does (text that is not JSON becomes
{"arguments": text}).

Messages are checked first: a non-empty list of objects, each with an OpenAI role (system, developer, user,
assistant, tool) and its `content`: a string, a list of text parts (joined with newlines, as vLLM joins them), or null
beside an assistant's `tool_calls`; other keys (`name`, `tool_calls`, `tool_call_id`, `reasoning_content`, ...) go to
the template as they are, as transformers passes them. The request's `tools` go to the template as its `tools`
variable: a list of OpenAI tools, {"type": "function", "function": {"name": ..., ...}}. Anything else is a ValueError
naming the message or tool. The rendered text carries its own special tokens, so it is tokenized without adding any
(`Tokenizer.encode(text, add_special_tokens=False)`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.errors import load_json

ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's; the template decides what it takes
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"  # DeepSeek-V4's, unless tokenizer_config.json says
DEEPSEEK_V4_TEMPLATE = Path(__file__).with_name("deepseek_v4_chat.jinja")  # DeepSeek's format (its Python) in Jinja

# The names the renderer itself gives a Jinja template (its variables, Jinja's and transformers' functions, the
# render call's own `self`): a request's options must not replace them.
_RENDERER_VARIABLES = frozenset({"messages", "conversations", "add_generation_prompt", "bos_token", "eos_token",
                                 "chat_template", "tools", "documents", "continue_final_message",
                                 "return_assistant_tokens_mask", "self", "range", "dict", "lipsum", "cycler", "joiner",
                                 "namespace", "raise_exception", "strftime_now"})


def chat_format(checkpoint: str | Path, template_file: str | Path | None = None) -> "ChatTemplate":
    """The deployment's template (`template_file`), else the checkpoint's, else DeepSeek-V4's own format
    (DEEPSEEK_V4_TEMPLATE)."""
    template = ChatTemplate.from_checkpoint(checkpoint, template_file)
    builtin = DEEPSEEK_V4_TEMPLATE.read_text(encoding="utf-8")
    if template is not None and template.source != builtin:  # (the file itself named: DeepSeek-V4's format still)
        return template
    config = _tokenizer_config(Path(checkpoint))
    bos, eos = _token_text(config.get("bos_token")) or BOS, _token_text(config.get("eos_token")) or EOS
    return ChatTemplate(builtin, bos, eos, deepseek_v4_format=True)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""
    # DeepSeek-V4's own format (deepseek_v4_chat.jinja): tool calls' `arguments` JSON strings are given to it as
    # objects, and its answers can be split into reasoning, content and tool calls (backend/chat_output.py)
    deepseek_v4_format: bool = False

    def __post_init__(self):
        import transformers.utils.chat_template_utils  # noqa: F401 (its import, half a second, at start-up)

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path, template_file: str | Path | None = None) -> "ChatTemplate | None":
        """`template_file`'s template (the deployment's `chat_template`), else the checkpoint's; None without one."""
        directory = Path(checkpoint)
        config = _tokenizer_config(directory)
        if template_file is not None:
            if not Path(template_file).is_file():
                from backend.config import ConfigError

                raise ConfigError(f"parameter 'chat_template': no file at {str(template_file)!r}")
            template = Path(template_file).read_text(encoding="utf-8")
        elif (directory / "chat_template.jinja").is_file():  # (transformers reads it before tokenizer_config.json's)
            template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
        else:
            template = config.get("chat_template")
            if isinstance(template, list):  # transformers' named templates: the default one
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not template:
            return None
        return cls(template, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: Any, options: dict[str, Any] | None = None, tools: Any = None) -> str:
        """`options`: the request's chat_template_kwargs, further variables of the template; `tools`: the request's
        tools (None: none)."""
        messages = checked_messages(messages)
        if self.deepseek_v4_format:
            messages = [_with_parsed_arguments(m, i) if m.get("tool_calls") else m for i, m in enumerate(messages)]
        options = checked_options(options)
        tools = checked_tools(tools)
        taken = sorted(_RENDERER_VARIABLES & set(options))
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {taken}: the server sets them")
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            (text,), _ = render_jinja_template([messages], tools=tools, chat_template=self.source,
                                               add_generation_prompt=True, bos_token=self.bos_token,
                                               eos_token=self.eos_token, **options)
        except (TemplateError, TypeError) as exc:  # (TypeError: an option the template calls or compares wrongly)
            raise ValueError(f"the chat template cannot render these messages: {exc}") from None
        return text


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """A rendered chat's token ids: its special tokens are in the text, so none is added; ValueError for text that
    is not valid Unicode or renders to no tokens."""
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=False).ids)
    except (TypeError, UnicodeError):  # (a lone surrogate, which JSON's \u escapes can spell)
        raise ValueError("messages, tools or chat_template_kwargs hold text that is not valid Unicode") from None
    if not ids:
        raise ValueError("messages render to no tokens")
    return ids


def checked_options(options: Any) -> dict[str, Any]:
    """A request's chat_template_kwargs: a JSON object (None: none)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(f"chat_template_kwargs must be a JSON object, got {type(options).__name__}")
    return options


def checked_tools(tools: Any) -> list[dict] | None:
    """A request's tools: a JSON list of OpenAI tools, {"type": "function", "function": {"name": ..., ...}} (None or an
    empty list: none)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a JSON list of tools, got {type(tools).__name__}")
    first: dict[str, int] = {}  # function name -> the first tool with it
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}] must be an object {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"parameters\": ...}}}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}].type must be \"function\", got {tool['type']!r}")
        if not isinstance(function.get("description", ""), (str, type(None))):  # (OpenAI's: a string)
            raise ValueError(f"tools[{i}].function.description must be a string, got "
                             f"{type(function['description']).__name__}")
        name = function["name"]
        if first.setdefault(name, i) != i:
            raise ValueError(f"tools[{i}] repeats the function name {name!r} of tools[{first[name]}]")
    return tools


def _with_parsed_arguments(message: dict, i: int) -> dict:
    """An assistant message whose tool calls' `arguments` are objects: a JSON string (what OpenAI's API sends) parsed,
    text that is not a JSON object as {"arguments": text}, as DeepSeek's encoder and vLLM take them. None, null and ""
    are no arguments, as vLLM takes them (DeepSeek's encoder would write "" and null as one argument named
    "arguments", which a client sending them for a call without arguments does not mean)."""
    calls = message["tool_calls"]
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list")
    parsed = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"messages[{i}].tool_calls[{j}] must be an object {{\"function\": {{\"name\": ..., "
                             "\"arguments\": ...}}}")
        arguments = function.get("arguments") or {}  # (none, null or "": no arguments, as vLLM takes them)
        if isinstance(arguments, str):
            try:
                arguments = load_json(arguments, "arguments")
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):  # (not JSON, nor an object: as one argument, as vLLM does)
                arguments = {"arguments": function["arguments"]}
        if not isinstance(arguments, dict):
            raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object or a string "
                             f"holding one, got {type(arguments).__name__}")
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": parsed}


def checked_messages(messages: Any) -> list[dict]:
    """The messages as the template gets them (text parts joined); ValueError naming the first malformed one."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty JSON list of {\"role\", \"content\"} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        if message["role"] not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(ROLES)}, got {message['role']!r}")
        checked.append({**message, "content": _content(message, i)})
    return checked


def _content(message: dict, i: int) -> str | None:
    """A message's content as a string: text parts joined with newlines (a tool result's with a blank line, as
    DeepSeek's encoder joins a tool result's text blocks); null only beside an assistant's tool calls."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message["role"] == "assistant" and message.get("tool_calls"):
        return None
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        kinds = sorted({str(part.get("type")) for part in content} - {"text"})
        if kinds:
            raise ValueError(f"messages[{i}].content has parts of type {kinds}: only text parts are taken")
        if all(isinstance(part.get("text"), str) for part in content):
            return ("\n\n" if message["role"] == "tool" else "\n").join(part["text"] for part in content)
    raise ValueError(f"messages[{i}].content must be a string or a list of {{\"type\": \"text\", \"text\": ...}} "
                     "parts")


def _tokenizer_config(directory: Path) -> dict:
    path = directory / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(token: Any) -> str:
    """tokenizer_config.json keeps special tokens as strings or as {"content": ...} objects."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token or ""
