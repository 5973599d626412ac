"""Tool-call parsers: a model's text → OpenAI ``tool_calls``, whole or as streaming deltas.

``--tool-call-parser NAME`` picks one (``TOOL_PARSERS``). ``hermes`` reads the Hermes / Qwen format::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is the message's content. ``extract`` parses a finished text; if any call is
not valid JSON with a ``name``, the whole text stays content (vLLM's behaviour). ``HermesStream``
parses while tokens arrive: content is released unless it may be the start of ``<tool_call>``; a
call's first delta carries its id, type and function name, the following ones chunks of its
``arguments`` JSON text (exactly the non-streamed arguments when concatenated).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, model_serializer


# ---- OpenAI shapes ----------------------------------------------------------------------------------
class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer
    def _drop_none(self) -> dict[str, Any]:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer
    def _drop_none(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
        if self.type is not None:
            out["type"] = self.type
        if self.function is not None:
            out["function"] = self.function.model_dump()
        return out


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: Any) -> ToolCall:
    """A ToolCall; ``arguments`` as JSON text (a str is taken as already JSON)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=tool_call_id(), function=FunctionCall(name=name, arguments=args))


def header_delta(index: int, call_id: str, name: str) -> DeltaToolCall:
    """A call's first streamed delta: id, type and name (arguments follow)."""
    return DeltaToolCall(index=index, id=call_id, type="function", function=DeltaFunctionCall(name=name, arguments=""))


def arguments_delta(index: int, text: str) -> DeltaToolCall:
    return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=text))


# ---- hermes ---------------------------------------------------------------------------------------------
START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)', re.DOTALL)


def _raw_arguments(body: str, obj: dict[str, Any]) -> Any:
    """The call's arguments as the model wrote them (what streaming sends), else the parsed value."""
    m = _HEAD.match(body)
    if m is not None:
        raw = body[m.end():].rstrip()
        raw = raw[:-1].rstrip() if raw.endswith("}") else raw
        try:
            if json.loads(raw) == obj.get("arguments"):
                return raw
        except ValueError:
            pass
    return obj.get("arguments", {})


