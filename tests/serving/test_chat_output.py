"""backend/chat_output.py: a DeepSeek-V4 answer split into reasoning, content and tool calls as it streams, the
inverse of how DeepSeek's format writes an answer (deepseek_v4_chat.jinja)."""

from __future__ import annotations

import json
import random

import pytest

from backend.chat import BOS, DEEPSEEK_V4_TEMPLATE, EOS, ChatTemplate
from backend.chat_output import AnswerParser

D = "｜DSML｜"
TEMPLATE = ChatTemplate(DEEPSEEK_V4_TEMPLATE.read_text(), BOS, EOS, deepseek_v4_format=True)
# Text that comes close to the markers without being one: it must pass through whole.
PIECES = ["Sun", " and rain", "\n", "\n\n", "<", "</", "</thin", "<think", "think>", "\n\n<", f"<{D}", f"\n\n<{D}tool",
          "tool_calls>", "ü", "{\"a\": 1}", " "]
VALUES = ["Oslo", "3", "", "line\nbreak", 7, 2.5, True, None, [1, "x"], {"k": {"n": [False]}}]


def parts(answer: str, thinking: bool, cuts: list[int]) -> tuple[str, str, list[dict]]:
    """The answer fed in pieces cut at `cuts`: its reasoning, content and calls (name, arguments as objects)."""
    parser, reasoning, content, calls = AnswerParser(thinking), "", "", []
    for start, end in zip([0, *cuts], [*cuts, len(answer)]):
        for part in (parser.feed(answer[start:end]),):
            reasoning, content, calls = reasoning + part.reasoning, content + part.content, calls + part.tool_calls
    last = parser.finish()  # (calls too, where a block waited for a parameter value that never closed)
    calls += last.tool_calls
    return (reasoning + last.reasoning, content + last.content,
            [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in calls])


def random_cuts(rng, text: str) -> list[int]:
    return sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []


@pytest.mark.parametrize("seed", range(4))
def test_an_answer_written_in_deepseeks_format_parses_back_whatever_the_pieces_it_streams_in(seed):
    """An assistant message rendered by the chat template (reasoning, content, tool calls with every kind of
    argument), taken back out of the prompt and fed in random pieces, one character at a time, and whole: the same
    reasoning, content and calls each time."""
    rng = random.Random(seed)
    for _ in range(40):
        reasoning, content = ("".join(rng.choices(PIECES, k=rng.randint(0, 6))) for _ in range(2))
        if "</think>" in reasoning or any(f"<{D}tool_calls>" in text for text in (reasoning, content)):
            continue  # (the pieces spelled a marker: not text DeepSeek's format can carry)
        calls = [{"name": rng.choice(["weather", "search"]),
                  "arguments": {f"p{j}": rng.choice(VALUES) for j in range(rng.randint(0, 3))}}
                 for _ in range(rng.randint(0, 3))]
        message = {"role": "assistant", "content": content, "reasoning_content": reasoning,
                   "tool_calls": [{"type": "function", "function": {"name": c["name"],
                                                                    "arguments": json.dumps(c["arguments"])}}
                                  for c in calls]}
        thinking = rng.random() < 0.5
        prompt = TEMPLATE.render([{"role": "user", "content": "Q"}, message], {"thinking": thinking})
        lead = "<｜Assistant｜>" + ("<think>" if thinking else "</think>")
        answer = prompt.split(lead, 1)[1].removesuffix(EOS)
        expected = (reasoning if thinking else "", content, calls)
        if not thinking:  # (chat mode writes no reasoning, and nothing splits content from a reasoning-like text)
            assert answer.startswith(content)
        for cuts in (random_cuts(rng, answer), list(range(1, len(answer))), []):
            assert parts(answer, thinking, cuts) == expected, (answer, cuts)


