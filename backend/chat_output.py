"""A DeepSeek-V4 answer split as it streams into its reasoning, its content and its tool calls (what DeepSeek's
`parse_message_from_completion_text` reads from a whole answer, and vLLM's reasoning and tool-call parsers return):

    parser = AnswerParser(thinking=prompt_text.endswith("<think>"))   # tool_calls=False: no calls read
    part = parser.feed(text_delta)      # AnswerPart(reasoning="...", content="...", tool_calls=[...])
    part = parser.finish()              # what was held back; an unfinished tool-call block as content

In thinking mode the answer is its reasoning up to `</think>`, then its content; in chat mode (the prompt ended with
`</think>`) only content. Content ends where a DSML block of tool calls starts (`\\n\\n<｜DSML｜tool_calls>`); each
`<｜DSML｜invoke name="...">` in it is a call, each `<｜DSML｜parameter name="..." string="true|false">` an argument: a
string as it is, else JSON (as DeepSeek's `decode_dsml_to_arguments`). Calls come out in OpenAI's form,
{"id", "type": "function", "function": {"name", "arguments": a JSON string}}, when their block closes. Text that may
be the start of a marker is held back until the next delta tells (or the end). A block that does not parse, or is
cut off by the end of the answer, comes out as content, as it was written: nothing the model wrote is lost.

Where DeepSeek's parser is strict this one is lenient, and says so: a block without the blank line before it,
whitespace between its tags, text after it (content), and a value marked JSON that is not (kept as a string). A value
that itself holds `</｜DSML｜invoke>` or the block's end marker is read as ending there (DeepSeek's parser reads a value
up to its own end tag), so such a block comes out as content.

The markers are read from the text: `<think>`, `</think>` and `｜DSML｜` are tokens that are not special in DeepSeek's
tokenizers, so the detokenized text keeps them.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field

# Where an answer starts, as a DeepSeek-V4 prompt ends: reasoning first (thinking mode), or the answer at once
THINK_START, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
CALLS_START = f"<{DSML}tool_calls>"
CALLS_END = f"</{DSML}tool_calls>"
CALLS_LEAD = "\n\n"  # what DeepSeek's format writes between an answer's content and its tool calls

_INVOKE = re.compile(rf'\s*<{DSML}invoke name="(?P<name>.*?)">', re.DOTALL)
_INVOKE_END = re.compile(rf"\s*</{DSML}invoke>")
_PARAMETER = re.compile(rf'\s*<{DSML}parameter name="(?P<name>.*?)" string="(?P<string>true|false)">', re.DOTALL)
PARAMETER_END = f"</{DSML}parameter>"


@dataclass
class AnswerPart:
    """What one delta of the answer adds to each part."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


