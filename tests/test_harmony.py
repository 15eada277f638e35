"""gpt-oss's chat format, harmony (services/common/harmony.py): its output read into
reasoning_content, content and tool_calls, whole and streamed, and through real processes on a
random gpt-oss whose tokenizer has the harmony special tokens."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc import messages as m
from services.common.harmony import speaks_harmony
from services.common.text import Tokenizer
from services.common.tool_parsers import ToolCallStream, ToolParser, call_id
from services.gateway import protocol as p
from services.gateway.anthropic import AnthropicReply
from services.gateway.formats import ChatFormat, ChoiceOutput, Piece
from services.gateway.reasoning import reasoning_style
from services.gateway.response_store import ResponseStore
from services.gateway.responses import ResponsesReply, ResponsesRequest
from services.tokenizer.core import TokenizerCore
from tests.harness import assert_clean, brigade_run, free_port

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
    "an empty call, then a broken header": (  # the call's body and the content start alike
        "<|channel|>commentary to=functions.f<|message|><|start|>assistant<|channel|>final<|end|>",
        (None, "<|start|>assistant<|channel|>final", [("f", "")]),
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
    # MAX_HEADER_CHARS (512) is the longest header: a stream must not decide before it knows.
    "the longest header": (
        "<|channel|>analysis" + " " * 493 + "<|message|>x",
        ("x", "", []),
    ),
    "a header one character too long": (
        "<|channel|>analysis" + " " * 494 + "<|message|>x",
        (None, "<|channel|>analysis" + " " * 494 + "<|message|>x", []),
    ),
    "a header that never ends": ("<|channel|>" + "a" * 600, (None, "<|channel|>" + "a" * 600, [])),
    "a content type in the role part": (
        " to=functions.f<|constrain|>json<|channel|>commentary<|message|>{}",
        (None, " to=functions.f<|constrain|>json<|channel|>commentary<|message|>{}", []),
    ),
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


# Generated outputs: well-formed messages, broken headers and stray text and markers in any order,
# cut anywhere.
BODY = st.text("ab <|>{}\n", max_size=10)
HEADERS = st.sampled_from([
    "<|channel|>analysis", "<|channel|>final", "<|channel|>commentary",
    "<|channel|>commentary to=functions.f <|constrain|>json", " to=functions.g<|channel|>commentary json",
    "<|start|>assistant<|channel|>final", "<|start|>assistant to=functions.h<|channel|>commentary",
    "<|start|>user<|channel|>final", "<|channel|>", "<|start|>assistant", "junk", "",
])  # fmt: skip


@st.composite
def harmony_outputs(draw) -> str:
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        parts.append(draw(HEADERS) + draw(st.sampled_from(["<|message|>", ""])) + draw(BODY))
        parts.append(draw(st.sampled_from(["<|end|>", "<|call|>", "<|return|>", ""])))
    return "".join(parts)


@settings(max_examples=150, deadline=None)
@given(text=harmony_outputs(), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_generated_harmony_outputs_stream_as_they_parse(text: str, cuts: list[int]) -> None:
    parser = ToolParser("harmony")
    whole = parser.parse(text, "req-1")
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for chunking in (chunks, tokens(text)):
        reasoning, content, built = replay(parser, chunking)
        assert built == whole.tool_calls
        assert (reasoning or None, content.strip()) == (whole.reasoning, (whole.content or "").strip())


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


# A harmony chat template of the test's own (a checkpoint ships its own; Brigade renders whichever
# it gets): the reasoning effort in the system message, instructions and tools (the `functions`
# namespace) in the developer message, earlier calls on the commentary channel, and tool results
# from the function they answer.
HARMONY_TEMPLATE = """<|start|>system<|message|>Reasoning: {{ reasoning_effort | default("medium") }}
# Valid channels: analysis, commentary, final.<|end|>
{%- set instructions = messages | selectattr("role", "equalto", "system") | map(attribute="content") | list %}
{%- if instructions or tools %}<|start|>developer<|message|>
{%- if instructions %}# Instructions

{{ instructions | join("\\n") }}{% endif %}
{%- if tools %}

# Tools

## functions

