"""Compiled constraints and matchers (services/common/grammar_compiler.py, grammar_matcher.py).

Outputs come from random walks: seeded, each step a token the bitmask allows, until eos. Every
finished output is checked independently of the engine: JSON against its schema with the
`jsonschema` package, regex and grammar outputs with Python's `re`, choices by membership.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import jsonschema
import llguidance
import numpy as np
import pytest
from tokenizers import Tokenizer

from ipc.step_plan import vocab_words
from ipc.structured_output import MAX_SPEC_BYTES, StructuredOutput, for_tool_choice, from_response_format
from services.common.grammar_compiler import (
    MIB,
    MIN_GRAMMAR_BYTES,
    GrammarBudgets,
    GrammarCompiler,
    GrammarError,
    check_constraint,
    load_grammar_tokenizer,
)
from services.common.tool_parsers import ToolParser
from services.scheduler.grammar_matcher import (
    BitmaskFiller,
    GrammarMatcher,
    GrammarViolation,
)

MAX_WALK = 400
# Tokens a walk prefers when they are allowed, so that strings and numbers end and walks finish.
CLOSERS = set('"}],:0123456789')


@pytest.fixture(scope="module")
def model(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    eos = config["eos_token_id"]
    eos_ids = eos if isinstance(eos, list) else [eos]
    hf = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    closers = [i for i in range(hf.get_vocab_size()) if hf.decode([i]) in CLOSERS]
    return {"dir": smollm2_dir, "vocab": config["vocab_size"], "eos": eos_ids, "hf": hf, "closers": closers}


@pytest.fixture(scope="module")
def tokenizer(model):
    return load_grammar_tokenizer(model["dir"], model["vocab"], model["eos"])


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, threads=2)
    yield compiler
    compiler.close()


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    return np.zeros((rows, vocab_words(vocab_size)), np.int32)


def allowed(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set (unpacked independently of the engine)."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def walk(compiler, model, spec: StructuredOutput, seed: int) -> tuple[str, list[int]]:
    """A seeded random output under the constraint; returns its text (eos excluded) and tokens."""
    rng = random.Random(seed)
    matcher = GrammarMatcher(compiler.submit(spec).result(timeout=60))
    bitmask = allocate_bitmask(1, model["vocab"])
    favoured = np.array([*model["closers"], *model["eos"]])
    eos = set(model["eos"])
    tokens: list[int] = []
    for _ in range(MAX_WALK):
        matcher.fill(bitmask, 0)
        ok = allowed(bitmask[0], model["vocab"])
        assert len(ok), "a live matcher always allows something"
        preferred = favoured[np.isin(favoured, ok)].tolist()
        token = rng.choice(preferred) if preferred and rng.random() < 0.7 else int(rng.choice(ok))
        if token in eos:
            assert matcher.is_accepting
            return model["hf"].decode(tokens, skip_special_tokens=False), tokens
        matcher.advance([token])
        tokens.append(token)
    raise AssertionError(f"no eos after {MAX_WALK} tokens: {model['hf'].decode(tokens)!r}")


SCHEMAS = {
    "nested_objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "minLength": 1, "maxLength": 8},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array_min_max_items": {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}},
        "required": ["xs"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "XL"]},
            "level": {"enum": [1, 2, 3]},
        },
        "required": ["color", "size", "level"],
        "additionalProperties": False,
    },
    "number_ranges": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5},
            "delta": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["age", "ratio", "delta"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "label": {"type": "string", "maxLength": 6},
            "done": {"type": "boolean"},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(compiler, model, name):
    schema = SCHEMAS[name]
    spec = from_response_format(
        {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    )
    for seed in range(4):
        text, _ = walk(compiler, model, spec, seed)
        jsonschema.validate(json.loads(text), schema)
        # One layout for every output: OpenAI's separators, no other whitespace outside strings.
        assert "\n" not in text


def test_optional_fields_are_sometimes_present_and_sometimes_not(compiler, model):
    spec = StructuredOutput("json", json.dumps(SCHEMAS["optional_fields"]))
    key_sets = {tuple(sorted(json.loads(walk(compiler, model, spec, seed)[0]))) for seed in range(12)}
    assert len(key_sets) > 1, key_sets


def test_check_constraint_passes_what_compiles():
    for spec in [
        StructuredOutput("json", json.dumps(SCHEMAS["nested_objects"])),
        StructuredOutput("regex", "[a-z]+"),
        StructuredOutput("choice", '["a", "b"]'),
        StructuredOutput("grammar", 'root ::= "x" [0-9]*'),
    ]:
        check_constraint(spec)


def test_json_object_gives_an_object(compiler, model):
    spec = from_response_format({"type": "json_object"})
    for seed in range(3):
        assert isinstance(json.loads(walk(compiler, model, spec, seed)[0]), dict)


@pytest.mark.parametrize("strict", [False, True])
def test_the_schema_true_allows_any_json_value(compiler, model, strict):
    """`true` is JSON Schema's "anything" (as `{}`); it was refused with the engine's words about
    its options ("Expecting object schema to apply options")."""
    spec = from_response_format({"type": "json_schema", "json_schema": {"schema": True, "strict": strict}})
    check_constraint(spec)
    for seed in range(3):
        json.loads(walk(compiler, model, spec, seed)[0])


def test_gbnf_code_point_escapes_mean_their_characters(compiler, model):
    """llama.cpp's GBNF writes a character as `\\uXXXX` or `\\UXXXXXXXX`, in strings and classes.
    llguidance's converter stripped their leading zeros (`\\u0042` -> `\\u42`), which its own
    parser refused: "invalid hexadecimal digit", a 400 for a valid grammar."""
    grammar = StructuredOutput(
        "grammar", r'root ::= "\u0041" [\u00e9-\u00ea] "\U0001F600" [\u005D\u002D] "\\u0041"'
    )
    check_constraint(grammar)
    for seed in range(4):
        assert re.fullmatch(r"A[éê]😀[\]-]\\u0041", walk(compiler, model, grammar, seed)[0])


def test_a_gbnf_rule_named_start_is_a_rule_like_any_other(compiler, model):
    """llguidance's converter names GBNF's `root` rule `start`, and took any grammar with a line
    `start ::=` for its own Lark: a valid llama.cpp grammar with a rule of that name was a 400
    ("Expected token '_'" or "Rule 'start' already exists"). Names inside strings, classes and
    comments stay as written."""
    grammar = StructuredOutput(
        "grammar", 'root ::= "start" start # start here\nstart ::= [0-9] start-0\nstart-0 ::= "[start]"\n'
    )
    check_constraint(grammar)
    for seed in range(3):
        assert re.fullmatch(r"start[0-9]\[start\]", walk(compiler, model, grammar, seed)[0])
    # A token reference's look inside a string is text, not a reference.
    quoted = StructuredOutput("grammar", 'root ::= "<[1]>" [<|]')
    check_constraint(quoted)
    assert re.fullmatch(r"<\[1\]>[<|]", walk(compiler, model, quoted, 0)[0])


def test_regex_choice_and_grammar_outputs(compiler, model):
    regex = StructuredOutput("regex", r"[a-z]{3}-[0-9]{2,4}")
    choices = ["yes", "no", 'say "maybe"', "ünïcode"]
    choice = StructuredOutput("choice", json.dumps(choices))
    gbnf = StructuredOutput("grammar", 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] | [1-9] [0-9]\n')
    lark = StructuredOutput("grammar", 'start: "x=" NUM (";" "x=" NUM)*\nNUM: /[0-9]{1,3}/\n')
    seen = set()
    for seed in range(6):
        assert re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", walk(compiler, model, regex, seed)[0])
        text = walk(compiler, model, choice, seed)[0]
        assert text in choices
        seen.add(text)
        assert re.fullmatch(r"\((\d|[1-9]\d)(\+(\d|[1-9]\d))*\)", walk(compiler, model, gbnf, seed)[0])
        assert re.fullmatch(r"x=\d{1,3}(;x=\d{1,3})*", walk(compiler, model, lark, seed)[0])
    assert len(seen) > 1


def test_forced_tool_call_arguments_match_the_function_schema(compiler, model):
    weather = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    clock = {
        "type": "object",
        "properties": {"tz": {"type": "string", "maxLength": 6}},
        "required": ["tz"],
        "additionalProperties": False,
    }
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
        {"type": "function", "function": {"name": "get_time", "parameters": clock}},
    ]
    named = for_tool_choice(tools, {"type": "function", "function": {"name": "get_weather"}})
    single = for_tool_choice(tools, "required", parallel_tool_calls=False)
    several = for_tool_choice(tools, "required")
    schemas = {"get_weather": weather, "get_time": clock}
    for seed in range(4):
        # The forced outputs parse into tool calls whose arguments match their function's schema.
        text = walk(compiler, model, named, seed)[0]
        parsed = ToolParser("named", function_name="get_weather").parse(text, "r")
        assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather"]
        jsonschema.validate(json.loads(parsed.tool_calls[0]["function"]["arguments"]), weather)
        for parallel, spec in ((False, single), (True, several)):
            parsed = ToolParser("required", parallel_tool_calls=parallel).parse(
                walk(compiler, model, spec, seed)[0], "r"
            )
            assert len(parsed.tool_calls) >= 1 and (parallel or len(parsed.tool_calls) == 1)
            for call in parsed.tool_calls:
                jsonschema.validate(
                    json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]]
                )


# Tool schemas as libraries write them: a Pydantic model with a nested one ($defs and $ref), a
# recursive one (a $ref to its root), one merged with allOf, and anyOf beside properties of its own.
COMPOSED_TOOLS = {
    "invite": {
        "$defs": {
            "Guest": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
                "required": ["name"],
            }
        },
        "type": "object",
        "properties": {"guests": {"type": "array", "items": {"$ref": "#/$defs/Guest"}, "maxItems": 2}},
        "required": ["guests"],
    },
    "tree": {
        "type": "object",
        "properties": {
            "label": {"type": "string", "maxLength": 4},
            "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1},
        },
        "required": ["label"],
    },
    "merged": {
        "type": "object",
        "allOf": [
            {"properties": {"a": {"type": "string", "maxLength": 4}}, "required": ["a"]},
            {"properties": {"b": {"type": "integer"}}, "required": ["b"]},
        ],
    },
    "either": {
        "type": "object",
        "properties": {"id": {"type": "integer"}},
        "required": ["id"],
        "anyOf": [
            {"properties": {"x": {"type": "boolean"}}, "required": ["x"]},
            {"properties": {"y": {"type": "null"}}, "required": ["y"]},
        ],
    },
}


def test_forced_calls_of_composed_schemas_are_valid_calls(compiler, model):
    """Refs into a tool's own $defs (or its root) still resolve once `required` combines the tools,
    and closing objects never forbids the keys allOf / anyOf branches add: every forced call's
    arguments validate against the tool's own schema."""
    tools = [
        {"type": "function", "function": {"name": n, "parameters": p}} for n, p in COMPOSED_TOOLS.items()
    ]
    several = for_tool_choice(tools, "required")
    names_seen = set()
    for seed in range(8):
        for name in COMPOSED_TOOLS:
            named = for_tool_choice(tools, {"type": "function", "function": {"name": name}})
            jsonschema.validate(json.loads(walk(compiler, model, named, seed)[0]), COMPOSED_TOOLS[name])
        parsed = ToolParser("required").parse(walk(compiler, model, several, seed)[0], "r")
        assert parsed.tool_calls
        for call in parsed.tool_calls:
            names_seen.add(call["function"]["name"])
            jsonschema.validate(
                json.loads(call["function"]["arguments"]), COMPOSED_TOOLS[call["function"]["name"]]
            )
    assert len(names_seen) > 1


