"""Tools on the chat endpoint: checking ``tools`` / ``tool_choice``, what the chat template sees, the
grammar that enforces ``required`` and a named function, and the tool calls of an output.

``tool_choice`` (vLLM's rules):
- ``none``: tools are shown to the template, the output is plain content.
- ``auto`` (the default when tools are given): the model decides; its text is parsed by the server's
  ``--tool-call-parser``. Needs ``--enable-auto-tool-choice`` (400 otherwise, as vLLM).
- ``required``: the output is forced (grammar) to a JSON array of ``{"name", "parameters"}`` objects,
  one or more calls of the given tools; each becomes a tool call (streamed call by call,
  ``tool_parsers.RequiredStream``).
- ``{"type": "function", "function": {"name": N}}``: the output is forced to N's ``parameters`` schema
  and is the call's arguments.
``finish_reason`` is ``tool_calls`` when the output holds calls (and did not run out of tokens).

Templates that never mention ``tools`` (the built-in SmolLM2's) get the tools described in a system
message in the Hermes format, so the model can answer with ``<tool_call>`` blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem.errors import RequestError
from tandem.server.tool_parsers import (
    DeltaToolCall,
    HermesStream,
    HermesToolParser,
    RequiredStream,
    ToolCall,
    arguments_delta,
    get_tool_parser,
    header_delta,
    make_call,
    tool_call_id,
)
from tandem.structured.params import StructuredOutputsParams


class ToolError(RequestError):
    pass


@dataclass(frozen=True)
class ToolConfig:
    """The server's tool settings (``--tool-call-parser``, ``--enable-auto-tool-choice``)."""

    parser: str | None = None
    enable_auto_tool_choice: bool = False


@dataclass(frozen=True)
class ToolMode:
    """What one request asked: ``kind`` is none | auto | required | named (``name`` set)."""

    kind: str
    tools: tuple[dict[str, Any], ...] = ()
    name: str | None = None
    parser: HermesToolParser | None = None

    def schema(self) -> StructuredOutputsParams | None:
        """The grammar of ``required`` / named; None for auto / none."""
        if self.kind == "named":
            return StructuredOutputsParams(json=_parameters(self._function(self.name)))
        if self.kind == "required":
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                      "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                     "parameters": _parameters(f)}}
                     for f in (t["function"] for t in self.tools)]
            return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})
        return None

    def _function(self, name: str | None) -> dict[str, Any]:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output."""
        if self.kind == "named":
            return None, [make_call(self.name or "", text)]
        if self.kind == "required":
            try:
                items = json.loads(text)
                calls = [make_call(c["name"], c.get("parameters", {})) for c in items]
            except (ValueError, TypeError, KeyError):
                return text, []  # cut short (length): not a complete array
            raw = _joined(RequiredStream().feed(text))  # the parameters as written (what streaming sends)
            if len(raw) == len(calls) and all(json.loads(a) == json.loads(c.function.arguments)
                                              for (_, a), c in zip(raw, calls)):
                for (_, a), c in zip(raw, calls):
                    c.function.arguments = a
            return None, calls
        if self.kind == "auto" and self.parser is not None:
            return self.parser.extract(text)
        return text, []

    def stream(self) -> ToolStream:
        return ToolStream(self)


def _joined(deltas: list[DeltaToolCall]) -> list[tuple[str, str]]:
    """(name, arguments) per call of a list of streamed deltas."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        entry = calls.setdefault(d.index, ["", ""])
        if d.function is not None:
            entry[0] = d.function.name if d.function.name is not None else entry[0]
            entry[1] += d.function.arguments or ""
    return [(n, a) for _, (n, a) in sorted(calls.items())]


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def tool_mode(tools: list[dict[str, Any]] | None, tool_choice: Any, config: ToolConfig) -> ToolMode:
    """Check the request's tools and tool_choice against the server's settings (400 naming the field)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools", param="tool_choice")
        return ToolMode("none")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                            "'parameters': {...}}}}", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    names = [t["function"]["name"] for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolMode("none", tuple(tools))
    if choice == "auto":
        if not config.enable_auto_tool_choice or config.parser is None:
            raise ToolError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                            param="tool_choice")
        return ToolMode("auto", tuple(tools), parser=get_tool_parser(config.parser))
    if choice == "required":
        return ToolMode("required", tuple(tools))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ToolError(f"tool_choice names function {name!r}, which is not among the tools "
                            f"({', '.join(names)})", param="tool_choice")
        return ToolMode("named", tuple(tools), name=name)
    raise ToolError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                    "{'name': ...}}", param="tool_choice")


# ---- the chat template ----------------------------------------------------------------------------------
HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
    "about what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_messages(messages: list[dict[str, Any]], tools: tuple[dict[str, Any], ...], template: str | None
                      ) -> list[dict[str, Any]]:
    """Messages for a template that ignores ``tools``: the tools described in the system message."""
    if not tools or (template and "tools" in template):
        return messages
    text = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ---- streaming ------------------------------------------------------------------------------------------
class ToolStream:
    """One streamed choice's tool calls: ``feed`` text deltas, get (content delta, tool-call deltas)."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.hermes: HermesStream | None = mode.parser.stream() if mode.kind == "auto" and mode.parser else None
        self.required = RequiredStream() if mode.kind == "required" else None
        self.text = ""
        self.started = False
        self.has_calls = False

    def feed(self, delta: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        self.text += delta
        kind = self.mode.kind
        if self.hermes is not None:
            content, calls = self.hermes.feed(delta, finished)
            self.has_calls = self.hermes.has_calls
            return content, calls
        if kind == "named":
            out = []
            if not self.started:
                self.started = self.has_calls = True
                out.append(header_delta(0, tool_call_id(), self.mode.name or ""))
            if delta:
                out.append(arguments_delta(0, delta))
            return None, out
        if self.required is not None:
            out = self.required.feed(delta)
            self.has_calls = self.required.has_calls
            return None, out
        return delta, []
