"""Reasoning output (services/gateway/reasoning.py): <think> split off whole and streamed, and the
parser chosen from the model."""

from __future__ import annotations

import asyncio
import json
import random
from unittest.mock import ANY

import msgspec
import pytest

from services.gateway import protocol as p
from services.gateway.anthropic import AnthropicReply, MessagesRequest
from services.gateway.anthropic import chat_request as anthropic_chat_request
from services.gateway.formats import ChatFormat, ChoiceOutput, Piece
from services.gateway.reasoning import ReasoningStream, reasoning_style, split_reasoning
from services.gateway.response_store import ResponseStore
from services.gateway.responses import ResponsesReply, ResponsesRequest

CASES = [  # style, output, (reasoning_content, content)
    ("qwen3", "<think>\nthe sky</think>\n\nBlue.", ("\nthe sky", "\n\nBlue.")),
    ("qwen3", "Blue.", (None, "Blue.")),  # enable_thinking false: no block
    ("qwen3", "<think>cut off by max_to", ("cut off by max_to", "")),
    ("qwen3", "<think>a</think>b<think>c</think>", ("a", "b<think>c</think>")),  # the first block only
    ("qwen3", "a < b <thin k> </think>", (None, "a < b <thin k> </think>")),
    ("deepseek_r1", "the sky</think>Blue.", ("the sky", "Blue.")),  # the template opened <think>
    ("deepseek_r1", "\n<think>the sky</think>Blue.", ("the sky", "Blue.")),
    ("deepseek_r1", "still thinking", ("still thinking", "")),
    ("deepseek_r1", "", (None, "")),
]


@pytest.mark.parametrize(("style", "output", "want"), CASES)
def test_whole_and_streamed_give_the_same_split(style, output, want) -> None:
    assert split_reasoning(style, output) == want
    rng = random.Random(len(output))
    chunkings = [list(output), [output]]  # token by token (a tag split over deltas), and whole
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(output) + 1), min(4, len(output) + 1)))
        chunkings.append([output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)], strict=True)])
    for chunks in chunkings:
        stream = ReasoningStream(style)
        parts = [stream.feed(chunk) for chunk in chunks] + [stream.finish()]
        reasoning = "".join(r for r, _ in parts)
        assert (reasoning or None, "".join(c for _, c in parts)) == want, chunks


PREFILL_CASES = [  # style, the assistant's prefill, the reply, (reasoning_content, content)
    ("qwen3", "<think>so", " far</think>Blue.", (" far", "Blue.")),  # the prefill opened the block
    ("qwen3", "<think>a</think>Sure", ", blue.", (None, ", blue.")),  # the prefill closed it
    ("qwen3", "Sure", "<think>x</think>y", ("x", "y")),  # before the block, as ever
    ("deepseek_r1", "Sure", ", blue.</think>", (None, ", blue.</think>")),  # no prompt opened one
    ("deepseek_r1", "<think>hm", " the sky</think>Blue.", (" the sky", "Blue.")),
    ("deepseek_r1", "<thi", "nk>x</think>y", (None, "nk>x</think>y")),  # a tag split over both: none
]


@pytest.mark.parametrize(("style", "prefill", "output", "want"), PREFILL_CASES)
def test_a_reply_continuing_a_prefill_starts_where_the_prefill_left_off(style, prefill, output, want) -> None:
    assert split_reasoning(style, output, prefill) == want
    stream = ReasoningStream(style, prefill)
    parts = [stream.feed(char) for char in output] + [stream.finish()]
    assert ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts)) == want


def test_a_tag_is_held_back_until_it_is_certain() -> None:
    stream = ReasoningStream("qwen3")
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>I") == ("I", "")
    assert stream.feed(" see</") == (" see", "")
    assert stream.feed("think>ok") == ("", "ok")


def test_the_style_is_chosen_from_the_template_and_the_vocabulary() -> None:
    has_think = lambda tag: True  # noqa: E731
    assert reasoning_style("auto", lambda: "<|im_start|>assistant\n", has_think) == "qwen3"
    assert reasoning_style("auto", lambda: "<｜Assistant｜><think>\n", has_think) == "deepseek_r1"
    assert reasoning_style("auto", lambda: "<think>\n", lambda tag: False) is None  # no <think> token
    assert reasoning_style("none", lambda: "<think>\n", has_think) is None
    assert reasoning_style("deepseek_r1", lambda: "", lambda tag: False) == "deepseek_r1"


def _events(data: list[bytes]) -> list[dict]:
    return [
        json.loads(line[6:])
        for blob in data
        for line in blob.decode().splitlines()
        if line.startswith("data: ")
    ]


