"""StructuredOutputsParams: what a request's output must match (vLLM's names and semantics).

Exactly one of ``json`` (a JSON schema, as a dict or a JSON string), ``regex``, ``choice`` (a list of
strings), ``grammar`` (xgrammar EBNF with a ``root`` rule) or ``json_object`` (any JSON object) is set.
Construction checks the constraint itself (the schema is JSON and xgrammar can convert it, the regex
and the grammar parse) and raises :class:`SamplingParamsError` naming the field — before the request
reaches the engine. Compiling against a tokenizer happens once at request admission
(``structured/compiler.py``); ``key`` is what compiled grammars are cached under.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

from tandem.errors import SamplingParamsError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_WHITESPACE = 12  # consecutive whitespace characters a JSON grammar allows (no endless whitespace runs)


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # vLLM's option: JSON without free whitespace

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise SamplingParamsError("structured_outputs.choice", "must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is False:
            object.__setattr__(self, "json_object", None)
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs", f"exactly one of {', '.join(KINDS)} must be set, got "
                f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as e:
                    raise SamplingParamsError("structured_outputs.json", f"the schema is not valid JSON: {e}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise SamplingParamsError("structured_outputs.json", "the schema must be a JSON object")
        for name, kind in (("regex", "regex"), ("grammar", "grammar")):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise SamplingParamsError(f"structured_outputs.{name}", f"must be a non-empty {kind} string")
        self.to_grammar()  # parses: a bad schema / regex / grammar fails here, naming its field

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple[str, str, bool]:
        """Canonical, hashable description: equal constraints share one compiled grammar."""
        kind = self.kind
        if kind == "json":
            v = self.json if isinstance(self.json, str) else _json.dumps(self.json, sort_keys=True)
            v = _json.dumps(_json.loads(v), sort_keys=True)
        elif kind == "choice":
            v = _json.dumps(list(self.choice or ()))
        elif kind == "json_object":
            v = ""
        else:
            v = getattr(self, kind)
        return kind, v, self.disable_any_whitespace

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputsParams) and self.key == other.key

    def to_grammar(self) -> Any:
        """The constraint as an ``xgrammar.Grammar`` (no tokenizer needed); SamplingParamsError if it does
        not parse."""
        import xgrammar

        kind = self.kind
        ws = dict(any_whitespace=not self.disable_any_whitespace,
                  max_whitespace_cnt=None if self.disable_any_whitespace else MAX_WHITESPACE)
        try:
            if kind == "json":
                schema = self.json if isinstance(self.json, str) else _json.dumps(self.json)
                return xgrammar.Grammar.from_json_schema(schema, **ws)
            if kind == "json_object":
                return xgrammar.Grammar.from_json_schema('{"type": "object"}', **ws)
            if kind == "regex":
                return xgrammar.Grammar.from_regex(self.regex)
            if kind == "choice":
                alts = " | ".join(_ebnf_literal(c) for c in self.choice or ())
                return xgrammar.Grammar.from_ebnf(f"root ::= {alts}")
            return xgrammar.Grammar.from_ebnf(self.grammar)
        except RuntimeError as e:
            raise SamplingParamsError(f"structured_outputs.{kind}", f"invalid {kind}: {_xgrammar_message(e)}") from None


def _ebnf_literal(s: str) -> str:
    """An EBNF string literal matching exactly ``s`` (empty strings as ``""``)."""
    return _json.dumps(s, ensure_ascii=False)


def _xgrammar_message(e: BaseException) -> str:
    """xgrammar's error text without its source-location prefix ``[time] file.cc:line: ``."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
        head, sep, rest = text.partition(": ")
        if sep and (".cc:" in head or ".h:" in head):
            text = rest
    return text


def coerce(value: Any) -> StructuredOutputsParams | None:
    """``structured_outputs=`` as a StructuredOutputsParams, a dict of its fields, or None."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(KINDS) - {"disable_any_whitespace"})
        if unknown:
            raise SamplingParamsError("structured_outputs", f"unknown field(s) {', '.join(unknown)}; "
                                      f"allowed: {', '.join(KINDS)}, disable_any_whitespace")
        return StructuredOutputsParams(**value)
    raise SamplingParamsError("structured_outputs", "must be a StructuredOutputsParams or a dict of its fields, "
                              f"got {type(value).__name__}")