class AnswerParser:
    def __init__(self, thinking: bool, tool_calls: bool = True, first_call_only: bool = False):
        """`tool_calls` False (tool_choice "none"): a tool-call block is content, as the model wrote it.
        `first_call_only` (parallel_tool_calls false): the answer's first call, the others dropped, as vLLM does."""
        self._mode = "reasoning" if thinking else "content"
        self._reads_calls = tool_calls
        self._first_call_only = first_call_only
        self._held = ""  # text not yet given to a part (a marker's possible start, or an open tool-call block)
        self._ending = False  # finish(): a block whose parameter value never closed ends at its first end tag
        self._lead = ""  # the open block's lead (CALLS_LEAD, if the model wrote one)
        self.called = False  # whether the answer made tool calls

    def feed(self, delta: str) -> AnswerPart:
        part = AnswerPart()
        self._held += delta
        while True:
            if self._mode == "reasoning":
                if not self._take_until(THINK_END, part, "reasoning", next_mode="content"):
                    return part
            elif self._mode == "content":
                if not self._reads_calls:
                    part.content, self._held = part.content + self._held, ""
                    return part
                if not self._take_until(CALLS_START, part, "content", next_mode="calls"):
                    return part
            else:
                end = self._held.find(CALLS_END) if self._ending else _block_end(self._held)
                if end < 0:
                    return part
                block, self._held = self._held[:end], self._held[end + len(CALLS_END):]
                calls = parse_tool_calls(block)
                if calls is None:  # not DeepSeek's form: the model's text, as written
                    part.content += self._lead + CALLS_START + block + CALLS_END
                else:
                    if self._first_call_only:
                        calls = calls[:0 if self.called else 1]
                    part.tool_calls += calls
                    self.called = self.called or bool(calls)
                self._mode = "content"

    def finish(self) -> AnswerPart:
        """The end of the answer: what was held back goes to the part it was in (an open block as content). A block
        held back for a parameter value that never closed is read as ending at its first end tag, as before the value
        was seen, so that the text and blocks after it are read too."""
        self._ending = True
        part = self.feed("")
        if self._mode == "reasoning":
            part.reasoning += self._held
        elif self._mode == "content":
            part.content += self._held
        else:
            part.content += self._lead + CALLS_START + self._held
        self._held = ""
        return part

    def _take_until(self, marker: str, part: AnswerPart, name: str, next_mode: str) -> bool:
        """Move the held text before `marker` to the part `name`; True (and the next mode) if the marker was there,
        else False with a possible start of the marker still held."""
        at = self._held.find(marker)
        if at < 0:
            keep = _possible_start(self._held, marker)
            if name == "content":  # (the block's lead too: it is not content when a block follows it)
                keep = max(keep, _possible_start(self._held, CALLS_LEAD + marker))
            setattr(part, name, getattr(part, name) + self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
            return False
        text = self._held[:at]
        if name == "content":
            self._lead = CALLS_LEAD if text.endswith(CALLS_LEAD) else ""
            text = text[:len(text) - len(self._lead)]
        setattr(part, name, getattr(part, name) + text)
        self._held = self._held[at + len(marker):]
        self._mode = next_mode
        return True


def parse_tool_calls(block: str) -> list[dict] | None:
    """The calls of a DSML block (the text between <｜DSML｜tool_calls> and its end) in OpenAI's form (none for an
    empty block); None if the block is not a sequence of invokes of parameters. A parameter's value is everything up
    to its own end marker, as DeepSeek's parser reads it (a value may hold the block's other markers)."""
    calls, at = [], 0
    while block[at:].strip():
        invoke = _INVOKE.match(block, at)
        if invoke is None:
            return None
        arguments, at = {}, invoke.end()
        while (closed := _INVOKE_END.match(block, at)) is None:
            parameter = _PARAMETER.match(block, at)
            end = block.find(PARAMETER_END, parameter.end()) if parameter is not None else -1
            if end < 0 or parameter["name"] in arguments:
                return None
            arguments[parameter["name"]] = _argument(block[parameter.end():end], parameter["string"] == "true")
            at = end + len(PARAMETER_END)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": invoke["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
        at = closed.end()
    return calls


def _block_end(text: str) -> int:
    """Where the tool-call block that `text` continues ends (its end marker), -1 while it has not come: the first end
    marker outside a parameter's value (a value may hold it, and ends only at its own end marker)."""
    at = 0
    while True:
        end, value = text.find(CALLS_END, at), _PARAMETER.search(text, at)
        if value is None or end < value.start():
            return end
        closed = text.find(PARAMETER_END, value.end())
        if closed < 0:
            return -1
        at = closed + len(PARAMETER_END)


def _argument(value: str, string: bool):
    if string:
        return value
    try:
        parsed = json.loads(value, parse_constant=_not_json, parse_float=_finite)
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")  # (a lone surrogate's escape: no UTF-8 to send)
        return parsed
    except (ValueError, RecursionError):  # (DeepSeek's decoder would write it into the JSON as it is: keep it, as a
        # string; so too what Python reads but JSON has not (NaN, Infinity, 1e999), what nests too deeply, and a
        # lone surrogate's escape)
        return value


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # (1e999 is read as inf, which JSON cannot write)
        raise ValueError(f"{text} is past a float's range")
    return value


def _possible_start(text: str, marker: str) -> int:
    """The length of the longest end of `text` that `marker` starts with (a marker that may be arriving)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
