"""Structured output and tool calling through the HTTP gateway, end to end: one real Brigade run of
SmolLM2-135M, driven by the real `openai` client (and the SDK for the raw text). Outputs are
validated against their schemas with `jsonschema`; regexes with `re`; tool calls parse and match
their function's parameters."""

from __future__ import annotations

import http.client
import json
import re
import threading
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest
from prometheus_client import CollectorRegistry

from client import Client
from client.async_sdk import AsyncClient
from ipc.structured_output import MAX_PARALLEL_CALLS
from services.audit import ApiKeyFailures, AuditLog
from services.common.text import Tokenizer
from services.common.tool_parsers import ToolParser
from services.gateway.app import Gateway as AppGateway
from services.gateway.app import GatewaySettings
from services.metrics import HttpMetrics
from tests.harness import assert_clean, brigade_run, free_port, gateway_in_thread

pytestmark = pytest.mark.timeout(600)

HTTP_TIMEOUT_S = 300.0
SAMPLED = [(0.0, None), (1.0, 1234)]  # greedy, and temperature 1 with a seed
SAMPLED_IDS = ["greedy", "seeded"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},  # optional
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 12}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time in a timezone", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris? And the time in Tokyo?"}]
# Under tool_choice auto the model decides; this regex makes SmolLM2 write one Hermes call, which
# the hermes parser must then read back into tool_calls (the `auto` path, end to end).
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,8}", "unit": "celsius"\}\}\n</tool_call>'


class Gateway:
    def __init__(self, run, port: int) -> None:
        self.run = run
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="none", timeout=HTTP_TIMEOUT_S, max_retries=0
        )

    def post(self, path: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HTTP_TIMEOUT_S)
        try:
            conn.request(
                "POST", path, json.dumps(body), {"content-type": "application/json", **(headers or {})}
            )
            reply = conn.getresponse()
            return reply.status, reply.read()
        finally:
            conn.close()

    def events(self, body: dict, headers: dict[str, str] | None = None) -> list[tuple[str | None, dict]]:
        """A streamed chat's SSE events as (id, data), [DONE] left out."""
        status, data = self.post("/v1/chat/completions", {**body, "stream": True}, headers)
        assert status == 200, data
        out = []
        for block in data.decode().split("\n\n"):
            fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
            if "data" in fields and fields["data"] != "[DONE]":
                out.append((fields.get("id"), json.loads(fields["data"])))
        return out


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path):
    run_dir = tmp_path_factory.mktemp("gw-structured")
    port = free_port()
    # A grammar budget above the 38 MiB that `(a{700}){700}b` takes, so that such regexes get
    # past their compile and fail while generating (the default refuses them at compile), and a
    # cache too small to keep two of them: the pathological-regex test exercises both. No limit
    # on a client's costly compiles: that test's compiles may run past their time budget on a
    # loaded host, and its later regexes must still reach the engine.
    with brigade_run(
        run_dir,
        f"model.path={smollm2_dir}",
        "model.max_model_len=2048",
        f"gateway.port={port}",
        "structured.max_grammar_mib=64",
        "structured.grammar_cache_mib=64",
        "structured.max_costly_compiles=0",
    ) as run:
        yield Gateway(run, port)
    assert_clean(run_dir)


def chat(gw: Gateway, messages: list[dict], temperature: float, seed: int | None, **kwargs):
    return gw.client.chat.completions.create(
        model="", messages=messages, temperature=temperature, seed=seed, **kwargs
    )


