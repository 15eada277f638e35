"""What a request asks its output to match: the wire description, and its translation from the APIs.

`StructuredOutput` is the one form every stage sees: a kind and one canonical text. The API
forms map onto it here, in pure Python (no torch, no grammar engine), so the gateway and the
tokenizer translate without loading anything heavy:

- OpenAI `response_format`: `{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}` (`{"type": "text"}` is no constraint);
- vLLM `structured_outputs`: exactly one of `json` (a schema, as an object or its text), `regex`,
  `choice` (a list of strings), `grammar` (EBNF / GBNF, or Lark) or `json_object: true`;
- OpenAI `tools` + `tool_choice` `required` or a named function: the schema that forces the call
  (`for_tool_choice`).

The canonical text is the cache key of the compiled grammar (services/common/grammar_compiler.py).
A schema is canonicalized as compact JSON with its keys in the order given, not sorted: the order of
`properties` is the order the fields are generated in, so two orders are two different outputs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote, unquote

from ipc.messages import StructuredKind, StructuredOutput
from ipc.validation import MAX_SPEC_BYTES, STRUCTURED_KINDS, InvalidParams

__all__ = ["MAX_SPEC_BYTES", "StructuredKind", "StructuredOutput"]

KINDS: tuple[str, ...] = STRUCTURED_KINDS
MAX_CHOICES = 1024
MAX_TOOLS = 128
# `tool_choice: "required"` with parallel calls: the most calls one reply makes. Without a bound a
# small model repeats its call until max_tokens (SmolLM2 wrote one call 11 times).
MAX_PARALLEL_CALLS = 8
# Keywords that combine an object schema with others: closed_objects leaves such a schema open.
_COMBINED = (
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
)
# Keywords whose values are data, not schemas.
_LITERALS = ("const", "enum", "default", "examples")
# Keywords whose values map names (of properties, of definitions) to schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keys beside a `$ref` that add keys to the object it points to: that object must stay open.
_EXTENDING = ("properties", "patternProperties", "additionalProperties", *_COMBINED)

JSON_OBJECT_SCHEMA = '{"type":"object"}'
# vLLM's `structured_outputs.json_object: true`: any JSON object, as response_format json_object.
JSON_OBJECT_OPTION = "json_object"


def canonical_schema(schema: Any, field: str) -> str:
    """A JSON schema (object, bool or its JSON text) -> its canonical compact text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidParams(f"{field}: not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidParams(f"{field}: a JSON schema must be an object, got {type(schema).__name__}")
    return _bounded(json.dumps(schema, separators=(",", ":"), ensure_ascii=False), field)


def from_response_format(response_format: Mapping[str, Any] | None) -> StructuredOutput | None:
    """OpenAI `response_format` -> the constraint (None for no constraint)."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InvalidParams("response_format: must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json", JSON_OBJECT_SCHEMA)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise InvalidParams("response_format.json_schema: must be an object with a 'schema'")
        strict = spec.get("strict", False)
        if not isinstance(strict, bool):
            raise InvalidParams("response_format.json_schema.strict: must be a boolean")
        schema = canonical_schema(spec["schema"], "response_format.json_schema.schema")
        return StructuredOutput("json", schema, strict=strict)
    raise InvalidParams(f"response_format.type: must be text, json_object or json_schema, got {kind!r}")


def from_structured_outputs(options: Mapping[str, Any] | None) -> StructuredOutput | None:
    """vLLM `structured_outputs` (json / regex / choice / grammar, exactly one) -> the constraint."""
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise InvalidParams("structured_outputs: must be an object")
    fields = [*KINDS, JSON_OBJECT_OPTION]
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise InvalidParams(f"structured_outputs: unknown field(s) {unknown}; use one of {fields}")
    json_object = options.get(JSON_OBJECT_OPTION)
    if json_object is not None and not isinstance(json_object, bool):
        raise InvalidParams(f"structured_outputs.{JSON_OBJECT_OPTION}: must be a boolean")
    given = [k for k in KINDS if options.get(k) is not None] + ([JSON_OBJECT_OPTION] if json_object else [])
    if len(given) != 1:
        raise InvalidParams(f"structured_outputs: set exactly one of {fields}, got {given}")
    kind = given[0]
    if kind == JSON_OBJECT_OPTION:
        return StructuredOutput("json", JSON_OBJECT_SCHEMA)
    value = options[kind]
    field = f"structured_outputs.{kind}"
    if kind == "json":
        return StructuredOutput("json", canonical_schema(value, field))
    if kind == "choice":
        if (
            not isinstance(value, Sequence)
            or isinstance(value, str)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidParams(f"{field}: must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            raise InvalidParams(f"{field}: at most {MAX_CHOICES} choices, got {len(value)}")
        return StructuredOutput("choice", _bounded(json.dumps(list(value), ensure_ascii=False), field))
    if not isinstance(value, str) or not value:
        raise InvalidParams(f"{field}: must be a non-empty string")
    return StructuredOutput(kind, _bounded(value, field))


def for_tool_choice(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, *, parallel_tool_calls: bool = True
) -> StructuredOutput | None:
    """The constraint that forces tool calls, or None where the model chooses (`auto`, `none`).

    A named function: its `parameters` schema; the output is the arguments object, and the server
    names the call. `required`: a JSON array of `{"name", "parameters"}` objects, one alternative per
    tool, at least one item and at most MAX_PARALLEL_CALLS (exactly one unless `parallel_tool_calls`).

    A forced call's objects are closed (`closed_objects`), as OpenAI's strict mode has them: with
    other properties allowed, a model may go on writing made-up keys until max_tokens, and the
    call never ends.
    """
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    functions = tool_functions(tools)
    if tool_choice == "required":
        if not functions:
            raise InvalidParams("tool_choice: 'required' needs at least one tool")
        # Each tool's parameters go in $defs under its name, so that the refs they make into
        # themselves (a Pydantic model's "#/$defs/...") still resolve in the combined schema.
        call = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "parameters": {"$ref": f"#/$defs/{quote(_pointer_token(name), safe='')}"},
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name in functions
        ]
        array: dict[str, Any] = {
            "type": "array",
            "items": {"anyOf": call},
            "minItems": 1,
            "maxItems": MAX_PARALLEL_CALLS if parallel_tool_calls else 1,
            "$defs": {name: _hoisted(closed_objects(params), name) for name, params in functions.items()},
        }
        return StructuredOutput("json", canonical_schema(array, "tools"))
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise InvalidParams(f"tool_choice: no tool named {name!r} (tools: {sorted(functions)})")
        return StructuredOutput(
            "json", canonical_schema(closed_objects(functions[name]), f"tools[{name}].parameters")
        )
    raise InvalidParams(
        "tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}"
    )


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that does not say
    (LangChain's and most hand-written tool schemas never do); an explicit value is kept.

    An object schema is closed only where its own keys are all an object may have. One combined
    with others (`allOf`, `anyOf`, `oneOf`, a `$ref`, `if` / `then` / `else`) would forbid the
    keys its partners allow, so it stays open; so do `allOf` / `then` / `else` branches, the
    `anyOf` / `oneOf` branches of an object with keys of its own or other partners (those of a
    schema without are the whole object, and are closed), and a schema a `$ref` in such a place,
    or beside keys that add to it, points to. Their nested objects are closed all the same. What
    `not` and `if` say is left alone: closing them would change what they match."""
    extended: set[str] = set()
    _walk_schema(schema, True, "#", extended, None)
    return _walk_schema(schema, True, "#", set(), extended)


def _walk_schema(node: Any, close: bool, pointer: str, extended: set[str], keep_open: set[str] | None) -> Any:
    """closed_objects' walk. With `keep_open` None it only collects, into `extended`, the
    targets of the refs that a closed target would break; otherwise it returns the node closed,
    leaving the schemas at `keep_open` open at their top."""
    if isinstance(node, list):
        return [_walk_schema(x, close, f"{pointer}/{i}", extended, keep_open) for i, x in enumerate(node)]
    if not isinstance(node, Mapping):
        return node
    ref = node.get("$ref")
    if (
        keep_open is None
        and isinstance(ref, str)
        and (not close or any(k in node for k in _EXTENDING if k != "$ref"))
    ):
        extended.add(unquote(ref))
    close = close and (keep_open is None or pointer not in keep_open)
    has_own_keys = "properties" in node or "patternProperties" in node
    partners = any(key in node for key in _COMBINED if key not in ("anyOf", "oneOf"))
    out: dict[str, Any] = {}
    for key, value in node.items():
        where = f"{pointer}/{_pointer_token(key)}"
        if key in ("items", "prefixItems"):
            out[key] = _walk_schema(value, True, where, extended, keep_open)
        elif key in ("anyOf", "oneOf"):
            out[key] = _walk_schema(
                value, close and not has_own_keys and not partners, where, extended, keep_open
            )
        elif key in ("allOf", "then", "else"):
            out[key] = _walk_schema(value, False, where, extended, keep_open)
        elif key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(
            value, Mapping
        ):
            out[key] = {
                name: _walk_schema(sub, True, f"{where}/{_pointer_token(name)}", extended, keep_open)
                for name, sub in value.items()
            }
        else:
            out[key] = value
    is_object = out.get("type") == "object" or has_own_keys
    combined = any(key in out for key in _COMBINED)
    if close and is_object and not combined and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _hoisted(params: Mapping[str, Any], name: str) -> Any:
    """A tool's `parameters` with every ref into itself ("#", "#/...") rewritten to point into
    `#/$defs/{name}`, where the combined schema of `tool_choice: "required"` keeps them: nested
    under the call's array its refs would point nowhere. Only schemas are walked: a `$ref` in a
    value (`const`, `enum`, `default`, `examples`) is data."""
    prefix = f"#/$defs/{quote(_pointer_token(name), safe='')}"

    def schema(node: Any) -> Any:
        if isinstance(node, list):
            return [schema(item) for item in node]
        if not isinstance(node, Mapping):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
                out[key] = prefix + value[1:]
            elif key in _LITERALS:
                out[key] = value
            elif key in _SCHEMA_MAPS and isinstance(value, Mapping):
                out[key] = {sub_name: schema(sub) for sub_name, sub in value.items()}  # names, not keywords
            else:
                out[key] = schema(value)
        return out

    return schema(params)


def _pointer_token(token: str) -> str:
    """`token` escaped as a JSON pointer's reference token (RFC 6901)."""
    return token.replace("~", "~0").replace("/", "~1")


def tool_functions(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """OpenAI `tools` -> {function name: parameters schema}, in the order given."""
    if tools is None:
        return {}
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise InvalidParams("tools: must be a list")
    if len(tools) > MAX_TOOLS:
        raise InvalidParams(f"tools: at most {MAX_TOOLS}, got {len(tools)}")
    out: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(fn, Mapping):
            raise InvalidParams(f"tools[{i}]: must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidParams(f"tools[{i}].function.name: must be a non-empty string")
        if name in out:
            raise InvalidParams(f"tools[{i}].function.name: {name!r} appears twice")
        # A function without parameters (or with an empty schema) takes an empty object (OpenAI's
        # default).
        params = fn.get("parameters", {})
        if isinstance(params, Mapping) and not params:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise InvalidParams(f"tools[{i}].function.parameters: must be a JSON schema object")
        # Arguments are a JSON object (OpenAI refuses any other schema): a forced call under a
        # string schema would come back as plain content, with no tool call at all.
        if params.get("type") != "object":
            raise InvalidParams(
                f"tools[{i}].function.parameters: tool {name!r} must take a JSON Schema of type "
                f"'object', got type {params.get('type')!r}"
            )
        out[name] = dict(params)
    return out


def _bounded(text: str, field: str) -> str:
    size = len(text.encode())
    if size > MAX_SPEC_BYTES:
        raise InvalidParams(f"{field}: {size} bytes, larger than the limit of {MAX_SPEC_BYTES}")
    return text