def test_rebuild_from_history_gives_identical_bitmasks(compiler, model):
    spec = StructuredOutput("json", json.dumps(SCHEMAS["nested_objects"]))
    _, tokens = walk(compiler, model, spec, seed=5)
    compiled = compiler.submit(spec).result(timeout=60)
    live = GrammarMatcher(compiled)
    a = allocate_bitmask(1, model["vocab"])
    b = allocate_bitmask(1, model["vocab"])
    for cut in range(len(tokens) + 1):
        rebuilt = GrammarMatcher(compiled, tokens[:cut])
        live.fill(a, 0)
        rebuilt.fill(b, 0)
        assert np.array_equal(a, b), cut
        assert (live.is_accepting, live.is_terminated) == (rebuilt.is_accepting, rebuilt.is_terminated)
        if cut < len(tokens):
            live.advance([tokens[cut]])
    assert live.is_accepting and live.num_tokens == len(tokens)


def test_batched_fill_matches_one_row_at_a_time(compiler, model):
    specs = [StructuredOutput("json", json.dumps(SCHEMAS[name])) for name in sorted(SCHEMAS)] + [
        StructuredOutput("regex", "[0-9]+x")
    ]
    matchers = []
    for i, spec in enumerate(specs):
        _, tokens = walk(compiler, model, spec, seed=i)
        matchers.append(GrammarMatcher(compiler.submit(spec).result(timeout=60), tokens[: len(tokens) // 2]))
    batched = allocate_bitmask(len(matchers) + 2, model["vocab"])
    batched[len(matchers) :] = 7  # rows past the matchers must be left alone
    BitmaskFiller(threads=2).fill(batched, matchers)
    single = allocate_bitmask(1, model["vocab"])
    for i, m in enumerate(matchers):
        m.fill(single, 0)
        assert np.array_equal(batched[i], single[0]), i
    assert (batched[len(matchers) :] == 7).all()


def test_eos_is_allowed_exactly_where_the_grammar_may_end(compiler, model):
    eos = model["eos"][0]
    hf = model["hf"]
    matcher = GrammarMatcher(compiler.submit(StructuredOutput("regex", "ab+")).result(timeout=60))
    bitmask = allocate_bitmask(1, model["vocab"])

    def eos_allowed() -> bool:
        matcher.fill(bitmask, 0)
        return eos in set(allowed(bitmask[0], model["vocab"]).tolist())

    assert not eos_allowed() and not matcher.is_accepting
    matcher.advance(hf.encode("a", add_special_tokens=False).ids)
    assert not eos_allowed()
    matcher.advance(hf.encode("b", add_special_tokens=False).ids)
    assert eos_allowed() and matcher.is_accepting and not matcher.is_terminated

    done = GrammarMatcher(compiler.submit(StructuredOutput("choice", '["stop"]')).result(timeout=60))
    done.advance(hf.encode("stop", add_special_tokens=False).ids)
    done.fill(bitmask, 0)
    assert done.is_terminated
    assert allowed(bitmask[0], model["vocab"]).tolist() == sorted(model["eos"])


def test_a_refused_token_raises_with_its_position(compiler, model):
    matcher = GrammarMatcher(compiler.submit(StructuredOutput("regex", "[0-9]+")).result(timeout=60))
    digit = model["hf"].encode("7", add_special_tokens=False).ids
    letter = model["hf"].encode("z", add_special_tokens=False).ids
    matcher.advance(digit)
    with pytest.raises(GrammarViolation, match=f"position {len(digit)}"):
        matcher.advance(letter)
    with pytest.raises(GrammarViolation):
        GrammarMatcher(compiler.submit(StructuredOutput("regex", "[0-9]+")).result(timeout=60), letter)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput("json", '{"type": "strin"}'), "strin"),
        (StructuredOutput("json", '{"$ref": "#/defs/missing"}'), "missing"),
        (StructuredOutput("json", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
        (StructuredOutput("json", "{not json"), "json"),
        (StructuredOutput("regex", "(ab"), "regex"),
        (StructuredOutput("grammar", 'root ::= "a" undefined_rule'), "undefined_rule"),
        (StructuredOutput("grammar", 'start ::= "a"'), "No 'root' rule"),
        (StructuredOutput("grammar", 'root ::= "a" <[1]>'), "token references such as <[1]>"),
        (StructuredOutput("grammar", "root ::= x\nx ::= <|im_end|>"), "token references such as <|im_end|>"),
        # The engine's own words named an option no request can set, or its internal types.
        (StructuredOutput("json", '{"oneOf": [{"type": "number"}, {"type": "integer"}]}'), "strict: false"),
        (StructuredOutput("json", '{"type": "integer", "minimum": 1e20}'), "beyond 64-bit integers"),
    ],
)
def test_a_constraint_that_does_not_compile_errors_clearly(compiler, model, spec, message):
    with pytest.raises(GrammarError, match=re.escape(message)):
        check_constraint(spec)
    future = compiler.submit(spec)
    with pytest.raises(GrammarError, match=re.escape(message)) as info:
        future.result(timeout=60)
    assert info.value.code == "invalid_request"
    assert len(str(info.value)) <= 600
    # The failure is cached (a resubmission fails at once), and the compiler serves others as before.
    assert compiler.submit(spec) is future
    assert walk(compiler, model, StructuredOutput("regex", "ok"), seed=0)[0] == "ok"


def test_strict_false_ignores_keywords_the_engine_cannot_enforce(compiler, model):
    schema = {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2, "uniqueItems": True}
    lenient = from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert not lenient.strict
    text, _ = walk(compiler, model, lenient, seed=1)
    jsonschema.validate(json.loads(text), {k: v for k, v in schema.items() if k != "uniqueItems"})


def test_a_grammar_over_the_engine_limits_errors(tokenizer):
    tight = GrammarBudgets(limits=llguidance.LLParserLimits(initial_lexer_fuel=1000))
    small = GrammarCompiler(tokenizer, budgets=tight)
    try:
        spec = StructuredOutput("json", json.dumps({"enum": [f"value_{i}" for i in range(2000)]}))
        with pytest.raises(GrammarError, match="too big"):
            small.submit(spec).result(timeout=60)
        with pytest.raises(GrammarError, match="too big"):
            check_constraint(spec, tight)
        check_constraint(spec)  # within the default limits
        # The request-size bound holds for a constraint that did not come through the API forms.
        huge = StructuredOutput("regex", "a" * (MAX_SPEC_BYTES + 1))
        with pytest.raises(GrammarError, match="limit"):
            check_constraint(huge)
        with pytest.raises(GrammarError, match="limit"):
            small.submit(huge).result(timeout=60)
    finally:
        small.close()


def test_cache_is_keyed_by_text_and_bounded_in_bytes(tokenizer):
    # Room for many light grammars (tens of KiB each), not for two heavy ones (about 5 MiB each).
    cache = GrammarCompiler(tokenizer, budgets=GrammarBudgets(cache_bytes=8 * MIB))
    try:
        a = StructuredOutput("regex", "a+")
        first = cache.submit(a)
        assert cache.submit(a) is first
        assert cache.submit(StructuredOutput("regex", "a+", strict=False)) is not first
        light = [StructuredOutput("regex", f"[a-z]{{1,{n}}}") for n in range(2, 8)]
        futures = [cache.submit(spec) for spec in light]
        weights = [future.result(timeout=60).num_bytes for future in futures]
        assert all(MIN_GRAMMAR_BYTES <= w < MIB // 4 for w in weights), weights
        assert len(cache) == 8 and cache.num_bytes <= 8 * MIB  # all light: nothing evicted
        # A heavy grammar weighs what its compile allocated; a second one pushes out the least
        # recently used entries until the cache is within its bound again.
        heavy = [StructuredOutput("regex", f"(a{{300}}){{{n}}}") for n in (40, 41)]
        first_heavy = cache.submit(heavy[0])
        assert first_heavy.result(timeout=60).num_bytes > 2 * MIB
        assert cache.submit(light[-1]) is futures[-1]  # used again: the most recent light one
        assert cache.submit(heavy[1]).result(timeout=60).num_bytes > 2 * MIB
        assert cache.num_bytes <= 8 * MIB
        assert cache.submit(light[-1]) is futures[-1]  # kept
        assert len(cache) == 2
        assert cache.submit(heavy[0]) is not first_heavy  # evicted: compiled anew
        # An evicted grammar keeps working for whoever holds it.
        assert GrammarMatcher(first.result(timeout=60)).num_tokens == 0
    finally:
        cache.close()


def test_a_compile_over_its_time_or_memory_budget_is_refused(tokenizer):
    heavy = StructuredOutput("regex", "(a{300}){40}")  # about 5 MiB and 10-30 ms to compile
    for budgets, message in [
        (
            GrammarBudgets(max_grammar_bytes=1 * MIB),
            r"MiB, over the budget of 1\.0 MiB \(structured\.max_grammar_mib\)",
        ),
        (
            GrammarBudgets(compile_timeout_s=1e-6),
            r"ms, over the budget of 0 ms \(structured\.compile_timeout_ms\)",
        ),
    ]:
        compiler = GrammarCompiler(tokenizer, budgets=budgets)
        try:
            with pytest.raises(GrammarError, match=message):
                compiler.submit(heavy).result(timeout=60)
            assert compiler.submit(heavy).exception() is not None  # the refusal is cached
        finally:
            compiler.close()
    # Within the default budgets, and the pathological regexes of issue 29 are refused by them.
    compiler = GrammarCompiler(tokenizer)
    try:
        compiler.compile_now(heavy)
        for pattern in ("(a{600}){611}", "(a{700}){700}b{3}", "(a{1000}){1000}"):
            with pytest.raises(GrammarError, match=r"regex: too complex: .*structured\.max_grammar_mib"):
                compiler.compile_now(StructuredOutput("regex", pattern))
    finally:
        compiler.close()


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput("regex", r"[^\s\S]"),
        StructuredOutput("grammar", "start: start"),
        StructuredOutput("grammar", 'root ::= root "a"'),
    ],
)
def test_a_constraint_that_matches_nothing_is_refused(compiler, spec):
    """Such a constraint used to "succeed" with an empty text and finish_reason stop."""
    message = f"{spec.kind}: the constraint matches no output at all"
    with pytest.raises(GrammarError, match=re.escape(message)):
        check_constraint(spec)  # the gateway's and the tokenizer's check, no tokenizer needed
    with pytest.raises(GrammarError, match=re.escape(message)):
        compiler.submit(spec).result(timeout=60)


def test_a_grammar_past_the_lexer_limit_at_its_start_is_refused(tokenizer):
    """It used to compile, and its matcher allowed only eos: an empty "stop" output."""
    tight = GrammarBudgets(limits=llguidance.LLParserLimits(max_lexer_states=20))
    compiler = GrammarCompiler(tokenizer, budgets=tight)
    try:
        with pytest.raises(GrammarError, match=r"regex: .*lexer"):
            compiler.compile_now(StructuredOutput("regex", "[a-z]{1,50}@[0-9]{1,50}"))
    finally:
        compiler.close()


def test_a_mask_over_its_time_budget_fails_its_matcher_alone(tokenizer):
    # llguidance's own limits (the engine's default fuel is lower), so this regex gets to
    # generate: each of its masks takes 0.15-0.3 s, a plain regex's tens of microseconds.
    loose = GrammarBudgets(
        compile_timeout_s=120, max_grammar_bytes=1 << 40, limits=llguidance.LLParserLimits()
    )
    compiler = GrammarCompiler(tokenizer, budgets=loose)
    try:
        slow = GrammarMatcher(compiler.compile_now(StructuredOutput("regex", "(a{600}){611}")))
        quick = GrammarMatcher(compiler.compile_now(StructuredOutput("regex", "[0-9]+")))
    finally:
        compiler.close()
    bitmask = allocate_bitmask(2, tokenizer.vocab_size)
    BitmaskFiller(budget_s=0.05).fill(bitmask, [quick, slow])
    assert (
        slow.failure is not None and "over the budget of 50 ms (structured.mask_timeout_ms)" in slow.failure
    )
    assert quick.failure is None
    assert len(allowed(bitmask[0], tokenizer.vocab_size)) == 10  # both rows filled all the same
    assert len(allowed(bitmask[1], tokenizer.vocab_size)) >= 1


def test_bitmask_layout_is_checked(compiler):
    matcher = GrammarMatcher(compiler.submit(StructuredOutput("regex", "a")).result(timeout=60))
    with pytest.raises(ValueError, match="int32"):
        matcher.fill(np.zeros((1, 8), dtype=np.int64), 0)
    with pytest.raises(ValueError, match="matchers"):
        BitmaskFiller(1).fill(allocate_bitmask(0, 64), [matcher])


def test_grammar_modules_do_not_import_torch():
    code = (
        "import sys; import ipc.structured_output, services.common.grammar_compiler, "
        "services.scheduler.grammar_matcher; print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["False", "False"]


def test_the_workers_masking_keeps_exactly_the_tokens_the_grammar_accepts(compiler, model):
    import torch

    from services.gpu_worker.grammar_mask import apply_grammar_bitmask

    spec = StructuredOutput("json", json.dumps(SCHEMAS["number_ranges"]))
    compiled = compiler.submit(spec).result(timeout=60)
    _, tokens = walk(compiler, model, spec, seed=2)
    rng = np.random.default_rng(0)
    for cut in (0, 3, len(tokens) // 2, len(tokens)):
        bitmask = allocate_bitmask(1, model["vocab"])
        GrammarMatcher(compiled, tokens[:cut]).fill(bitmask, 0)
        scores = torch.zeros(2, model["vocab"])
        apply_grammar_bitmask(scores, bitmask, np.array([1], dtype=np.int32))
        kept = set(torch.isfinite(scores[1]).nonzero()[:, 0].tolist())
        assert torch.isfinite(scores[0]).all()
        assert kept == set(allowed(bitmask[0], model["vocab"]).tolist())
        # Every kept token (a sample of them) extends the history; a sample of the others does not.
        others = np.setdiff1d(np.arange(model["vocab"]), list(kept))
        for t in [*rng.choice(sorted(kept), min(20, len(kept)), replace=False), *rng.choice(others, 20)]:
            if int(t) in model["eos"]:
                continue
            try:
                GrammarMatcher(compiled, [*tokens[:cut], int(t)])
                accepted = True
            except GrammarViolation:
                accepted = False
            assert accepted == (int(t) in kept), (cut, int(t))