def streamed_chat(gw: Gateway, messages: list[dict], temperature: float, seed: int | None, **kwargs):
    """A streamed chat assembled as the openai client's users do: content, calls by index, finish."""
    stream = gw.client.chat.completions.create(
        model="", messages=messages, temperature=temperature, seed=seed, stream=True, **kwargs
    )
    content, calls, finish = [], {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            for call in delta.tool_calls or []:
                have = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id:
                    assert have["id"] is None, "a call's id comes once"
                    have["id"], have["name"] = call.id, call.function.name
                have["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish


def check_calls(calls: list[tuple[str, str]]) -> None:
    """Each (name, arguments) names an offered tool and its arguments match its parameters."""
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# -- response_format and structured_outputs ------------------------------------------------------


@pytest.mark.parametrize(("temperature", "seed"), SAMPLED, ids=SAMPLED_IDS)
def test_json_schema_strict_output_validates(gw: Gateway, temperature: float, seed: int | None) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    reply = chat(gw, ASK_PERSON, temperature, seed, max_tokens=100, response_format=response_format)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_streamed_is_the_same_output(gw: Gateway) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = chat(gw, ASK_PERSON, 1.0, 99, max_tokens=100, response_format=response_format).choices[0]
    streamed = streamed_chat(gw, ASK_PERSON, 1.0, 99, max_tokens=100, response_format=response_format)
    assert streamed == (whole.message.content, [], whole.finish_reason)  # same seed, same tokens
    if whole.finish_reason == "stop":
        jsonschema.validate(json.loads(whole.message.content), PERSON)


@pytest.mark.parametrize(("temperature", "seed"), SAMPLED, ids=SAMPLED_IDS)
def test_json_object_output_is_an_object(gw: Gateway, temperature: float, seed: int | None) -> None:
    reply = chat(gw, ASK_PERSON, temperature, seed, max_tokens=30, response_format={"type": "json_object"})
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # a small model may fill an object until max_tokens: then it says so
        assert choice.finish_reason == "length"
        assert choice.message.content.startswith("{")


def test_vllm_json_object_option_is_response_format_json_object(gw: Gateway) -> None:
    """vLLM's `structured_outputs: {"json_object": true}` was a 400 ("unknown field(s)")."""
    options = {"structured_outputs": {"json_object": True}}
    reply = chat(gw, ASK_PERSON, 1.0, 5, max_tokens=30, extra_body=options).choices[0]
    same = chat(gw, ASK_PERSON, 1.0, 5, max_tokens=30, response_format={"type": "json_object"}).choices[0]
    assert (reply.message.content, reply.finish_reason) == (same.message.content, same.finish_reason)
    assert reply.message.content.startswith("{")


@pytest.mark.parametrize(("temperature", "seed"), SAMPLED, ids=SAMPLED_IDS)
def test_structured_outputs_regex_and_choice_through_extra_body(
    gw: Gateway, temperature: float, seed: int | None
) -> None:
    regex = r"[0-9]{3}-[0-9]{4}"
    reply = gw.client.completions.create(
        model="", prompt="My phone number is", max_tokens=12, temperature=temperature, seed=seed,
        extra_body={"structured_outputs": {"regex": regex}},
    )  # fmt: skip
    assert re.fullmatch(regex, reply.choices[0].text), reply.choices[0].text
    assert reply.choices[0].finish_reason == "stop"
    choices = ["sunny", "rainy", "cloudy"]
    reply = chat(
        gw, [{"role": "user", "content": "Weather?"}], temperature, seed, max_tokens=8,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert reply.choices[0].message.content in choices
    grammar = 'start: "The answer is " ("yes" | "no") "."'
    reply = chat(
        gw, [{"role": "user", "content": "Is water wet?"}], temperature, seed, max_tokens=12,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )  # fmt: skip
    assert reply.choices[0].message.content in ("The answer is yes.", "The answer is no.")
    # vLLM's older guided_* fields, which clients still send, constrain the same way.
    reply = gw.client.completions.create(
        model="", prompt="My phone number is", max_tokens=12, temperature=temperature, seed=seed,
        extra_body={"guided_regex": regex},
    )  # fmt: skip
    assert re.fullmatch(regex, reply.choices[0].text), reply.choices[0].text
    reply = chat(
        gw, [{"role": "user", "content": "Weather?"}], temperature, seed, max_tokens=8,
        extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert reply.choices[0].message.content in choices
    reply = chat(gw, ASK_PERSON, temperature, seed, max_tokens=60, extra_body={"guided_json": PERSON})
    if reply.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    else:  # cut by max_tokens: a prefix of an object, never free text
        assert reply.choices[0].message.content.lstrip().startswith("{"), reply
    # llama-server's top-level grammar and json_schema, which its clients send to /v1 as well.
    reply = chat(
        gw, [{"role": "user", "content": "Is water wet?"}], temperature, seed, max_tokens=12,
        extra_body={"grammar": grammar},
    )  # fmt: skip
    assert reply.choices[0].message.content in ("The answer is yes.", "The answer is no.")
    reply = chat(gw, ASK_PERSON, temperature, seed, max_tokens=60, extra_body={"json_schema": PERSON})
    if reply.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    else:
        assert reply.choices[0].message.content.lstrip().startswith("{"), reply


def test_json_cut_by_max_tokens_finishes_with_length(gw: Gateway) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    reply = chat(gw, ASK_PERSON, 0.0, None, max_tokens=6, response_format=response_format)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)
    # A forced call cut short before its name is no call, and its text is not content either.
    reply = chat(gw, ASK_WEATHER, 0.0, None, max_tokens=3, tools=TOOLS, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls
    assert not choice.message.content


# -- tools ----------------------------------------------------------------------------------------


ASK_PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    }
]


def test_tool_choice_required_gives_one_array_of_calls_and_ends(gw: Gateway) -> None:
    """`required` with parallel calls (the default) makes one array of calls (at most
    MAX_PARALLEL_CALLS) and stops, streamed the same. (SmolLM2 ends these by itself; what made it
    repeat a call until max_tokens was an open schema: test_forced_calls_with_open_schemas_end.)"""
    for messages, tools in ((ASK_WEATHER, TOOLS), (ASK_PARIS, PARIS_TOOLS)):
        reply = chat(gw, messages, 0.0, None, max_tokens=400, tools=tools, tool_choice="required")
        choice = reply.choices[0]
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert 1 <= len(calls) <= MAX_PARALLEL_CALLS
        check_calls([(c.function.name, c.function.arguments) for c in calls])
        assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
        assert len({c.id for c in calls}) == len(calls)
        content, streamed, finish = streamed_chat(
            gw, messages, 0.0, None, max_tokens=400, tools=tools, tool_choice="required"
        )
        assert (content, finish) == ("", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in streamed] == [
            (c.function.name, c.function.arguments) for c in calls
        ]


# A Pydantic model with a nested one: its parameters refer to their own $defs.
PYDANTIC_INVITE = {
    "$defs": {
        "Guest": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
            "required": ["name"],
            "title": "Guest",
        }
    },
    "type": "object",
    "properties": {"guests": {"type": "array", "items": {"$ref": "#/$defs/Guest"}, "maxItems": 3}},
    "required": ["guests"],
    "title": "Invite",
}


def test_required_calls_of_a_tool_whose_parameters_refer_to_their_own_defs(gw: Gateway) -> None:
    """`required` puts every tool in one schema: the refs a tool makes into its own $defs must
    still resolve there (they were a 400, "Pointer '/$defs/Guest' does not exist")."""
    tools = [
        *PARIS_TOOLS,
        {"type": "function", "function": {"name": "invite", "parameters": PYDANTIC_INVITE}},
    ]
    ask = [{"role": "user", "content": "Invite Ann (30) and Bob to the party."}]
    for temperature, seed in SAMPLED:
        choice = chat(
            gw, ask, temperature, seed, max_tokens=200, tools=tools, tool_choice="required"
        ).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        schemas = {"get_weather": WEATHER, "invite": PYDANTIC_INVITE}
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


# LangChain's tool schemas never say additionalProperties: the model might add keys for ever.
OPEN_WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
}


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_calls_with_open_schemas_end(gw: Gateway, tool_choice) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": OPEN_WEATHER}}]
    replies = [
        chat(
            gw, ASK_WEATHER, temperature, seed, max_tokens=300, tools=tools, tool_choice=tool_choice
        ).choices[0]
        for temperature, seed in SAMPLED
    ]
    for choice in replies:
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            assert set(json.loads(call.function.arguments)) == {"city"}  # closed: no made-up keys


