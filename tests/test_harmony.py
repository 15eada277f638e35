"""gpt-oss's chat format, harmony (services/common/harmony.py): its output read into
reasoning_content, content and tool_calls, whole and streamed, and through real processes on a
random gpt-oss whose tokenizer has the harmony special tokens."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from services.common.harmony import speaks_harmony
from services.common.tool_parsers import ToolCallStream, ToolParser, call_id
from services.gateway import protocol as p
from services.gateway.anthropic import AnthropicReply
from services.gateway.formats import ChatFormat, ChoiceOutput, Piece
from services.gateway.reasoning import reasoning_style
from services.gateway.response_store import ResponseStore
from services.gateway.responses import ResponsesReply, ResponsesRequest

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
WEATHER = '{"city": "Paris"}'
ANALYSIS = "<|channel|>analysis<|message|>The user wants the sky's colour.<|end|>"
CALL = f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{WEATHER}<|call|>"

# output -> (reasoning_content, content, [(name, arguments)])
CASES = {
    "analysis then final": (
        f"{ANALYSIS}<|start|>assistant<|channel|>final<|message|>Blue.<|return|>",
        ("The user wants the sky's colour.", "Blue.", []),
    ),
    "final without a stop token": (  # the detokenizer may leave the stop token out
        f"{ANALYSIS}<|start|>assistant<|channel|>final<|message|>Blue.",
        ("The user wants the sky's colour.", "Blue.", []),
    ),
    "a call with constrained json": (
        f"{ANALYSIS}{CALL}",
        ("The user wants the sky's colour.", None, [("get_weather", WEATHER)]),
    ),
    "the recipient in the role part, a bare json": (
        '<|channel|>analysis<|message|>a<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"x": 1}',
        ("a", None, [("f", '{"x": 1}')]),
    ),
    "the first header's recipient": (
        " to=functions.f<|channel|>commentary<|message|>{}<|call|>",
        (None, None, [("f", "{}")]),
    ),
    "several calls, a preamble": (
        "<|channel|>commentary<|message|>Let me look.<|end|>"
        f"{CALL}<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{{}}<|call|>",
        (None, "Let me look.", [("get_weather", WEATHER), ("get_time", "{}")]),
    ),
    "a built-in tool's recipient": (
        '<|channel|>analysis<|message|>search<|end|><|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"q": "x"}<|call|>',
        ("search", None, [("browser.search", '{"q": "x"}')]),
    ),
    "cut off in the reasoning": ("<|channel|>analysis<|message|>still thin", ("still thin", "", [])),
    "cut off in a call": (
        '<|channel|>commentary to=functions.f<|message|>{"a": ',
        (None, None, [("f", '{"a": ')]),
    ),
    "no headers at all": ("Just text, < and | too.", (None, "Just text, < and | too.", [])),
    "an empty channel": ("<|channel|><|message|>x<|end|>", (None, "<|channel|><|message|>x", [])),
    "no channel": ("<|start|>assistant<|message|>x<|return|>", (None, "<|start|>assistant<|message|>x", [])),
    "another role": (
        "<|start|>user<|channel|>final<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>ok",
        (None, "<|start|>user<|channel|>final<|message|>hiok", []),
    ),
    "a terminator in the header": (
        "<|channel|>final<|end|>lost<|message|>x",
        (None, "<|channel|>finallost<|message|>x", []),
    ),
    "a header that never ends": ("<|channel|>" + "a" * 600, (None, "<|channel|>" + "a" * 600, [])),
    "an empty recipient": (
        "<|channel|>commentary to=<|message|>{}",
        (None, "<|channel|>commentary to=<|message|>{}", []),
    ),
}


def _split(parsed) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    return (
        parsed.reasoning,
        parsed.content,
        [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls],
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_harmony_output_is_read_into_channels(case: str) -> None:
    text, want = CASES[case]
    parsed = ToolParser("harmony").parse(text, "req-1")
    assert _split(parsed) == want
    assert [c["id"] for c in parsed.tool_calls] == [call_id("req-1", k) for k in range(len(want[2]))]


def replay(parser: ToolParser, chunks: list[str]) -> tuple[str, str, list[dict]]:
    """Stream the chunks; rebuild reasoning, content and calls from the deltas as a client does."""
    stream = ToolCallStream(parser, "req-1")
    reasoning = content = ""
    built: list[dict] = []
    for delta in [d for chunk in chunks for d in stream.feed(chunk)] + stream.finish():
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(built):
                assert call["function"]["arguments"] == ""
                built.append({"id": call["id"], "type": call["type"], "function": dict(call["function"])})
            else:
                built[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    return reasoning, content, built


def tokens(text: str) -> list[str]:
    """The text as a harmony tokenizer would cut it: each marker one token, the rest characters."""
    pattern = "(" + "|".join(re.escape(m) for m in MARKERS) + ")"
    return [
        piece for part in re.split(pattern, text) for piece in ([part] if part in MARKERS else list(part))
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_deltas_split_at_every_boundary_rebuild_the_parse(case: str) -> None:
    """Token by token, character by character (a marker split over deltas), and cut in two at
    every character: the deltas of each channel concatenate to the whole parse."""
    text, _ = CASES[case]
    parser = ToolParser("harmony")
    whole = parser.parse(text, "req-1")
    chunkings = [tokens(text), list(text), [text]] + [[text[:k], text[k:]] for k in range(1, len(text))]
    for chunks in chunkings:
        reasoning, content, built = replay(parser, chunks)
        assert built == whole.tool_calls, chunks
        assert (reasoning or None, content.strip()) == (whole.reasoning, (whole.content or "").strip()), (
            chunks
        )


def test_a_stream_holds_a_header_back_until_its_message_marker() -> None:
    stream = ToolCallStream(ToolParser("harmony"), "r")
    assert stream.feed("<|channel|>analy") == []
    assert stream.feed("sis<|message|>I think<|e") == [{"reasoning_content": "I think"}]
    assert stream.feed("nd|><|start|>assistant<|channel|>commentary to=functions.f") == []
    assert stream.feed("<|message|>{") == [
        {"tool_calls": [{"index": 0, "id": call_id("r", 0), "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},
    ]  # fmt: skip


def test_harmony_is_chosen_by_architecture_template_or_setting() -> None:
    no_token = lambda tag: False  # noqa: E731
    assert speaks_harmony("auto", ["GptOssForCausalLM"], None, no_token)
    assert speaks_harmony("auto", ["LlamaForCausalLM"], "<|start|>assistant<|channel|>", lambda tag: True)
    assert not speaks_harmony("auto", ["LlamaForCausalLM"], "<|channel|>", no_token)  # no such token
    assert not speaks_harmony("none", ["GptOssForCausalLM"], None, no_token)
    assert not speaks_harmony("qwen3", ["GptOssForCausalLM"], None, no_token)
    assert speaks_harmony("harmony", ["LlamaForCausalLM"], None, no_token)
    assert reasoning_style("auto", lambda: "", lambda tag: True, is_harmony=True) == "harmony"
    assert reasoning_style("harmony", lambda: "", no_token) == "harmony"


def _events(data: list[bytes]) -> list[dict]:
    lines = [line for blob in data for line in blob.decode().splitlines()]
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_chat_responses_and_messages_read_harmony_streamed_and_not(tmp_path: Path) -> None:
    """The gateway's formats: a chat without tools (no tokenizer parse) gets reasoning_content,
    content and the calls from the harmony text whole, the same streamed token by token, and
    finish_reason tool_calls; Responses and Messages translate it."""
    text = f"{ANALYSIS}{CALL}"
    usage = p.UsageOut(3, 30, 33)
    fmt = ChatFormat("m", None, None, reasoning="harmony")  # type: ignore[arg-type]  # no logprobs
    choice = ChoiceOutput()
    choice.add(Piece(text, [], [], [], "stop"))
    whole = fmt.whole([choice], usage)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("The user wants the sky's colour.", None)
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather", WEATHER)]
    assert whole.choices[0].finish_reason == "tool_calls"

    pieces = tokens(text)
    chunks = [
        chunk
        for k, piece in enumerate(pieces)
        for chunk in fmt.chunks(0, Piece(piece, [], [], [], "stop" if k == len(pieces) - 1 else None), 0)
    ]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.reasoning_content or "" for d in deltas) == message.reasoning_content
    assert not "".join(d.content or "" for d in deltas)
    arguments = "".join(call["function"]["arguments"] for d in deltas for call in d.tool_calls or [])
    assert arguments == WEATHER
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    store = ResponseStore(tmp_path, 0, 60.0, 1 << 20)
    request = ResponsesRequest(input="Weather?", store=False)
    reply = json.loads(asyncio.run(ResponsesReply(request, "m", [], store).whole(whole)))
    assert [item["type"] for item in reply["output"]] == ["reasoning", "function_call"]
    assert reply["output"][1]["arguments"] == WEATHER
    anthropic = json.loads(asyncio.run(AnthropicReply("m", []).whole(whole)))
    assert [block["type"] for block in anthropic["content"]] == ["thinking", "tool_use"]
    assert anthropic["content"][1]["input"] == json.loads(WEATHER)
    streamed = AnthropicReply("m", [])
    events = _events([e for c in chunks for e in streamed.chunk(c)])
    thinking = "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
    assert thinking == message.reasoning_content
