"""The tokenizer's side of tool calling, without sockets: tools in the prompt (the model's template,
or the instruction for one that ignores tools), the forced-call constraint, and the parse of the
finished output into content and calls (streamed, whole, resumed)."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from ipc import messages as m
from ipc.structured_output import for_tool_choice
from services.common.text import Tokenizer
from services.common.tool_parsers import call_id
from services.common.tools_prompt import tools_instruction
from services.tokenizer.core import RequestError, TokenizerCore

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# Qwen2.5-Instruct's chat template, in its tools parts: it renders `tools`, an assistant's
# `tool_calls` (arguments with tojson) and `tool` turns as <tool_response> blocks.
QWEN_STYLE_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def make_core(model_dir: Path) -> TokenizerCore:
    return TokenizerCore(
        Tokenizer(model_dir), 0, 1, max_model_len=2048, max_prompt_chars=100_000, default_max_tokens=16
    )


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> TokenizerCore:
    return make_core(smollm2_dir)


@pytest.fixture(scope="module")
def qwen_style_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen-style")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, out / name)
    (out / "chat_template.jinja").write_text(QWEN_STYLE_TEMPLATE)
    return out


def tools(choice: str = "auto", function: str = "", parallel: bool = True) -> m.Tools:
    return m.Tools(json.dumps(TOOLS), choice, function, parallel)


def chat(core: TokenizerCore, request_id: str, messages: list[m.ChatMessage], spec: m.Tools | None, **kw):
    return core.admit(b"c", m.Generate(request_id, messages=messages, tools=spec, **kw))


def prompt_text(core: TokenizerCore, entry) -> str:
    return core.tokenizer.decode(m.unpack_ids(entry.submit.prompt_ids).tolist(), skip_special_tokens=False)


def hf_prompt(model_dir: Path, messages: list[dict], tools_: list[dict] | None = None) -> str:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    return hf.apply_chat_template(messages, tools=tools_, tokenize=False, add_generation_prompt=True)


def finish(core: TokenizerCore, entry, text: str, reason: str = "stop", pieces: int = 1) -> list[m.Delta]:
    """Relay `text` as the engine would (in `pieces` deltas, the last one finishing); the replies."""
    engine = entry.submit.request_id
    replies, start = [], len(entry.output_ids)
    chars = entry.num_chars
    step = max(1, len(text) // pieces)
    cuts = [*[*range(0, len(text), step)][:pieces], len(text)]
    for k, (a, b) in enumerate(itertools.pairwise(cuts)):
        last = k == len(cuts) - 2
        delta = m.Delta(
            engine, start + k, chars + a, text[a:b], m.pack_ids([1]), finish_reason=reason if last else None
        )
        reply = core.relay(delta)
        if reply is not None:
            replies.append(reply.message)
    return replies


# -- tools into the prompt --------------------------------------------------------------------------


def test_a_template_that_ignores_tools_gets_the_instruction(smol: TokenizerCore, smollm2_dir: Path) -> None:
    entry = chat(smol, "a", [m.ChatMessage(**x) for x in ASK], tools())
    expected = hf_prompt(smollm2_dir, [{"role": "system", "content": tools_instruction(TOOLS)}, *ASK])
    assert prompt_text(smol, entry) == expected
    system = [m.ChatMessage("system", "Be brief."), *(m.ChatMessage(**x) for x in ASK)]
    entry = chat(smol, "b", system, tools())
    expected = hf_prompt(
        smollm2_dir, [{"role": "system", "content": "Be brief.\n\n" + tools_instruction(TOOLS)}, *ASK]
    )
    assert prompt_text(smol, entry) == expected


def test_tool_choice_none_offers_no_tools(smol: TokenizerCore, smollm2_dir: Path) -> None:
    entry = chat(smol, "n", [m.ChatMessage(**x) for x in ASK], tools("none"))
    assert prompt_text(smol, entry) == hf_prompt(smollm2_dir, ASK)
    assert entry.tool_parser is None and entry.submit.params.structured is None
    (reply,) = finish(smol, entry, CALL)
    assert reply.finish_reason == "stop" and reply.tools is None  # a call-like text stays text


def test_earlier_calls_become_hermes_text_for_a_template_without_tools(
    smol: TokenizerCore, smollm2_dir: Path
) -> None:
    history = [
        m.ChatMessage(**ASK[0]),
        m.ChatMessage("assistant", None, [m.ToolCall("call_1", "get_weather", '{"city": "Paris"}')]),
        m.ChatMessage("tool", '{"temp": 21}', tool_call_id="call_1"),
    ]
    entry = chat(smol, "h", history, tools())
    expected = hf_prompt(
        smollm2_dir,
        [
            {"role": "system", "content": tools_instruction(TOOLS)},
            ASK[0],
            {"role": "assistant", "content": CALL},
            {"role": "tool", "content": '{"temp": 21}'},
        ],
    )
    assert prompt_text(smol, entry) == expected


def test_a_template_that_renders_tools_gets_them_with_openai_messages(qwen_style_dir: Path) -> None:
    core = make_core(qwen_style_dir)
    history = [
        m.ChatMessage(**ASK[0]),
        m.ChatMessage("assistant", None, [m.ToolCall("call_1", "get_weather", '{"city": "Paris"}')]),
        m.ChatMessage("tool", '{"temp": 21}', tool_call_id="call_1"),
    ]
    entry = chat(core, "q", history, tools())
    hf_history = [
        ASK[0],
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    text = prompt_text(core, entry)
    assert text == hf_prompt(qwen_style_dir, hf_history, TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert core.auto_tool_format == "hermes"


def test_deeply_nested_past_arguments_are_passed_as_text_not_a_crash(qwen_style_dir: Path) -> None:
    """A template that renders tools gets past calls' arguments as objects (json.loads): 1500
    levels of nesting raised RecursionError out of admit, which killed the tokenizer stage."""
    core = make_core(qwen_style_dir)
    nested = "[" * 1500 + "]" * 1500  # past the json module's recursion limit (1000)
    history = [
        m.ChatMessage(**ASK[0]),
        m.ChatMessage("assistant", None, [m.ToolCall("call_1", "get_weather", nested)]),
        m.ChatMessage("tool", "ok", tool_call_id="call_1"),
    ]
    entry = chat(core, "deep", history, tools())
    assert nested in prompt_text(core, entry)


# -- the forced call ---------------------------------------------------------------------------------


def test_required_and_named_choices_constrain_the_output(smol: TokenizerCore) -> None:
    entry = chat(smol, "r", [m.ChatMessage(**x) for x in ASK], tools("required", parallel=False))
    assert entry.submit.params.structured == for_tool_choice(TOOLS, "required", parallel_tool_calls=False)
    named = {"type": "function", "function": {"name": "get_time"}}
    entry = chat(smol, "f", [m.ChatMessage(**x) for x in ASK], tools("function", "get_time"))
    assert entry.submit.params.structured == for_tool_choice(TOOLS, named)
    entry = chat(smol, "u", [m.ChatMessage(**x) for x in ASK], tools("auto"))
    assert entry.submit.params.structured is None


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        (m.Tools("not json"), {}, "tools: not valid JSON"),
        (m.Tools('{"a": 1}'), {}, "tools: must be a list"),
        (m.Tools('[{"type": "function", "function": {}}]'), {}, "function.name"),
        (m.Tools(json.dumps(TOOLS), "function", "nope"), {}, "no tool named 'nope'"),
        (m.Tools(json.dumps(TOOLS), "function"), {}, "needs its name"),
        (
            m.Tools(json.dumps(TOOLS), "required"),
            {"params": m.SamplingParams(structured=m.StructuredOutput("regex", "a+"))},
            "cannot be combined",
        ),
    ],
)
def test_bad_tools_are_refused(smollm2_dir: Path, spec: m.Tools, kwargs: dict, message: str) -> None:
    smol = make_core(smollm2_dir)
    with pytest.raises(RequestError, match=message) as info:
        chat(smol, "bad", [m.ChatMessage(**x) for x in ASK], spec, **kwargs)
    assert info.value.code == "invalid_request"
    with pytest.raises(RequestError, match="only a chat"):
        smol.admit(b"c", m.Generate("p", prompt="hi", tools=tools()))
    with pytest.raises(RequestError, match="content is required"):
        chat(smol, "c", [m.ChatMessage("user")], None)
    assert not smol.journal


# -- the parse of the finished output --------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_auto_output_is_cut_into_content_and_calls(smol: TokenizerCore, stream: bool) -> None:
    entry = chat(smol, f"auto-{stream}", [m.ChatMessage(**x) for x in ASK], tools(), stream=stream)
    text = "Let me look.\n" + CALL
    replies = finish(smol, entry, text, pieces=4)
    last = replies[-1]
    assert last.finish_reason == "tool_calls"
    assert last.tools == m.ParsedTools(
        "Let me look.", [m.ToolCall(call_id(f"auto-{stream}", 0), "get_weather", '{"city": "Paris"}')]
    )
    assert "".join(r.text for r in replies) == text  # the text itself is untouched
    assert all(r.tools is None for r in replies[:-1])
    assert len(replies) == (4 if stream else 1)


def test_parallel_false_keeps_the_first_call_and_length_is_no_call(smol: TokenizerCore) -> None:
    entry = chat(smol, "one", [m.ChatMessage(**x) for x in ASK], tools(parallel=False))
    (reply,) = finish(smol, entry, CALL + "\n" + CALL.replace("Paris", "Rome"))
    assert [c.arguments for c in reply.tools.calls] == ['{"city": "Paris"}']
    entry = chat(smol, "cut", [m.ChatMessage(**x) for x in ASK], tools())
    (reply,) = finish(smol, entry, CALL[:30], reason="length")
    assert reply.finish_reason == "length"
    assert reply.tools == m.ParsedTools(CALL[:30], [])


def test_forced_output_is_read_as_calls(smol: TokenizerCore) -> None:
    entry = chat(smol, "req", [m.ChatMessage(**x) for x in ASK], tools("required"))
    (reply,) = finish(smol, entry, '[{"name": "get_time", "parameters": {}}]')
    assert reply.finish_reason == "tool_calls"
    assert reply.tools == m.ParsedTools(None, [m.ToolCall(call_id("req", 0), "get_time", "{}")])
    entry = chat(smol, "cut", [m.ChatMessage(**x) for x in ASK], tools("required"))
    (reply,) = finish(smol, entry, '[{"name": "get_ti', reason="length")
    # Cut off before the call's name: no call, and a forced output is never content.
    assert (reply.finish_reason, reply.tools) == ("length", m.ParsedTools(None, []))
    entry = chat(smol, "cut2", [m.ChatMessage(**x) for x in ASK], tools("required"))
    (reply,) = finish(smol, entry, '[{"name": "get_time", "parameters": {"tz', reason="length")
    assert (reply.finish_reason, reply.tools) == (
        "length",
        m.ParsedTools(None, [m.ToolCall(call_id("cut2", 0), "get_time", '{"tz')]),
    )
    entry = chat(smol, "fn", [m.ChatMessage(**x) for x in ASK], tools("function", "get_weather"))
    (reply,) = finish(smol, entry, '{"city": "Oslo"}')
    assert reply.tools == m.ParsedTools(
        None, [m.ToolCall(call_id("fn", 0), "get_weather", '{"city": "Oslo"}')]
    )


def test_a_resumed_request_parses_the_text_its_client_already_had(smol: TokenizerCore) -> None:
    """A client that failed over resubmits with what it has: the new tokenizer's parse covers it."""
    ids = smol.tokenizer.encode(CALL)
    head_ids = ids[:5]
    head = smol.tokenizer.decode(head_ids)
    entry = smol.admit(
        b"c",
        m.Generate(
            "res",
            messages=[m.ChatMessage(**x) for x in ASK],
            tools=tools(),
            resume_output_ids=m.pack_ids(head_ids),
            resume_num_chars=len(head),
        ),
    )
    (reply,) = finish(smol, entry, CALL[len(head) :])[-1:]
    assert reply.finish_reason == "tool_calls"
    assert reply.tools.calls == [m.ToolCall(call_id("res", 0), "get_weather", '{"city": "Paris"}')]