@pytest.mark.parametrize("max_tokens", [9, 14])
def test_a_forced_call_cut_by_max_tokens_is_the_same_streamed_and_not(gw: Gateway, max_tokens: int) -> None:
    """A call cut off is reported with the arguments written so far and finish_reason `length`,
    as a stream (which has already announced it) reports it; none of it is content. (9 tokens
    cannot hold a whole call of get_weather's two required fields; 14 may.)"""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in ("required", named):
        reply = chat(gw, ASK_WEATHER, 0.0, None, max_tokens=max_tokens, tools=TOOLS, tool_choice=tool_choice)
        choice = reply.choices[0]
        assert not choice.message.content
        whole = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        content, streamed, finish = streamed_chat(
            gw, ASK_WEATHER, 0.0, None, max_tokens=max_tokens, tools=TOOLS, tool_choice=tool_choice
        )
        assert (content, finish) == ("", choice.finish_reason)
        assert [(c["name"], c["arguments"]) for c in streamed] == whole, tool_choice
        if max_tokens == 9:
            assert choice.finish_reason == "length"
        if tool_choice == named:
            assert [name for name, _ in whole] == ["get_weather"]  # named from the start: cut or not, a call


def test_a_forced_call_cut_by_a_stop_string_does_not_finish_with_tool_calls(gw: Gateway) -> None:
    """A stop string inside a forced call's JSON (here the key "city") ends the output midway:
    the reply keeps the call with the arguments written so far, streamed or not, but its
    finish_reason stays `stop`. It used to be `tool_calls`, which tells the client to run the
    call, and the openai client's parsing helpers then failed on the arguments ('{"')."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in ("required", named):
        kwargs = {"max_tokens": 40, "tools": TOOLS, "tool_choice": tool_choice, "stop": ["city"]}
        choice = chat(gw, ASK_WEATHER, 0.0, None, **kwargs).choices[0]
        whole = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert choice.finish_reason == "stop", (tool_choice, whole)
        assert [name for name, _ in whole] == ["get_weather"] and whole[0][1].endswith('{"'), whole
        content, streamed, finish = streamed_chat(gw, ASK_WEATHER, 0.0, None, **kwargs)
        assert (content, finish) == ("", "stop")
        assert [(c["name"], c["arguments"]) for c in streamed] == whole
    # Anthropic's Messages say so too, whole and streamed: the whole reply's stop sequence ends
    # the call's arguments, not its (empty) text, and it said end_turn.
    messages = anthropic.Anthropic(
        base_url=gw.url, api_key="none", timeout=HTTP_TIMEOUT_S, max_retries=0
    ).messages
    body = {
        "model": "", "max_tokens": 40, "messages": ASK_WEATHER, "stop_sequences": ["city"],
        "tools": [{"name": "get_weather", "input_schema": WEATHER}], "tool_choice": {"type": "any"},
        "extra_body": {"temperature": 0.0},
    }  # fmt: skip
    reply = messages.create(**body)
    with messages.stream(**body) as stream:
        streamed_reply = stream.get_final_message()
    for message in (reply, streamed_reply):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "city"), message
        assert [block.type for block in message.content] == ["tool_use"], message
    # A stop sequence before the call is named ("name", a key of the forced calls' JSON) leaves no
    # call: the whole reply said end_turn, reading only the parsed message.
    body["stop_sequences"] = ["name"]
    reply = messages.create(**body)
    with messages.stream(**body) as stream:
        streamed_reply = stream.get_final_message()
    for message in (reply, streamed_reply):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "name"), message
    assert reply.content == streamed_reply.content, (reply, streamed_reply)


def test_a_constrained_reply_of_a_deepseek_r1_style_model_is_content_not_reasoning(
    gw: Gateway, smollm2_dir: Path, tmp_path: Path
) -> None:
    """A deepseek_r1 template opens the think block in the prompt, so an output is reasoning until
    its `</think>`. A constrained output is the grammar's from its first token: its JSON used to
    come back as `reasoning_content` with content null, and a streamed forced call as reasoning
    text with no `tool_calls` at all. (SmolLM2's template opens no think block: an in-process
    gateway on this run reads its outputs as deepseek_r1.)"""

    def make_gateway() -> AppGateway:
        settings = GatewaySettings(
            model="", max_model_len=2048, api_keys=frozenset(), max_concurrent_requests=16,
            max_body_bytes=1 << 20, run_dir=tmp_path, key_failures=ApiKeyFailures(AuditLog(tmp_path / "audit.jsonl", "r1")),
            max_prompt_chars=100_000, max_messages=100, template_timeout_s=5.0, body_timeout_s=30.0,
            reasoning_parser="deepseek_r1", max_costly_compiles=0,
        )  # fmt: skip
        return AppGateway(
            settings, AsyncClient(gw.run.run_dir), Tokenizer(smollm2_dir), HttpMetrics(CollectorRegistry())
        )

    with gateway_in_thread(make_gateway) as url:
        r1 = Gateway(gw.run, int(url.rsplit(":", 1)[1]))
        response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        message = chat(r1, ASK_PERSON, 0.0, None, max_tokens=100, response_format=response_format)
        message = message.choices[0].message
        assert message.reasoning_content is None, message
        jsonschema.validate(json.loads(message.content), PERSON)
        content, calls, finish = streamed_chat(
            r1, ASK_PERSON, 0.0, None, max_tokens=100, response_format=response_format
        )
        assert content == message.content
        named = {"type": "function", "function": {"name": "get_weather"}}
        content, calls, finish = streamed_chat(
            r1, ASK_WEATHER, 0.0, None, max_tokens=40, tools=TOOLS, tool_choice=named
        )
        assert (content, finish) == ("", "tool_calls"), calls
        check_calls([(c["name"], c["arguments"]) for c in calls])
        # Unconstrained, the same gateway reads the output as reasoning: no `</think>`, all of it.
        plain = chat(r1, ASK_PERSON, 0.0, None, max_tokens=8).choices[0].message
        assert plain.content in (None, "") and plain.reasoning_content, plain


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_call(gw: Gateway, stream: bool) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    if stream:
        content, calls, finish = streamed_chat(
            gw, ASK_WEATHER, 1.0, 7, max_tokens=40, tools=TOOLS, tool_choice=named
        )
        found = [(c["name"], c["arguments"]) for c in calls]
    else:
        choice = chat(gw, ASK_WEATHER, 1.0, 7, max_tokens=40, tools=TOOLS, tool_choice=named).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        found = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert finish == "tool_calls"
    assert not content
    assert len(found) == 1 and found[0][0] == "get_time"
    check_calls(found)


def test_parallel_tool_calls_false_gives_one_call(gw: Gateway) -> None:
    for seed in (1, 2):
        reply = chat(
            gw,
            ASK_WEATHER,
            1.0,
            seed,
            max_tokens=80,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_hermes_call_out_of_the_text(gw: Gateway, stream: bool) -> None:
    """Under auto the text is parsed: a regex makes the model write a Hermes call, the gateway
    returns it as tool_calls and nothing of it as content."""
    kwargs = dict(
        max_tokens=60,
        tools=TOOLS,
        tool_choice="auto",
        extra_body={"structured_outputs": {"regex": HERMES_CALL}},
    )
    if stream:
        content, calls, finish = streamed_chat(gw, ASK_WEATHER, 0.0, None, **kwargs)
        found = [(c["name"], c["arguments"]) for c in calls]
    else:
        choice = chat(gw, ASK_WEATHER, 0.0, None, **kwargs).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        found = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert finish == "tool_calls"
    assert not content
    assert len(found) == 1 and found[0][0] == "get_weather"
    check_calls(found)


def test_auto_output_is_the_hermes_parse_of_the_models_text(gw: Gateway) -> None:
    """Whatever SmolLM2 writes by itself under auto, the reply is the hermes parser's reading of
    that text (the raw text comes from the SDK: the same greedy request)."""
    with Client(gw.run.run_dir) as sdk:
        raw = sdk.chat(ASK_WEATHER, max_tokens=30, temperature=0.0, tools=TOOLS, tool_choice="auto")
    parsed = ToolParser("hermes").parse(raw.text, "any")
    choice = chat(gw, ASK_WEATHER, 0.0, None, max_tokens=30, tools=TOOLS, tool_choice="auto").choices[0]
    assert choice.message.content == parsed.content
    got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert got == [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls]
    assert choice.finish_reason == ("tool_calls" if got else raw.finish_reason)


def test_tool_choice_none_answers_in_text(gw: Gateway) -> None:
    choice = chat(gw, ASK_WEATHER, 0.0, None, max_tokens=12, tools=TOOLS, tool_choice="none").choices[0]
    plain = chat(gw, ASK_WEATHER, 0.0, None, max_tokens=12).choices[0]
    assert not choice.message.tool_calls
    assert choice.message.content == plain.message.content  # the tools are not offered at all


def test_a_conversation_with_earlier_calls_and_their_results(gw: Gateway) -> None:
    """OpenAI's shapes for a call and its answer are accepted and answered (how they are rendered
    is tests/test_tokenizer_tools.py's)."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    history = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"result": "sunny, 21 C"}'},
    ]
    reply = chat(gw, history, 0.0, None, max_tokens=20, tools=TOOLS).choices[0]
    assert reply.finish_reason in ("stop", "length", "tool_calls")
    assert reply.message.content or reply.message.tool_calls


