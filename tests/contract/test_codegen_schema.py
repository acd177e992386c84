"""shared/tools/codegen_schema.py on its own: names, and a nullable field accepts exactly what it did."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.tools.codegen_schema import name_inline_schemas, pascal

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)

primitive = st.one_of(
    st.fixed_dictionaries({"type": st.just("integer")},
                          optional={"minimum": st.integers(-100, 0), "maximum": st.integers(0, 100)}),
    st.fixed_dictionaries({"type": st.just("number")}, optional={"exclusiveMinimum": st.integers(-5, 5)}),
    st.fixed_dictionaries({"type": st.just("string")}, optional={"maxLength": st.integers(0, 5),
                                                                  "pattern": st.just("^[a-f0-9]*$")}),
    st.fixed_dictionaries({"type": st.just("boolean")}),
    st.fixed_dictionaries({"type": st.just("object")}, optional={"additionalProperties": st.booleans()}),
    st.fixed_dictionaries({"type": st.just("array"), "items": st.just({"type": "integer"})},
                          optional={"maxItems": st.integers(0, 3)}),
)


def _valid(schema: dict[str, Any], value: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


@settings(max_examples=200, deadline=None)
@given(inner=primitive, null_first=st.booleans(), extra=st.fixed_dictionaries(
    {}, optional={"default": st.none(), "description": st.just("d"), "title": st.just("Field")}), value=json_values)
def test_a_nullable_field_accepts_exactly_what_pydantic_said(inner: dict[str, Any], null_first: bool,
                                                              extra: dict[str, Any], value: Any) -> None:
    branches = [{"type": "null"}, inner] if null_first else [inner, {"type": "null"}]
    field = {"anyOf": branches, **extra}
    original = {"type": "object", "properties": {"f": copy.deepcopy(field)}, "required": ["f"]}
    schemas = name_inline_schemas({"M": copy.deepcopy(original)})
    merged = schemas["M"]["properties"]["f"]
    assert "anyOf" not in merged and merged["type"] == [inner["type"], "null"]
    assert _valid(original, {"f": value}) == _valid(schemas["M"], {"f": value})


def test_inline_types_are_named_after_model_and_field_and_components_after_their_key() -> None:
    schemas = name_inline_schemas({
        "PalmThing": {"title": "Palm Thing", "type": "object", "properties": {
            "mode": {"enum": ["a", "b"], "type": "string", "title": "Mode"},
            "limits": {"type": "array", "items": {"enum": ["x"], "title": "Limits"}},
            "by_name": {"type": "object", "additionalProperties": {"anyOf": [{"type": "integer"},
                                                                             {"type": "string"}]}},
            "info": {"anyOf": [{"$ref": "#/components/schemas/Info"}, {"type": "null"}], "title": "Info"},
            "count": {"type": "integer", "title": "Count"},
        }},
        "Info": {"type": "object", "properties": {"code": {"type": "string"}}},
    })
    props = schemas["PalmThing"]["properties"]
    assert schemas["PalmThing"]["title"] == "PalmThing" and schemas["Info"]["title"] == "Info"
    assert props["mode"]["title"] == "PalmThingMode"
    assert props["limits"]["items"]["title"] == "PalmThingLimitsItem"
    assert props["by_name"]["additionalProperties"]["title"] == "PalmThingByNameValue"
    assert props["info"]["title"] == "PalmThingInfo"  # a nullable reference stays a (named) union
    assert props["count"]["title"] == "Count"  # primitives keep pydantic's label


def test_a_generated_name_that_is_already_a_component_is_refused() -> None:
    with pytest.raises(ValueError, match="PalmThingMode"):
        name_inline_schemas({
            "PalmThing": {"type": "object", "properties": {"mode": {"enum": ["a"]}}},
            "PalmThingMode": {"type": "object", "properties": {}},
        })


@pytest.mark.parametrize("raw, name", [("set_speed", "SetSpeed"), ("epuck-gateway", "EpuckGateway"),
                                       ("image_info", "ImageInfo"), ("x", "X"), ("a__b", "AB")])
def test_pascal(raw: str, name: str) -> None:
    assert pascal(raw) == name
