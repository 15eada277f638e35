"""The API forms of a constraint -> StructuredOutput (ipc/structured_output.py), and bad input."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from ipc.structured_output import (
    MAX_PARALLEL_CALLS,
    MAX_SPEC_BYTES,
    StructuredOutput,
    closed_objects,
    for_tool_choice,
    from_response_format,
    from_structured_outputs,
)
from ipc.validation import InvalidParams

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "g"}},
]


def test_response_format_forms():
    assert from_response_format(None) is None
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == StructuredOutput("json", '{"type":"object"}')
    strict = from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    )
    assert strict.kind == "json" and strict.strict
    # Canonical text keeps the given key order: it is the order fields are generated in.
    assert strict.spec == '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}'
    assert json.loads(strict.spec) == SCHEMA
    loose = from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": json.dumps(SCHEMA)}}
    )
    assert loose.spec == strict.spec and not loose.strict
    assert loose.cache_key != strict.cache_key


def test_structured_outputs_forms():
    assert from_structured_outputs(None) is None
    assert (
        from_structured_outputs({"json": SCHEMA}).spec
        == from_response_format(
            {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True}}
        ).spec
    )
    assert from_structured_outputs({"regex": "[a-z]+"}) == StructuredOutput("regex", "[a-z]+")
    choice = from_structured_outputs({"choice": ["a", 'b"']})
    assert choice.kind == "choice" and json.loads(choice.spec) == ["a", 'b"']
    grammar = from_structured_outputs({"grammar": 'root ::= "x"', "json": None})
    assert grammar == StructuredOutput("grammar", 'root ::= "x"')
    # vLLM's json_object (false is not set), as OpenAI's response_format json_object.
    assert from_structured_outputs({"json_object": True}) == from_response_format({"type": "json_object"})
    assert from_structured_outputs({"json_object": False, "regex": "a"}) == StructuredOutput("regex", "a")


def test_struct_round_trips_on_the_wire():
    spec = StructuredOutput("json", '{"type":"object"}', strict=False)
    for codec in (msgspec.msgpack, msgspec.json):
        assert codec.decode(codec.encode(spec), type=StructuredOutput) == spec
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(["yaml", "x"]), type=StructuredOutput)


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": "{bad"}}, "not valid JSON"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "must be an object"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict"),
        ("json", "must be an object"),
    ],
)
def test_bad_response_format(form, message):
    with pytest.raises(InvalidParams, match=message):
        from_response_format(form)


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"xml": "a"}, "unknown field"),
        ({"choice": []}, "non-empty list"),
        ({"choice": "abc"}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty list"),
        ({"choice": ["a"] * 2000}, "at most"),
        ({"regex": ""}, "non-empty string"),
        ({"grammar": 3}, "non-empty string"),
        ({"json_object": True, "regex": "a"}, "exactly one"),
        ({"json_object": "yes"}, "json_object: must be a boolean"),
    ],
)
def test_bad_structured_outputs(form, message):
    with pytest.raises(InvalidParams, match=message):
        from_structured_outputs(form)


def test_a_constraint_over_the_size_limit_is_refused():
    big = {"enum": ["x" * 100] * (MAX_SPEC_BYTES // 100)}
    with pytest.raises(InvalidParams, match=f"limit of {MAX_SPEC_BYTES}"):
        from_structured_outputs({"json": big})
    with pytest.raises(InvalidParams, match="limit"):
        from_structured_outputs({"regex": "a" * (MAX_SPEC_BYTES + 1)})


def test_tool_choice_schemas():
    assert for_tool_choice(TOOLS, "auto") is None
    assert for_tool_choice(TOOLS, "none") is None
    assert for_tool_choice(TOOLS, None) is None
    named = for_tool_choice(TOOLS, {"type": "function", "function": {"name": "f"}})
    # A forced call's objects are closed, so that the call ends once its properties are written.
    assert json.loads(named.spec) == {**SCHEMA, "additionalProperties": False}
    no_params = for_tool_choice(TOOLS, {"type": "function", "function": {"name": "g"}})
    assert json.loads(no_params.spec) == {"type": "object", "properties": {}, "additionalProperties": False}
    required = json.loads(for_tool_choice(TOOLS, "required").spec)
    assert required["minItems"] == 1 and required["maxItems"] == MAX_PARALLEL_CALLS
    # Each tool's parameters (closed) in $defs under its name, so refs into them still resolve.
    assert required["items"]["anyOf"][0]["properties"]["parameters"] == {"$ref": "#/$defs/f"}
    assert required["$defs"]["f"] == {**SCHEMA, "additionalProperties": False}
    assert [alt["properties"]["name"] for alt in required["items"]["anyOf"]] == [
        {"const": "f"},
        {"const": "g"},
    ]
    assert json.loads(for_tool_choice(TOOLS, "required", parallel_tool_calls=False).spec)["maxItems"] == 1


def test_closed_objects_closes_every_object_schema_that_does_not_say():
    nested = {
        "type": "object",
        "properties": {
            "place": {"properties": {"city": {"type": "string"}}},
            "tags": {"type": "array", "items": {"type": "object"}},
            "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
            "either": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        },
        "$defs": {"unit": {"type": "object", "properties": {}}},
    }
    out = closed_objects(nested)
    assert out["additionalProperties"] is False
    assert out["properties"]["place"]["additionalProperties"] is False
    assert out["properties"]["tags"]["items"]["additionalProperties"] is False
    assert out["properties"]["extra"]["additionalProperties"] == {"type": "integer"}  # said: kept
    assert out["properties"]["either"]["anyOf"] == [
        {"type": "object", "additionalProperties": False},
        {"type": "null"},
    ]
    assert out["$defs"]["unit"]["additionalProperties"] is False
    assert "additionalProperties" not in nested  # the request's own schema is left as it was


def test_closed_objects_leaves_open_what_combines_with_other_schemas():
    """Closing a schema with allOf / anyOf, or a branch of allOf, or an anyOf branch beside
    properties of its own, would forbid the keys its partners allow; their nested objects are
    closed all the same."""
    place = {"type": "object", "properties": {"city": {"type": "string"}}}
    merged = closed_objects(
        {
            "type": "object",
            "allOf": [{"properties": {"a": place}}, {"properties": {"b": {"type": "integer"}}}],
        }
    )
    assert "additionalProperties" not in merged
    assert [("additionalProperties" in branch) for branch in merged["allOf"]] == [False, False]
    assert merged["allOf"][0]["properties"]["a"]["additionalProperties"] is False
    beside = closed_objects({"properties": {"id": {}}, "anyOf": [{"properties": {"x": {}}}]})
    assert "additionalProperties" not in beside and "additionalProperties" not in beside["anyOf"][0]
    alone = closed_objects({"type": "object", "anyOf": [{"properties": {"x": {}}}, {"type": "null"}]})
    assert "additionalProperties" not in alone
    assert alone["anyOf"][0]["additionalProperties"] is False  # the branch is the whole object
    by_ref = closed_objects({"type": "object", "$ref": "#/$defs/base", "$defs": {"base": place}})
    assert "additionalProperties" not in by_ref and by_ref["$defs"]["base"]["additionalProperties"] is False
    unchanged = {"not": place, "if": place, "const": {"type": "object"}}
    assert closed_objects(unchanged) == unchanged  # what not / if match, and data, are left alone


@pytest.mark.parametrize(
    ("schema", "instance"),
    [
        (  # OpenAPI's inheritance: a base definition extended through allOf
            {
                "type": "object",
                "$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}}},
                "allOf": [
                    {"$ref": "#/$defs/Base"},
                    {"properties": {"extra": {"type": "string"}}, "required": ["extra"]},
                ],
            },
            {"id": 1, "extra": "x"},
        ),
        (  # an anyOf inside an allOf branch adds keys to the same object
            {
                "type": "object",
                "allOf": [
                    {"properties": {"a": {"type": "string"}}, "required": ["a"]},
                    {"anyOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
                ],
            },
            {"a": "x", "b": 1},
        ),
        (  # a $ref beside an anyOf of more keys
            {
                "type": "object",
                "$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}}},
                "$ref": "#/$defs/Base",
                "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]}],
            },
            {"id": 1, "x": 1},
        ),
    ],
    ids=["allOf-ref", "allOf-anyOf", "ref-anyOf"],
)
def test_closing_never_forbids_what_the_schema_allows(schema, instance) -> None:
    """The instance is valid under the schema as given, and stays valid once it is closed."""
    jsonschema.validate(instance, schema)
    jsonschema.validate(instance, closed_objects(schema))


def test_required_rewrites_the_refs_of_a_tool_into_its_definition_only_in_schemas() -> None:
    """A property named like a keyword ("default", "enum") is a schema, and its ref is rewritten;
    a "$ref" inside a default value is data and stays as it was."""
    params = {
        "type": "object",
        "$defs": {"G": {"type": "object", "properties": {"n": {"type": "string"}}}},
        "properties": {"default": {"$ref": "#/$defs/G"}, "enum": {"$ref": "#", "default": {"$ref": "#/x"}}},
    }
    tools = [{"type": "function", "function": {"name": "a/b", "parameters": params}}]
    combined = json.loads(for_tool_choice(tools, "required").spec)
    assert combined["items"]["anyOf"][0]["properties"]["parameters"] == {"$ref": "#/$defs/a~1b"}
    hoisted = combined["$defs"]["a/b"]["properties"]
    assert hoisted["default"] == {"$ref": "#/$defs/a~1b/$defs/G"}
    assert hoisted["enum"]["$ref"] == "#/$defs/a~1b" and hoisted["enum"]["default"] == {"$ref": "#/x"}


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        (TOOLS, {"type": "function", "function": {"name": "h"}}, "no tool named 'h'"),
        ([], "required", "at least one tool"),
        (TOOLS, "always", "tool_choice"),
        ([{"type": "function"}], "required", r"tools\[0\]"),
        ([{"type": "function", "function": {"name": ""}}], "required", "name"),
        ([TOOLS[0], TOOLS[0]], "required", "twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "required", "parameters"),
        ("f", "required", "must be a list"),
        (
            [{"type": "function", "function": {"name": "say", "parameters": {"type": "string"}}}],
            {"type": "function", "function": {"name": "say"}},
            r"tools\[0\]\.function\.parameters: tool 'say' must take a JSON Schema of type 'object'",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}],
            "required",
            "'object'",
        ),
    ],
)
def test_bad_tools(tools, choice, message):
    with pytest.raises(InvalidParams, match=message):
        for_tool_choice(tools, choice)