def test_resumed_stream_names_its_calls_the_same(gw: Gateway) -> None:
    body = {
        "messages": ASK_WEATHER, "max_tokens": 80, "temperature": 1.0, "seed": 11,
        "tools": TOOLS, "tool_choice": "required",
    }  # fmt: skip
    events = gw.events(body)
    middle = next(
        i
        for i, (_, data) in enumerate(events)
        if data["choices"] and data["choices"][0]["delta"].get("tool_calls") and i > 2
    )
    last_id = events[middle][0]
    resumed = gw.events(body, {"last-event-id": last_id})

    def assemble(evs):
        calls: dict[int, dict] = {}
        for _, data in evs:
            for choice in data["choices"]:
                for call in choice["delta"].get("tool_calls") or []:
                    have = calls.setdefault(call["index"], {"arguments": ""})
                    for key in ("id", "type"):
                        if key in call:
                            have[key] = call[key]
                    function = call.get("function", {})
                    if "name" in function:
                        have["name"] = function["name"]
                    have["arguments"] += function.get("arguments", "")
        return calls

    assert assemble(events[: middle + 1] + resumed) == assemble(events)
    assert resumed[-1][1]["choices"][0]["finish_reason"] == "tool_calls"


def test_sdk_chat_returns_tool_calls(gw: Gateway) -> None:
    with Client(gw.run.run_dir) as sdk:
        result = sdk.chat(ASK_WEATHER, max_tokens=80, temperature=0.0, tools=TOOLS, tool_choice="required")
        named = sdk.chat(
            ASK_WEATHER, max_tokens=40, temperature=0.0, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
    assert result.finish_reason == "tool_calls"
    check_calls([(c.name, c.arguments) for c in result.tool_calls])
    assert result.content is None and result.text.startswith("[")
    assert [c.name for c in named.tool_calls] == ["get_weather"]
    check_calls([(c.name, c.arguments) for c in named.tool_calls])


# -- bad input ------------------------------------------------------------------------------------

BAD = {
    "response_format_type": ({"response_format": {"type": "xml"}}, "response_format.type"),
    "json_schema_without_schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema",
    ),
    "json_schema_strict_not_bool": (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
        "response_format.json_schema.strict",
    ),
    "schema_does_not_compile": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "array", "uniqueItems": True}, "strict": True},
            }
        },
        "response_format",
    ),
    "schema_too_large": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"description": "x" * 70_000}},
            }
        },
        "response_format.json_schema.schema",
    ),
    "two_structured_outputs": ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    "unknown_structured_output": ({"structured_outputs": {"xml": "a"}}, "structured_outputs"),
    "bad_regex": ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    "empty_choice": ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    "bad_grammar": ({"structured_outputs": {"grammar": "start: ((("}}, "structured_outputs.grammar"),
    "both_constraints": (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
    ),
    "guided_and_structured_outputs": (
        {"guided_regex": "a", "structured_outputs": {"regex": "a"}},
        "guided_regex",
    ),
    "two_guided": ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    "guided_and_llama_grammar": ({"guided_grammar": 'start: "a"', "grammar": 'start: "a"'}, "grammar"),
    "llama_grammar_matches_nothing": ({"grammar": "start: start"}, "grammar"),
    "llama_json_schema_not_a_schema": ({"json_schema": 3}, "json_schema"),
    "bad_guided_regex": ({"guided_regex": "(unclosed"}, "guided_regex"),
    "empty_guided_choice": ({"guided_choice": []}, "guided_choice"),
    "guided_json_not_a_schema": ({"guided_json": 3}, "guided_json"),
    "guided_and_response_format": (
        {"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}},
        "guided_json",
    ),
    "tool_not_a_function": ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    "tool_without_name": ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    "tools_not_a_list": ({"tools": {"a": 1}}, "tools"),
    "unknown_named_tool": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    "bad_tool_choice": ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    "tool_choice_without_tools": ({"tool_choice": "required"}, "tool_choice"),
    "forced_tools_and_response_format": (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    "regex_matches_nothing": ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs.regex"),
    "grammar_matches_nothing": (
        {"structured_outputs": {"grammar": "start: start"}},
        "structured_outputs.grammar",
    ),
    "tool_parameters_not_an_object": (
        {
            "tools": [{"type": "function", "function": {"name": "say", "parameters": {"type": "string"}}}],
            "tool_choice": {"type": "function", "function": {"name": "say"}},
        },
        "tools[0].function.parameters",
    ),
    "tool_schema_does_not_compile": (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"x": {"type": "array", "uniqueItems": True}},
                        },
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_structured_and_tool_input_gets_400_naming_the_field(gw: Gateway, case: str) -> None:
    extra, param = BAD[case]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    status, data = gw.post("/v1/chat/completions", body)
    error = json.loads(data)["error"]
    assert status == 400, (status, error)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    vllm_fields = [
        key
        for key in body
        if key in ("structured_outputs", "grammar", "json_schema") or key.startswith("guided_")
    ]
    extra_body = {key: body.pop(key) for key in vllm_fields} or None
    with pytest.raises(openai.BadRequestError):  # the openai client sees it as such
        gw.client.chat.completions.create(model="", extra_body=extra_body, **body)


def test_bad_constraints_on_completions_and_the_server_keeps_serving(gw: Gateway) -> None:
    status, data = gw.post("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "("}})
    assert status == 400 and json.loads(data)["error"]["param"] == "structured_outputs.regex"
    reply = gw.client.completions.create(model="", prompt="Hello", max_tokens=3, temperature=0.0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    reply = chat(gw, ASK_WEATHER, 0.0, None, max_tokens=40, tools=TOOLS, tool_choice="required")
    assert reply.choices[0].finish_reason == "tool_calls"


def test_forced_call_with_non_object_parameters_is_refused_naming_the_tool(gw: Gateway) -> None:
    """It used to come back as content, finish_reason stop and no tool_calls."""
    tools = [{"type": "function", "function": {"name": "say", "parameters": {"type": "string"}}}]
    with pytest.raises(openai.BadRequestError) as info:
        chat(gw, ASK_WEATHER, 0.0, None, max_tokens=8, tools=tools, tool_choice="required")
    assert "'say'" in info.value.message and "'object'" in info.value.message


def test_a_constraint_that_matches_nothing_is_a_400_not_an_empty_success(gw: Gateway) -> None:
    """`[^\\s\\S]` and `start: start` used to give 200, text "" and finish_reason stop."""
    for kind, spec in (("regex", r"[^\s\S]"), ("grammar", "start: start"), ("json", False)):
        with pytest.raises(openai.BadRequestError, match="matches no output at all"):
            gw.client.completions.create(
                model="", prompt="Hi", max_tokens=4, extra_body={"structured_outputs": {kind: spec}}
            )


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_pathological_regexes_fail_alone_with_their_reason_in_bounded_memory(gw: Gateway) -> None:
    """On main, two `(a{600}){611}` requests made an unrelated stream 5x slower, each distinct
    `(a{700}){700}b{k}` kept about 160 MB in the scheduler (852 -> 1806 MB after 6), and
    `(a{1000}){1000}` finished "error" with no reason. Here each fails on its own with a 400 that
    says why (the engine's lexer gives up on the first token: the fixture's grammar budget lets
    them past their compile), an unrelated stream runs to its end beside them, and the
    scheduler's memory stays within a bound: the byte-bounded cache holds at most one of them."""
    (scheduler,) = gw.run.stage_pids("scheduler")
    before = rss_mib(scheduler)
    unrelated: dict = {}
    thread = threading.Thread(
        target=lambda: unrelated.update(reply=streamed_chat(gw, ASK_PERSON, 0.0, None, max_tokens=48))
    )
    thread.start()
    patterns = [f"(a{{700}}){{700}}b{{{k}}}" for k in range(1, 7)] + ["(a{600}){611}", "(a{1000}){1000}"]
    try:
        for i, pattern in enumerate(patterns):
            with pytest.raises(openai.BadRequestError) as info:
                gw.client.completions.create(
                    model="",
                    prompt="a",
                    max_tokens=8,
                    stream=i % 2 == 1,
                    extra_body={"structured_outputs": {"regex": pattern}},
                )
            message = info.value.message
            # The lexer gives up while the mask is filled ("- structured.regex: ...") or, when a
            # loaded host's fill ran past its budget, as the first token advances the matcher
            # ("structured.regex: while generating: ..."): a 400 with its reason either way.
            assert "structured.regex: " in message, message
            assert "lexer error" in message or "too complex" in message, message
    finally:
        thread.join(timeout=HTTP_TIMEOUT_S)
    content, _, finish = unrelated["reply"]
    assert finish == "length" and content
    growth = rss_mib(scheduler) - before
    assert growth < 200, f"scheduler RSS grew {growth:.0f} MiB over {len(patterns)} pathological regexes"
    # And the engine still serves constrained requests.
    reply = gw.client.completions.create(
        model="", prompt="Year:", max_tokens=8, extra_body={"structured_outputs": {"regex": "[0-9]{4}"}}
    )
    assert re.fullmatch("[0-9]{4}", reply.choices[0].text)
