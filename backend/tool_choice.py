"""A chat's `tool_choice` (OpenAI's): which tools its prompt shows, and what its answer must be.

    choice = ToolChoice.of(parse_tool_choice(text), tools)   # tools: backend/chat.py `checked_tools`
    prompt = chat.render(messages, options, choice.shown_tools)
    guided = choice.constraint(prompt, chat.deepseek_v4_format)   # None, or a structural tag
    choice.parses_calls                                        # whether parse_chat_output reads tool calls

- "auto" (the default): the model decides; nothing is constrained (as vLLM and SGLang leave it).
- "none": no call. The tools are left out of the prompt (vLLM's --exclude-tools-when-tool-choice-none), so the model
  is not offered any; earlier calls and their results in the messages still render. A tool-call block the model writes
  anyway is content to parse_chat_output (vLLM runs no tool parser then).
- "required": the answer is a DSML block of one tool call or more (any of the tools, in any number) right after the
  reasoning in thinking mode, at once in chat mode; each call's parameters follow its function's JSON schema.
- {"type": "function", "function": {"name": ...}} (or the Responses API's {"type": "function", "name": ...}): the same
  with exactly one call, of that function.

The last two are an output constraint: XGrammar's structural tag for DeepSeek-V4 (`deepseek_v4`), which writes calls
exactly as deepseek_v4_chat.jinja renders an assistant's `tool_calls` (tests/serving/test_tool_choice.py checks the
one against the other), so they need DeepSeek-V4's chat format, a prompt that ends where an answer starts (<think> or
</think>), and no other constraint in the same request. A function's `parameters` must be an object's JSON schema,
checked as a `json` constraint's is (backend/structured/params.py: a keyword XGrammar would not enforce is refused),
and enforced whatever its `strict` says; none (or null) is an empty parameter list, as OpenAI's API takes it.

`parallel_tool_calls` false (OpenAI's; true by default): "required" makes exactly one call, and parse_chat_output gives
an answer's first call only, the others dropped (vLLM's `maybe_filter_parallel_tool_calls`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from backend.chat_output import THINK_END, THINK_START
from backend.errors import load_json
from backend.structured.params import GuidedDecoding, checked_json_schema

CHOICES = ("auto", "none", "required")
_EXPECTED = 'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
# OpenAI's function without parameters: it takes none
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def parse_tool_choice(text: str) -> Any:
    """The `tool_choice` input's text: JSON ("required", {"type": "function", ...}), or one of CHOICES as a bare
    word."""
    if text.strip() in CHOICES:
        return text.strip()
    try:
        return load_json(text, "tool_choice")
    except ValueError:
        raise ValueError(f"{_EXPECTED} (as JSON, or one of the words bare), got {text[:200]!r}") from None


@dataclass(frozen=True)
class ToolChoice:
    choice: str | dict  # one of CHOICES, or {"type": "function", "function": {"name": ...}}
    tools: list[dict] | None  # the request's checked tools
    parallel: bool = True  # parallel_tool_calls: false, one call at most

    @classmethod
    def of(cls, tool_choice: Any, tools: list[dict] | None, parallel: bool = True) -> "ToolChoice":
        """A request's tool_choice (None: "auto"), given its checked tools (None: none) and parallel_tool_calls;
        ValueError naming what is wrong."""
        return cls(cls._checked(tool_choice, tools), tools, parallel)

    @staticmethod
    def _checked(tool_choice: Any, tools: list[dict] | None) -> str | dict:
        if tool_choice is None:
            return "auto"
        names = [tool["function"]["name"] for tool in tools or []]
        if isinstance(tool_choice, str):
            if tool_choice not in CHOICES:
                raise ValueError(f"{_EXPECTED}, got {tool_choice!r}")
            if tool_choice == "required" and not names:
                raise ValueError('tool_choice "required" needs tools to call: give the tools input')
            return tool_choice
        name = _named(tool_choice)
        if name not in names:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools "
                             f"({', '.join(map(repr, names)) or 'none given'})")
        return {"type": "function", "function": {"name": name}}

    @property
    def shown_tools(self) -> list[dict] | None:
        """The tools the prompt shows: none for "none", else all of them."""
        return None if self.choice == "none" else self.tools

    @property
    def constrains(self) -> bool:
        return self.choice not in ("auto", "none")

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def constraint(self, prompt: str, deepseek_v4_format: bool) -> GuidedDecoding | None:
        """The output constraint on an answer to `prompt`, rendered by a chat template that is DeepSeek-V4's format or
        not (backend/chat.py `ChatTemplate.deepseek_v4_format`): None for "auto" and "none"; else the structural tag
        of the calls, after the reasoning where the prompt asks for one."""
        if not self.constrains:
            return None
        if not deepseek_v4_format:
            raise ValueError(f"tool_choice {json.dumps(self.choice)} constrains the answer to DeepSeek-V4's "
                             "tool-call syntax, and this model's chat template is another (the chat_template "
                             "parameter's or the checkpoint's)")
        if not prompt.endswith((THINK_START, THINK_END)):
            raise ValueError(f"tool_choice {json.dumps(self.choice)} constrains an answer, and this chat's prompt does "
                             f"not end where one starts ({THINK_START} or {THINK_END}): end the messages with a "
                             "user (or tool) turn")
        import xgrammar as xgr

        try:
            tag = xgr.get_model_structural_tag("deepseek_v4", tools=self._called(), tool_choice=self.choice,
                                               reasoning="enabled" if prompt.endswith(THINK_START) else "disabled",
                                               parallel_tool_calls=self.parallel, max_whitespace_cnt=1)
        except (ValueError, AssertionError) as exc:  # (XGrammar's own checks of the tools, pydantic's, its asserts)
            reason = str(exc) or type(exc).__name__
            raise ValueError(f"the tools cannot be constrained for tool_choice: {reason}") from None
        return GuidedDecoding("structural_tag", tag.model_dump_json())

    def _called(self) -> list[dict]:
        """The tools the answer may call, as XGrammar is to take them: every one for "required", else the named one;
        each function's parameters checked, an empty list where it gives none, and without `strict` (XGrammar would
        leave the arguments of a strict=false function unconstrained)."""
        called = []
        for tool in self.tools:
            function = tool["function"]
            if self.choice != "required" and function["name"] != self.choice["function"]["name"]:
                continue
            schema = function.get("parameters")
            schema = _NO_PARAMETERS if schema is None else schema
            where = f"the parameters of tool {function['name']!r}"
            if not isinstance(schema, dict) or schema.get("type", "object") != "object":
                got = f"type {schema['type']!r}" if isinstance(schema, dict) else json.dumps(schema)[:100]
                raise ValueError(f"{where} must be a JSON schema of an object (its arguments by name), got {got}")
            checked_json_schema(schema, where)
            function = {key: value for key, value in function.items() if key != "strict"}
            called.append({"type": "function", "function": {**function, "parameters": schema}})
        return called


def _named(tool_choice: Any) -> str:
    """The function a named tool_choice names: Chat Completions' {"type": "function", "function": {"name": ...}} or the
    Responses API's {"type": "function", "name": ...}."""
    if isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function":
        function = tool_choice.get("function", tool_choice)
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    raise ValueError(f"{_EXPECTED}, got {json.dumps(tool_choice)[:200]}")
