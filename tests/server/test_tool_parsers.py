"""The hermes tool-call parser: whole texts and every way of cutting them into streamed deltas."""

from __future__ import annotations

import json
import random

import pytest

from tandem.server.tool_parsers import HermesToolParser, get_tool_parser
from tandem.server.tools import ToolConfig, ToolError, tool_mode

TEXTS = [
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris}", "n": [1, {"a": 2}]}}\n</tool_call>',
    '<tool_call>{"name":"a","arguments":{}}</tool_call>\n<tool_call>{"arguments": {"x": 1}, "name": "b"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"q": "</tool"}}',  # no closing tag (stopped at EOS)
    '<tool_call>{"name": "g\\"q", "arguments": "text"}</tool_call>',
]


def test_extract() -> None:
    p = HermesToolParser()
    content, calls = p.extract(TEXTS[0])
    assert content == "Sure." and [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris}", "n": [1, {"a": 2}]}
    content, calls = p.extract(TEXTS[1])
    assert content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("a", {}), ("b", {"x": 1})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert p.extract("plain < text <tool") == ("plain < text <tool", [])
    broken = '<tool_call>{"name": broken</tool_call>'
    assert p.extract(broken) == (broken, [])
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("mistral")


@pytest.mark.parametrize("text", TEXTS)
def test_stream_deltas_join_to_the_extracted_calls(text: str) -> None:
    p = HermesToolParser()
    content, calls = p.extract(text)
    rng = random.Random(0)
    for trial in range(60):
        s = p.stream()
        got: dict[int, dict] = {}
        streamed = ""
        i = 0
        while i < len(text):
            j = len(text) if trial == 0 else min(len(text), i + rng.randint(1, 5))
            c, deltas = s.feed(text[i:j], j == len(text))
            streamed += c
            for d in deltas:
                if d.index not in got:
                    assert d.id and d.type == "function" and d.function.name is not None
                    got[d.index] = {"name": d.function.name, "args": d.function.arguments or ""}
                else:
                    assert d.id is None and d.function.name is None
                    got[d.index]["args"] += d.function.arguments
            i = j
        assert [g["name"] for _, g in sorted(got.items())] == [c.function.name for c in calls]
        assert [g["args"] for _, g in sorted(got.items())] == [c.function.arguments for c in calls]
        assert streamed.strip() == (content or "")


def test_plain_text_streams_unchanged_except_a_possible_tag() -> None:
    s = HermesToolParser().stream()
    assert s.feed("hello <to", False) == ("hello ", [])
    assert s.feed("day", False) == ("<today", [])
    assert s.feed(" <", True) == (" <", [])


def test_tool_choice_rules() -> None:
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(ToolError, match="enable-auto-tool-choice"):
        tool_mode([fn], None, ToolConfig())
    assert tool_mode([fn], None, ToolConfig("hermes", True)).kind == "auto"
    assert tool_mode([fn], "none", ToolConfig()).schema() is None
    named = tool_mode([fn], {"type": "function", "function": {"name": "f"}}, ToolConfig())
    assert named.schema().json == {"type": "object"} and named.extract('{"a": 1}')[1][0].function.name == "f"
    required = tool_mode([fn], "required", ToolConfig())
    assert required.schema().json["minItems"] == 1
    _, calls = required.extract('[{"name": "f", "parameters": {"a": 1}}]')
    assert calls[0].function.arguments == '{"a": 1}'
    for bad, param in [([{"type": "x"}], "tools"), ([fn], "sometimes"), (None, "required")]:
        with pytest.raises(ToolError) as e:
            tool_mode(bad, param if param != "tools" else None, ToolConfig("hermes", True))
        assert e.value.param in ("tools", "tool_choice")


def test_a_block_that_is_no_call_streams_as_content() -> None:
    text = 'x <tool_call>{"name": broken</tool_call> y'
    for cut in range(1, len(text)):
        s = HermesToolParser().stream()
        a, da = s.feed(text[:cut], False)
        b, db = s.feed(text[cut:], True)
        assert a + b == text and not da and not db


@pytest.mark.parametrize("text", [
    '[{"name": "f", "parameters": {"a": "}]", "b": [1, {"c": 2}]}}, {"name":"g","parameters":{}}]',
    '[ {\n "name" : "f\\"x" ,\n "parameters" : { "q" : "\\\\" }\n } ]',
])
def test_required_stream_deltas_join_to_the_calls(text: str) -> None:
    fn = [{"type": "function", "function": {"name": n}} for n in ("f", "g", 'f"x')]
    mode = tool_mode(fn, "required", ToolConfig())
    _, calls = mode.extract(text)
    assert calls and [json.loads(c.function.arguments) for c in calls] == [c["parameters"] for c in json.loads(text)]
    rng = random.Random(1)
    for trial in range(40):
        s = mode.stream()
        got: dict[int, dict] = {}
        i = 0
        while i < len(text):
            j = len(text) if trial == 0 else min(len(text), i + rng.randint(1, 4))
            content, deltas = s.feed(text[i:j], j == len(text))
            assert content is None
            for d in deltas:
                if d.index not in got:
                    assert d.id and d.function.name is not None
                    got[d.index] = {"name": d.function.name, "args": d.function.arguments or ""}
                else:
                    assert d.id is None and d.function.name is None
                    got[d.index]["args"] += d.function.arguments
            i = j
        assert [(g["name"], g["args"]) for _, g in sorted(got.items())] == [
            (c.function.name, c.function.arguments) for c in calls]
