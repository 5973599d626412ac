"""A request's structured-output fields → one :class:`StructuredOutputsParams`.

Accepted on completions and chat (as vLLM): ``structured_outputs`` (``{"json" | "regex" | "choice" |
"grammar" | "json_object": ...}``), the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, and OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with
``json_schema.schema``). At most one of them may be given; a bad schema, regex or grammar is a 400
whose ``param`` is the request field that carried it.
"""

from __future__ import annotations

from typing import Any

from tandem.errors import RequestError, SamplingParamsError
from tandem.structured.params import StructuredOutputsParams, coerce

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredRequestError(RequestError):
    pass


def _response_format(rf: dict[str, Any]) -> dict[str, Any] | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
        if schema is None:
            raise StructuredRequestError("response_format of type json_schema needs json_schema.schema",
                                         param="response_format")
        return {"json": schema}
    raise StructuredRequestError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                                 param="response_format")


def structured_outputs_of(fields: dict[str, Any]) -> StructuredOutputsParams | None:
    """``fields``: the request's structured_outputs, guided_*, response_format values (None = absent)."""
    given: list[tuple[str, Any]] = []
    if fields.get("structured_outputs") is not None:
        given.append(("structured_outputs", fields["structured_outputs"]))
    for name, kind in GUIDED.items():
        if fields.get(name) is not None:
            given.append((name, {kind: fields[name]}))
    rf = fields.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise StructuredRequestError("response_format must be an object", param="response_format")
        spec = _response_format(rf)
        if spec is not None:
            given.append(("response_format", spec))
    if not given:
        return None
    if len(given) > 1:
        raise StructuredRequestError(f"give at most one of {', '.join(n for n, _ in given)}", param=given[1][0])
    name, value = given[0]
    try:
        return coerce(value)
    except SamplingParamsError as e:
        detail = str(e).split(": ", 1)[1] if ": " in str(e) else str(e)
        raise StructuredRequestError(f"{name}: {detail}", param=name) from None
