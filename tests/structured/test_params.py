"""StructuredOutputsParams: exactly one constraint, each checked at construction (the error names it)."""

from __future__ import annotations

import pytest

from tandem.errors import SamplingParamsError
from tandem.sampling_params import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("kw, field", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": {"type": "nope"}}, "structured_outputs.json"),
    ({"json": [1, 2]}, "structured_outputs.json"),
    ({"regex": "a(b"}, "structured_outputs.regex"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"grammar": 'start ::= "a"'}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": "ab"}, "structured_outputs.choice"),
])
def test_bad_constraints_name_their_field(kw: dict, field: str) -> None:
    with pytest.raises(SamplingParamsError) as e:
        StructuredOutputsParams(**kw)
    assert e.value.field == field


def test_sampling_params_takes_a_dict_or_params() -> None:
    p = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert p.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    assert p == SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    hash(SamplingParams(structured_outputs={"json": {"type": "object"}}))
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs.choice == ("a", "b")
    with pytest.raises(SamplingParamsError, match="unknown field"):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(structured_outputs={"json": '{"type": 3}'})
    assert e.value.field == "structured_outputs.json"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(grammar='root ::= "x" | "y"').kind == "grammar"