namespace functions {
{% for tool in tools %}
// {{ tool.function.description }}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions{% endif %}<|end|>{% endif %}
{%- set last = namespace(call="") %}
{%- for message in messages %}
{%- if message.role == "user" %}<|start|>user<|message|>{{ message.content }}<|end|>
{%- elif message.role == "assistant" and message.tool_calls is defined %}
{%- for call in message.tool_calls %}{% set last.call = call.function.name %}<|start|>assistant to=functions.{{ call.function.name }}<|channel|>commentary <|constrain|>json<|message|>{{ call.function.arguments | tojson }}<|call|>
{%- endfor %}
{%- elif message.role == "assistant" %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>
{%- elif message.role == "tool" %}<|start|>functions.{{ last.call }} to=assistant<|channel|>commentary<|message|>{{ message.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]  # fmt: skip
# Grammars (llguidance's Lark: `<|channel|>` is that special token) that make the random model
# write harmony with the special tokens themselves: some thinking, then an answer or a call.
THINKING = '<|channel|> "analysis" <|message|> /[a-z ]{1,16}/ <|end|> <|start|> "assistant" <|channel|>'
ANSWER_GRAMMAR = f'start: {THINKING} "final" <|message|> /[a-z ]{{1,16}}/'
CALL_GRAMMAR = (
    f'start: {THINKING} "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
    '"{\\"city\\": \\"" /[a-z]{1,8}/ "\\"}"'
)


@pytest.fixture(scope="module")
def harmony_tokenizer_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer plus the harmony special tokens, and the template above."""
    from transformers import PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("harmony-tokenizer")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(smollm2_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    return out


def test_the_tokenizer_keeps_harmony_markers_and_ends_a_chat_at_return_and_call(
    harmony_tokenizer_dir: Path,
) -> None:
    """A harmony chat's params, set once at admission for every client: special tokens kept in
    the text (they mark the channels), <|return|> and <|call|> stop it beside the client's own
    stop tokens (the generation config may name neither), and a chat with tools is parsed as
    harmony. A plain prompt is left as it was sent."""
    tokenizer = Tokenizer(harmony_tokenizer_dir)
    core = TokenizerCore(tokenizer, 0, 1, max_model_len=1024, max_prompt_chars=10_000, default_max_tokens=7,
                         is_harmony=True)  # fmt: skip
    markers = [tokenizer.encode(tag)[0] for tag in ("<|return|>", "<|call|>")]
    chat = core.admit(
        b"c",
        m.Generate("a", messages=[m.ChatMessage("user", "hi")], params=m.SamplingParams(stop_token_ids=[5])),
    )
    assert not chat.submit.params.skip_special_tokens
    assert chat.submit.params.stop_token_ids == [5, *markers]
    assert core.auto_tool_format == "harmony"
    prompt = core.admit(b"c", m.Generate("b", prompt="hi"))
    assert prompt.submit.params.skip_special_tokens and prompt.submit.params.stop_token_ids == []


@pytest.fixture(scope="module")
def harmony_model_dir(harmony_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random gpt-oss with the harmony tokenizer and template, and <|return|> and <|call|> as
    its eos tokens (as gpt-oss's generation config lists them)."""
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import save_random_model
    from tests.test_moe import random_moe_config

    tokenizer_dir = harmony_tokenizer_dir
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    eos = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    config = random_moe_config(
        "gpt-oss", vocab_size=len(tokenizer), max_position_embeddings=1024, bos_token_id=1,
        eos_token_id=eos, pad_token_id=0,
    )  # fmt: skip
    out = tmp_path_factory.mktemp("gpt-oss-harmony")
    return save_random_model(config, out, seed=5, std=0.1, tokenizer_from=tokenizer_dir)


def _streamed(sdk, **kwargs) -> tuple[str, str, list[dict], str | None]:
    """A streamed chat's reasoning, content and calls rebuilt from its deltas, and its finish_reason."""
    reasoning = content = ""
    calls: list[dict] = []
    reason = None
    for chunk in sdk.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.index == len(calls):
                    calls.append({"name": call.function.name, "arguments": ""})
                calls[call.index]["arguments"] += call.function.arguments or ""
            reason = choice.finish_reason or reason
    return reasoning, content, calls, reason


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpt_oss_chat_speaks_harmony_through_real_processes(harmony_model_dir: Path, tmp_path: Path) -> None:
    """A random gpt-oss (harmony chosen by its architecture) made to write harmony's special
    tokens: its analysis comes back as reasoning_content and its final channel as content, a
    call on the commentary channel as tool_calls with finish_reason tool_calls, the same
    streamed; and a conversation with tools, an earlier call, its result and a reasoning effort
    is rendered as transformers renders it with the same template; Responses takes
    `reasoning.effort`, and an effort no API has is a 400 naming its field, as is beam search."""
    import openai
    from transformers import AutoTokenizer

    port = free_port()
    run_dir = tmp_path / "run"
    overrides = (
        f"model.path={harmony_model_dir}", "model.dtype=float32", "model.max_model_len=1024",
        f"gateway.port={port}",
    )  # fmt: skip
    with brigade_run(run_dir, *overrides):
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300)
        chat = [{"role": "user", "content": "Is the sky blue?"}]
        base = dict(model=str(harmony_model_dir), messages=chat, max_tokens=64, temperature=1.0)
        for seed in (1, 2):
            kwargs = dict(base, seed=seed, extra_body={"structured_outputs": {"grammar": ANSWER_GRAMMAR}})
            reply = sdk.chat.completions.create(**kwargs).choices[0]
            assert re.fullmatch("[a-z ]{1,16}", reply.message.reasoning_content), reply
            assert re.fullmatch("[a-z ]{1,16}", reply.message.content), reply
            assert reply.finish_reason == "stop" and not reply.message.tool_calls
            streamed = _streamed(sdk, **kwargs)
            assert streamed == (reply.message.reasoning_content, reply.message.content, [], "stop")

        kwargs = dict(base, seed=3, tools=TOOLS, extra_body={"structured_outputs": {"grammar": CALL_GRAMMAR}})
        reply = sdk.chat.completions.create(**kwargs).choices[0]
        assert reply.finish_reason == "tool_calls" and not reply.message.content, reply
        assert re.fullmatch("[a-z ]{1,16}", reply.message.reasoning_content), reply
        [call] = reply.message.tool_calls
        assert call.function.name == "get_weather"
        assert re.fullmatch("[a-z]{1,8}", json.loads(call.function.arguments)["city"]), call
        reasoning, content, calls, reason = _streamed(sdk, **kwargs)
        assert (reasoning, content.strip(), reason) == (reply.message.reasoning_content, "", "tool_calls")
        assert calls == [{"name": "get_weather", "arguments": call.function.arguments}]

        conversation = [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]  # fmt: skip
        scored = sdk.chat.completions.create(
            model=str(harmony_model_dir), messages=conversation, tools=TOOLS, max_tokens=1,
            reasoning_effort="high", extra_body={"prompt_logprobs": 0},
        )  # fmt: skip
        prompt_ids = [int(next(iter(entry))) for entry in scored.prompt_logprobs[1:]]
        response = sdk.responses.create(
            model=str(harmony_model_dir), input="Hi", max_output_tokens=1, reasoning={"effort": "low"}
        )
        assert response.reasoning.effort == "low"
        for bad, param in (
            (lambda: sdk.chat.completions.create(**base, reasoning_effort="extreme"), "reasoning_effort"),
            # beams are decoded by the gateway, without the markers a harmony reply is read from
            (
                lambda: sdk.chat.completions.create(**base, extra_body={"use_beam_search": True}),
                "use_beam_search",
            ),
            (
                lambda: sdk.responses.create(model="m", input="Hi", reasoning={"effort": "extreme"}),
                "reasoning.effort",
            ),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                bad()
            assert refused.value.body["param"] == param, refused.value.body
    assert_clean(run_dir)
    reference = AutoTokenizer.from_pretrained(harmony_model_dir)
    for message in conversation:  # transformers' templates read arguments as objects
        for c in message.get("tool_calls", []):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    want = reference.apply_chat_template(
        conversation, tools=TOOLS, add_generation_prompt=True, reasoning_effort="high", tokenize=False
    )
    assert "Reasoning: high" in want and "to=functions.get_weather" in want and "sunny" in want
    assert prompt_ids == reference.encode(want, add_special_tokens=False)[1:]
