"""A chat's `tool_choice` (OpenAI's): which tools its prompt shows, and what its answer must be.

    choice = checked_tool_choice(tool_choice, tools)   # "auto", "none", "required" or {"type": "function", ...}
    text = chat.render(messages, options, shown_tools(choice, tools))
    guided = tool_call_constraint(choice, tools, thinking=text.endswith("<think>"))   # None or a structural tag

- "auto" (the default): the model decides; nothing is constrained (as vLLM and SGLang leave it).
- "none": no call. The tools are left out of the prompt (vLLM's --exclude-tools-when-tool-choice-none), so the model
  is not offered any; earlier calls and their results in the messages still render.
- "required": the answer is a DSML block of one tool call or more (any of the tools, in any number) right after the
  reasoning in thinking mode, at once in chat mode; each call's parameters follow its function's JSON schema.
- {"type": "function", "function": {"name": ...}}: the same with exactly one call, of that function.

The last two are an output constraint: XGrammar's structural tag for DeepSeek-V4 (`deepseek_v4`), which writes calls
exactly as deepseek_v4_chat.jinja renders an assistant's `tool_calls` (tests/serving/test_tool_choice.py checks the
one against the other), so they need DeepSeek-V4's chat format and exclude another constraint in the same request.
A function's schema is checked as a `json` constraint's is (backend/structured/params.py): a keyword XGrammar would
not enforce is refused.
"""

from __future__ import annotations

import json
from typing import Any

from backend.errors import load_json
from backend.structured.params import GuidedDecoding, checked_json_schema

CHOICES = ("auto", "none", "required")
_EXPECTED = 'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}'


def parse_tool_choice(text: str) -> Any:
    """The `tool_choice` input's text: JSON ("required", {"type": "function", ...}), or one of CHOICES as a bare
    word."""
    if text.strip() in CHOICES:
        return text.strip()
    try:
        return load_json(text, "tool_choice")
    except ValueError:
        raise ValueError(f"{_EXPECTED} (as JSON, or one of the words bare), got {text[:200]!r}") from None


def checked_tool_choice(tool_choice: Any, tools: list[dict] | None) -> str | dict:
    """A request's tool_choice, given its checked tools (backend/chat.py `checked_tools`; None: none): one of CHOICES,
    or {"type": "function", "function": {"name": ...}} naming one of the tools. None is "auto"."""
    if tool_choice is None:
        return "auto"
    names = [tool["function"]["name"] for tool in tools or []]
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ValueError(f"{_EXPECTED}, got {tool_choice!r}")
        if tool_choice == "required" and not names:
            raise ValueError('tool_choice "required" needs tools to call: give the tools input')
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(function, dict) or tool_choice.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)):
        raise ValueError(f"{_EXPECTED}, got {json.dumps(tool_choice)[:200]}")
    if function["name"] not in names:
        raise ValueError(f"tool_choice names the function {function['name']!r}, which is not among the tools "
                         f"({', '.join(map(repr, names)) or 'none given'})")
    return {"type": "function", "function": {"name": function["name"]}}


def shown_tools(tool_choice: str | dict, tools: list[dict] | None) -> list[dict] | None:
    """The tools the prompt shows: none for "none", else all of them."""
    return None if tool_choice == "none" else tools


def tool_call_constraint(tool_choice: str | dict, tools: list[dict] | None, thinking: bool) -> GuidedDecoding | None:
    """The output constraint of a checked tool_choice on DeepSeek-V4's chat format: None for "auto" and "none"; else
    the structural tag of its calls, after the reasoning where the prompt asks for one (`thinking`: it ends with
    <think>)."""
    if tool_choice in ("auto", "none"):
        return None
    import xgrammar as xgr

    called = tools if tool_choice == "required" else [t for t in tools if t["function"]["name"] ==
                                                      tool_choice["function"]["name"]]
    for tool in called:
        checked_json_schema(tool["function"].get("parameters", {"type": "object", "properties": {}}),
                            f"the parameters of tool {tool['function']['name']!r}")
    try:
        tag = xgr.get_model_structural_tag("deepseek_v4", tools=called, tool_choice=tool_choice,
                                           reasoning="enabled" if thinking else "disabled",
                                           max_whitespace_cnt=1)
    except ValueError as exc:  # (XGrammar's own checks of the tools, pydantic's)
        raise ValueError(f"the tools cannot be constrained for tool_choice: {exc}") from None
    return GuidedDecoding("structural_tag", tag.model_dump_json())
