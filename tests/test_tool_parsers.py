"""Tool-call parsing (services/common/tool_parsers.py) whole and streamed, and tools in prompts."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.tool_parsers import ToolCallStream, ToolParser, call_id, finish_reason
from services.common.tools_prompt import (
    template_renders_tools,
    tool_format_for_template,
    tools_instruction,
)

WEATHER = {"city": "Paris", "unit": "c", "note": 'a } " </tool_call> { [ \\'}
HERMES = (
    "Let me look that up.\n"
    f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}\n</tool_call>\n'
    '<tool_call>\n{"arguments": {"tz": "UTC"}, "name": "get_time"}\n</tool_call>'
)
LLAMA = f'<|python_tag|>{{"name": "get_weather", "parameters": {json.dumps(WEATHER)}}}; {{"name": "get_time", "parameters": {{}}}}'
REQUIRED = f'[{{"name": "get_weather", "parameters": {json.dumps(WEATHER)}}}, {{"name": "get_time", "parameters": {{"tz": "UTC"}}}}]'


def calls(parsed) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


def test_hermes_calls_and_content():
    parsed = ToolParser("hermes").parse(HERMES, "req-1")
    assert parsed.content == "Let me look that up."
    assert calls(parsed) == [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})]
    assert [c["id"] for c in parsed.tool_calls] == [call_id("req-1", 0), call_id("req-1", 1)]
    assert len({c["id"] for c in parsed.tool_calls}) == 2
    assert all(c["type"] == "function" for c in parsed.tool_calls)


def test_hermes_without_calls_is_content():
    parser = ToolParser("hermes")
    for text in ["Plain answer.", "I would use <tool_call> tags.", "<tool_call>\nnot json\n</tool_call>"]:
        parsed = parser.parse(text, "r")
        assert parsed.tool_calls == [] and parsed.content == text


def test_hermes_edge_cases():
    parser = ToolParser("hermes")
    # A call cut short (max_tokens) is not a call: the text stays content and the reason stays length.
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    parsed = parser.parse(cut, "r")
    assert parsed.tool_calls == [] and parsed.content == cut
    assert finish_reason("length", bool(parsed.tool_calls)) == "length"
    # No closing tag before eos: the call is whole all the same.
    open_end = '<tool_call>{"name": "f", "arguments": {"a": 1}}'
    assert calls(parser.parse(open_end, "r")) == [("f", {"a": 1})]
    # Invalid JSON once complete, a non-string name, non-object arguments: content.
    for bad in [
        '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f"}</tool_call>',
    ]:
        assert parser.parse(bad, "r").tool_calls == [], bad
    one = ToolParser("hermes", parallel_tool_calls=False).parse(HERMES, "r")
    assert calls(one) == [("get_weather", WEATHER)]
    assert finish_reason("stop", True) == "tool_calls" and finish_reason("stop", False) == "stop"


def test_llama3_json_calls():
    parser = ToolParser("llama3_json")
    assert calls(parser.parse(LLAMA, "r")) == [("get_weather", WEATHER), ("get_time", {})]
    assert parser.parse(LLAMA, "r").content is None
    assert calls(parser.parse(' {"name": "f", "parameters": {"x": [1, 2]}}', "r")) == [("f", {"x": [1, 2]})]
    for text in [
        "The weather is fine.",
        '{"answer": 42}',
        '{"name": "f", "parameters": {"x": 1}',
        "<|python_tag|>",
    ]:
        parsed = parser.parse(text, "r")
        assert parsed.tool_calls == [] and parsed.content == text


def test_forced_formats():
    named = ToolParser("named", function_name="get_weather").parse(json.dumps(WEATHER), "r")
    assert calls(named) == [("get_weather", WEATHER)] and named.content is None
    required = ToolParser("required").parse(REQUIRED, "r")
    assert calls(required) == [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})]
    # Cut off by max_tokens: the call as written so far, as a stream announced it; never content.
    cut = ToolParser("named", function_name="f").parse('{"a": ', "r")
    assert [c["function"] for c in cut.tool_calls] == [{"name": "f", "arguments": '{"a": '}]
    assert cut.content is None
    cut = ToolParser("required").parse(REQUIRED[: REQUIRED.index('"tz"') + 3], "r")
    assert [c["function"]["name"] for c in cut.tool_calls] == ["get_weather", "get_time"]
    assert cut.tool_calls[1]["function"]["arguments"] == '{"tz' and cut.content is None
    cut = ToolParser("required").parse(REQUIRED[: REQUIRED.index("get_time") - 5], "r")
    assert calls(cut) == [("get_weather", WEATHER)] and cut.content is None  # '{"' leaked here once
    assert not required.has_cut_call and not named.has_cut_call


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (ToolParser("named", function_name="get_weather"), '{"city": "Paris", "'),
        (ToolParser("required"), REQUIRED[: REQUIRED.index('"tz"') + 3]),
    ],
    ids=["named", "required"],
)
def test_a_forced_call_cut_by_a_stop_string_does_not_finish_with_tool_calls(parser: ToolParser, text: str):
    """A stop string that cuts a forced call leaves the engine's `stop` (whole and streamed): the
    call keeps the arguments written so far, and `tool_calls` would tell a client to run a call
    whose arguments are not JSON."""
    parsed = parser.parse(text, "r")
    assert parsed.tool_calls and parsed.has_cut_call
    assert finish_reason("stop", bool(parsed.tool_calls) and not parsed.has_cut_call) == "stop"
    stream = ToolCallStream(parser, "r")
    stream.feed(text)
    stream.finish()
    assert stream.has_tool_calls and not stream.has_finished_calls
    whole = ToolCallStream(parser, "r")
    whole.feed(json.dumps(WEATHER) if parser.format == "named" else REQUIRED)
    whole.finish()
    assert whole.has_finished_calls


def test_an_auto_call_announced_then_cut_does_not_finish_with_tool_calls():
    """A hermes call whose name went out while streaming, then cut (a stop string, max_tokens):
    the whole output reads it as text, and the stream, which announced it, must not finish with
    `tool_calls` either."""
    parser = ToolParser("hermes")
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert not parser.parse(text, "r").tool_calls
    stream = ToolCallStream(parser, "r")
    for k in range(0, len(text), 7):
        stream.feed(text[k : k + 7])
    stream.finish()
    assert stream.has_tool_calls and not stream.has_finished_calls
    assert finish_reason("stop", stream.has_finished_calls) == "stop"


def test_forced_format_errors():
    with pytest.raises(ValueError, match="function_name"):
        ToolParser("named")
    with pytest.raises(ValueError, match="unknown tool call format"):
        ToolParser("xml")


def replay(parser: ToolParser, text: str, chunks: list[str]) -> tuple[str, list[dict]]:
    """Stream the chunks; rebuild content and calls from the deltas as an OpenAI client does."""
    stream = ToolCallStream(parser, "req-9")
    content = ""
    built: list[dict] = []
    for delta in [d for chunk in chunks for d in stream.feed(chunk)] + stream.finish():
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(built):
                assert call["function"]["name"] and call["id"] and call["function"]["arguments"] == ""
                built.append({"id": call["id"], "type": call["type"], "function": dict(call["function"])})
            else:
                assert "id" not in call and "name" not in call["function"]
                built[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    return content, built


def chunkings(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = [list(text), [text]]
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, min(12, len(text) - 1))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (ToolParser("hermes"), HERMES),
        (ToolParser("hermes"), "No tools needed: <tool_x> is not a tag, and < neither."),
        (ToolParser("hermes", parallel_tool_calls=False), HERMES),
        (ToolParser("llama3_json"), LLAMA),
        (ToolParser("llama3_json"), "Just text { with a brace."),
        (ToolParser("required"), REQUIRED),
        (ToolParser("named", function_name="get_weather"), json.dumps(WEATHER)),
    ],
)
def test_streamed_deltas_rebuild_the_parse(parser, text):
    whole = parser.parse(text, "req-9")
    for chunks in chunkings(text, seed=len(text)):
        content, built = replay(parser, text, chunks)
        assert built == whole.tool_calls
        assert content.strip() == (whole.content or "").strip()


def test_stream_holds_back_a_possible_tag_and_sends_arguments_as_they_come():
    stream = ToolCallStream(ToolParser("hermes"), "r")
    assert stream.feed("Sure <tool_") == [{"content": "Sure "}]
    assert stream.feed('call>{"name": "f", ') == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": call_id("r", 0),
                    "type": "function",
                    "function": {"name": "f", "arguments": ""},
                }
            ]
        }
    ]
    assert stream.feed('"arguments": {"a": ') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}
    ]
    assert stream.feed("1}}</tool_call>") == [{"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}]
    assert stream.finish() == [] and stream.has_tool_calls


def test_smollm2_template_does_not_render_tools(smollm2_dir):
    from transformers import AutoTokenizer

    template = (smollm2_dir / "chat_template.jinja").read_text()
    assert not template_renders_tools(template)
    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert with_tools == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "get_weather" not in with_tools
    assert tool_format_for_template(template) == "hermes"


def test_templates_that_render_tools_are_recognised():
    hermes = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    assert template_renders_tools(hermes)
    assert tool_format_for_template(hermes) == "hermes"
    llama = "{% if tools is not none %}{{ '<|python_tag|>' }}{% endif %}"
    assert template_renders_tools(llama) and tool_format_for_template(llama) == "llama3_json"


def test_the_instruction_lists_every_tool_in_the_format_the_parser_reads():
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "get_time", "description": "now, ünïcode"}},
    ]
    text = tools_instruction(tools)
    listed = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line) for line in listed] == tools
    example = text.split("<tool_call>", 1)[1]
    assert '"name"' in example and '"arguments"' in example and example.rstrip().endswith("</tool_call>")


# ------------------------------------------------------------------ generated outputs

NAMES = st.sampled_from(["get_weather", "get_time", "f", "名前"])
ARGS = st.dictionaries(
    st.text('ab"\\{}[]<>/ ün', max_size=6),
    st.one_of(st.integers(-999, 999), st.text('x"{}<tool_call>', max_size=8), st.booleans(), st.none()),
    max_size=3,
)
CONTENT = st.text("ab <>{}\n/_", max_size=12).map(lambda s: s.replace("<", "<tool_x ").lstrip("{"))
NOT_A_CALL = st.sampled_from(["not json", '{"foo": 1}', "[1, 2]", '{"arguments": {}}', ""])


@st.composite
def hermes_outputs(draw) -> str:
    parts = [draw(CONTENT)]
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            name, args = draw(NAMES), draw(ARGS)
            body = (
                {"name": name, "arguments": args}
                if draw(st.booleans())
                else {"arguments": args, "name": name}
            )
            parts.append(
                f"<tool_call>{draw(st.sampled_from(['', chr(10)]))}{json.dumps(body, ensure_ascii=False)}\n</tool_call>"
            )
        else:
            parts.append(f"<tool_call>{draw(NOT_A_CALL)}</tool_call>")
        parts.append(draw(st.sampled_from(["", "\n", " then "])))
    return "".join(parts)


@st.composite
def llama_outputs(draw) -> str:
    calls = [{"name": draw(NAMES), "parameters": draw(ARGS)} for _ in range(draw(st.integers(1, 3)))]
    prefix = draw(st.sampled_from(["", "<|python_tag|>", " "]))
    return prefix + "; ".join(json.dumps(c, ensure_ascii=False) for c in calls)


def check_stream(parser: ToolParser, text: str, cuts: list[int]) -> None:
    whole = parser.parse(text, "req-9")
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    content, built = replay(parser, text, chunks)
    assert built == whole.tool_calls
    assert content.strip() == (whole.content or "").strip()


@settings(max_examples=60, deadline=None)
@given(text=hermes_outputs(), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_generated_hermes_outputs_stream_as_they_parse(text, cuts):
    check_stream(ToolParser("hermes"), text, cuts)
    expected = text.count('"name"')  # each generated call names itself once; no other piece does
    assert len(ToolParser("hermes").parse(text, "r").tool_calls) == expected


@settings(max_examples=40, deadline=None)
@given(text=llama_outputs(), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_generated_llama3_outputs_stream_as_they_parse(text, cuts):
    check_stream(ToolParser("llama3_json"), text, cuts)
    assert len(ToolParser("llama3_json").parse(text, "r").tool_calls) == text.count("; ") + 1


@settings(max_examples=40, deadline=None)
@given(
    calls=st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_generated_forced_outputs_stream_as_they_parse(calls, cuts):
    text = json.dumps([{"name": n, "parameters": a} for n, a in calls], ensure_ascii=False)
    check_stream(ToolParser("required"), text, cuts)
    parsed = ToolParser("required").parse(text, "r")
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls
    ] == calls
    named = json.dumps(calls[0][1], ensure_ascii=False)
    check_stream(ToolParser("named", function_name="f"), named, cuts)
    # Cut off anywhere by max_tokens: streamed and whole give the same calls, and no content.
    for parser, output in ((ToolParser("required"), text), (ToolParser("named", function_name="f"), named)):
        for end in sorted({c % (len(output) + 1) for c in cuts}):
            check_stream(parser, output[:end], cuts)
            assert parser.parse(output[:end], "r").content is None