def _call_object(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return obj


class HermesToolParser:
    name = "hermes"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished text."""
        if START not in text:
            return text, []
        calls = []
        for m in _CALL.finditer(text):
            obj = _call_object(m.group(1).strip())
            if obj is None:
                return text, []
            calls.append(make_call(obj["name"], _raw_arguments(m.group(1).strip(), obj)))
        content = _CALL.sub("", text).strip()
        return content or None, calls

    def stream(self) -> HermesStream:
        return HermesStream()


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class HermesStream:
    """Incremental parse of one choice's text (see the module docstring)."""

    text: str = ""
    pos: int = 0  # everything before pos has been emitted (as content or as a call)
    in_call: bool = False
    calls: list[str] = field(default_factory=list)  # ids of the calls started
    args_start: int = -1  # where the current call's arguments begin in text (-1: header not sent)
    args_sent: int = 0

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        """New text in; (content delta, tool-call deltas) out."""
        self.text += delta
        content: list[str] = []
        out: list[DeltaToolCall] = []
        while True:
            if not self.in_call:
                i = self.text.find(START, self.pos)
                if i < 0:
                    end = len(self.text) if finished else len(self.text) - _partial_suffix(self.text, START)
                    content.append(self.text[self.pos:max(self.pos, end)])
                    self.pos = max(self.pos, end)
                    break
                content.append(self.text[self.pos:i])
                self.pos, self.in_call, self.args_start, self.args_sent = i + len(START), True, -1, 0
                continue
            ended, unparsed = self._call_step(finished, out)
            content.append(unparsed)
            if not ended:
                break
        text = "".join(content)
        if self.calls:  # between and after calls: only whitespace is expected; drop it
            text = text if text.strip() else ""
        return text, out

    def _call_step(self, finished: bool, out: list[DeltaToolCall]) -> tuple[bool, str]:
        """Advance inside a call: (the call ended, text to send as content: a block that is no call)."""
        body_end = self.text.find(END, self.pos)
        closed = body_end >= 0 or finished
        stop = body_end if body_end >= 0 else len(self.text)
        body = self.text[self.pos:stop]
        index = len(self.calls) - (0 if self.args_start < 0 else 1)
        if self.args_start < 0:
            m = _HEAD.match(body)
            if m is not None:
                self.calls.append(tool_call_id())
                out.append(header_delta(index, self.calls[-1], json.loads(f'"{m.group(1)}"')))
                self.args_start = self.pos + m.end()
            elif closed:
                obj = _call_object(body.strip())
                start = self.pos - len(START)
                self._close(stop)
                if obj is None:  # not a call: its text is content
                    return True, self.text[start:self.pos]
                self.calls.append(tool_call_id())  # name after arguments, or no arguments: one piece
                out.append(header_delta(index, self.calls[-1], obj["name"]))
                out.append(arguments_delta(index, json.dumps(obj.get("arguments", {}), ensure_ascii=False)))
                return True, ""
            else:
                return False, ""
        raw = self.text[self.args_start:stop]
        if closed:
            final = raw.rstrip()
            final = final[:-1].rstrip() if final.endswith("}") else final  # the call object's own brace
            if final[self.args_sent:]:
                out.append(arguments_delta(index, final[self.args_sent:]))
            self._close(stop)
            return True, ""
        safe = raw[:len(raw) - _partial_suffix(raw, END)].rstrip(" \t\r\n}")
        if len(safe) > self.args_sent:
            out.append(arguments_delta(index, safe[self.args_sent:]))
            self.args_sent = len(safe)
        return False, ""

    def _close(self, stop: int) -> None:
        self.pos = min(len(self.text), stop + len(END)) if self.text.startswith(END, stop) else stop
        self.in_call, self.args_start, self.args_sent = False, -1, 0


TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> HermesToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; available: {', '.join(TOOL_PARSERS)}") from None


# ---- tool_choice "required": a JSON array of {"name", "parameters"} (forced by the grammar) ---------------
_REQ_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*(?=\S)', re.DOTALL)


@dataclass
class RequiredStream:
    """Incremental parse of ``[{"name": ..., "parameters": {...}}, ...]`` (keys in that order, as the
    grammar of ``tool_choice: required`` writes them): a call's header once its name is complete, then
    chunks of its ``parameters`` text, holding back trailing ``}`` / whitespace until the call closes."""

    text: str = ""
    scan: int = 0
    depth: int = 0
    in_str: bool = False
    esc: bool = False
    obj_start: int = -1  # the open call object's "{" (-1: none open)
    args_start: int = -1  # where its parameters begin (-1: header not sent)
    args_sent: int = 0
    calls: list[str] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str) -> list[DeltaToolCall]:
        self.text += delta
        out: list[DeltaToolCall] = []
        for i in range(self.scan, len(self.text)):
            ch = self.text[i]
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
                continue
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
                if ch == "{" and self.depth == 2:
                    self.obj_start, self.args_start, self.args_sent = i, -1, 0
            elif ch in "}]":
                if ch == "}" and self.depth == 2 and self.obj_start >= 0:
                    self._header(i, out)
                    if self.args_start >= 0:
                        final = self.text[self.args_start:i].rstrip()
                        if final[self.args_sent:]:
                            out.append(arguments_delta(len(self.calls) - 1, final[self.args_sent:]))
                    self.obj_start = -1
                self.depth -= 1
        self.scan = len(self.text)
        if self.obj_start >= 0:
            self._header(len(self.text), out)
            if self.args_start >= 0:
                safe = self.text[self.args_start:].rstrip(" \t\r\n}")
                if len(safe) > self.args_sent:
                    out.append(arguments_delta(len(self.calls) - 1, safe[self.args_sent:]))
                    self.args_sent = len(safe)
        return out

    def _header(self, end: int, out: list[DeltaToolCall]) -> None:
        if self.args_start >= 0:
            return
        m = _REQ_HEAD.match(self.text, self.obj_start, end)
        if m is not None:
            self.calls.append(tool_call_id())
            out.append(header_delta(len(self.calls) - 1, self.calls[-1], json.loads(f'"{m.group(1)}"')))
            self.args_start = m.end()