def test_responses_and_messages_carry_the_thinking_streamed_and_not(tmp_path) -> None:
    """The chat reply's reasoning_content, translated: a Responses `reasoning` item (streamed as
    reasoning_text deltas) and an Anthropic `thinking` block (thinking_delta), the same text
    whole and streamed, before the answer."""
    output = "<think>the sky is blue</think>Blue."
    usage = p.UsageOut(3, len(output), 3 + len(output))
    fmt = ChatFormat("m", None, None, reasoning="qwen3")  # type: ignore[arg-type]  # no logprobs: no names
    choice = ChoiceOutput()
    choice.add(Piece(output, [], [], [], "stop"))
    whole = fmt.whole([choice], usage)
    assert (whole.choices[0].message.reasoning_content, whole.choices[0].message.content) == (
        "the sky is blue",
        "Blue.",
    )
    chunks = [
        chunk
        for k, c in enumerate(output)
        for chunk in fmt.chunks(0, Piece(c, [], [], [], "stop" if k == len(output) - 1 else None), 0)
    ]

    store = ResponseStore(tmp_path, 0, 60.0, 1 << 20)
    request = ResponsesRequest(input="Why?", store=False)
    reply = json.loads(asyncio.run(ResponsesReply(request, "m", [], store).whole(whole)))
    assert [item["type"] for item in reply["output"]] == ["reasoning", "message"]
    assert reply["output"][0]["content"] == [{"type": "reasoning_text", "text": "the sky is blue"}]
    streamed = ResponsesReply(request, "m", [], store)
    events = _events([e for c in chunks for e in streamed.chunk(c)] + asyncio.run(streamed.closing(usage)))
    assert (
        "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        == "the sky is blue"
    )
    assert [e["text"] for e in events if e["type"] == "response.reasoning_text.done"] == ["the sky is blue"]
    assert events[-1]["response"]["output"] == [{**item, "id": ANY} for item in reply["output"]]

    message = json.loads(asyncio.run(AnthropicReply("m", []).whole(whole)))
    assert message["content"] == [
        {"type": "thinking", "thinking": "the sky is blue", "signature": ""},
        {"type": "text", "text": "Blue."},
    ]
    streamed_message = AnthropicReply("m", [])
    events = _events([e for c in chunks for e in streamed_message.chunk(c)])
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    thinking = "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
    assert (starts, thinking) == (["thinking", "text"], "the sky is blue")


@pytest.mark.parametrize("include", [True, False])
def test_the_chat_reply_names_the_thinking_both_ways_or_leaves_it_out(include: bool) -> None:
    """The chat reply's thinking under vLLM's `reasoning` and DeepSeek's and llama.cpp's
    `reasoning_content`, whole and streamed; with include_reasoning false, under neither, the
    content the same."""
    output = "<think>the sky is blue</think>Blue."
    fmt = ChatFormat("m", None, None, reasoning="qwen3", include_reasoning=include)  # type: ignore[arg-type]
    choice = ChoiceOutput()
    choice.add(Piece(output, [], [], [], "stop"))
    message = json.loads(msgspec.json.encode(fmt.whole([choice], p.UsageOut(3, 9, 12))))["choices"][0][
        "message"
    ]
    want = "the sky is blue" if include else None
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == (want, want, "Blue.")
    deltas = [
        json.loads(msgspec.json.encode(chunk))["choices"][0]["delta"]
        for k, c in enumerate(output)
        for chunk in fmt.chunks(0, Piece(c, [], [], [], "stop" if k == len(output) - 1 else None), 0)
    ]
    for name in ("reasoning", "reasoning_content"):
        assert "".join(d.get(name, "") for d in deltas) == (want or "")
    assert "".join(d.get("content") or "" for d in deltas) == "Blue."
    # Token by token: a token of thinking left out is no delta at all (not an empty one).
    tokens = ["<think>", "the sky", " is blue", "</think>", "Blue."]
    fmt = ChatFormat("m", None, None, reasoning="qwen3", include_reasoning=include)  # type: ignore[arg-type]
    chunks = [
        c
        for k, t in enumerate(tokens)
        for c in fmt.chunks(0, Piece(t, [], [], [], "stop" if k == 4 else None), 0)
    ]
    assert len(chunks) == (len(tokens) + 1 if include else len(tokens) + 1 - 2), chunks


def thought(text: str) -> dict[str, str]:
    return {"type": "thinking", "thinking": text, "signature": "s"}


def test_thinking_sent_back_to_the_messages_api_is_the_assistant_turns_reasoning() -> None:
    """Anthropic's thinking blocks in an assistant message: that chat turn's reasoning, which
    the chat template renders or not (test_tokenizer_core); a turn without any has none."""
    body = {
        "model": "m",
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": [thought("sum"), thought(" it"), {"type": "text", "text": "4"}]},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": [{"type": "text", "text": "6"}]},
        ],
    }
    chat, _ = anthropic_chat_request(msgspec.convert(body, MessagesRequest))
    assert [(x.role, x.reasoning) for x in chat.messages] == [
        ("user", None), ("assistant", "sum it"), ("user", None), ("assistant", None),
    ]  # fmt: skip