@pytest.mark.parametrize("answer,thinking,expected", [
    ("all thought, cut off", True, ("all thought, cut off", "", [])),  # the end came before </think>
    ("Plain answer </th", False, ("", "Plain answer </th", [])),  # a marker's start that never finished
    ("no lead</think>x", False, ("", "no lead</think>x", [])),  # chat mode: </think> is content
    (f"Ok.<{D}tool_calls>\n<{D}invoke name=\"f\">\n</{D}invoke>\n</{D}tool_calls>", False,  # no lead, no arguments
     ("", "Ok.", [{"name": "f", "arguments": {}}])),
    (f"A\n\n<{D}tool_calls>\n<{D}invoke name=\"f\">\nbroken</{D}invoke>\n</{D}tool_calls> after", False,
     ("", f"A\n\n<{D}tool_calls>\n<{D}invoke name=\"f\">\nbroken</{D}invoke>\n</{D}tool_calls> after", [])),
    (f"Ok.\n\n<{D}tool_calls>\n</{D}tool_calls>", False, ("", "Ok.", [])),  # an empty block: no calls
    (f"<{D}tool_calls>\n<{D}invoke name=\"say \"hi\"\">\n<{D}parameter name=\"a\"b\" string=\"true\">x</{D}parameter>\n"
     f"</{D}invoke>\n</{D}tool_calls>", False, ("", "", [{"name": 'say "hi"', "arguments": {'a"b': "x"}}])),
    (f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n</{D}invoke>\nmore</{D}tool_calls>", False,
     ("", f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n</{D}invoke>\nmore</{D}tool_calls>", [])),
    (f"A\n\n<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"false\">[1, 2", False,
     ("", f"A\n\n<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"false\">[1, 2", [])),
    (f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"false\">not json</{D}parameter>"
     f"\n</{D}invoke>\n</{D}tool_calls>", False, ("", "", [{"name": "f", "arguments": {"x": "not json"}}])),
    *[(f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"false\">{value}</{D}parameter>"
       f"\n</{D}invoke>\n</{D}tool_calls>", False, ("", "", [{"name": "f", "arguments": {"x": value}}]))
      # (Python reads NaN, Infinity and 1e999 as floats JSON has not; a lone surrogate's escape has no UTF-8 to send;
      # the last nests deeper than the parser goes)
      for value in ("NaN", "-Infinity", "1e999", '{"y": -2e400}', '{"s": "\\ud800"}', "[" * 2_000)],
    (f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"true\">1</{D}parameter>\n"
     f"<{D}parameter name=\"x\" string=\"true\">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>", False,
     ("", f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"true\">1</{D}parameter>\n"
          f"<{D}parameter name=\"x\" string=\"true\">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>", [])),
])
def test_what_is_not_deepseeks_form_stays_text_in_the_part_it_was_written_in(answer, thinking, expected):
    """An answer cut off in its reasoning, a marker's start that never finishes, a block that is not invokes of
    parameters (text in it, an unclosed one, a parameter given twice): nothing the model wrote is lost; a value
    marked JSON that is not is kept as a string, as DeepSeek's decoder keeps it in its text."""
    for cuts in ([], list(range(1, len(answer)))):
        assert parts(answer, thinking, cuts) == expected


def test_a_parameter_value_may_hold_the_blocks_other_markers():
    """A value ends only at its own end marker, as DeepSeek's parser reads it: one holding the block's or an invoke's
    end marker (which tool_choice's grammar lets a string hold) is still the call's argument, fed whole or in
    pieces (before, the block ended inside the value and the whole block came back as content)."""
    for marker in (f"</{D}tool_calls>", f"</{D}invoke>", f"<{D}tool_calls>"):
        answer = (f"Ok.\n\n<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"a\" string=\"true\">"
                  f"x{marker}y</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")
        for cuts in ([], list(range(1, len(answer)))):
            assert parts(answer, False, cuts) == ("", "Ok.", [{"name": "f", "arguments": {"a": f"x{marker}y"}}])


def test_a_parameter_value_that_never_closes_holds_its_block_only_until_the_end():
    """An unclosed value: its block waits (the value might still hold the end tag), and at the answer's end it is read
    as ending at its first end tag, so the text and the block after it come back as they did before values were
    read whole: the broken block as content, the later call as a call."""
    broken = f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"a\" string=\"true\">x\n</{D}tool_calls>"
    later = f"<{D}tool_calls>\n<{D}invoke name=\"g\">\n</{D}invoke>\n</{D}tool_calls>"
    answer = f"hi{broken} then{later}"
    for cuts in ([], list(range(1, len(answer)))):
        assert parts(answer, False, cuts) == ("", f"hi{broken} then", [{"name": "g", "arguments": {}}])
