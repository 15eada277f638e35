"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

A Messages request is translated into a chat completion (`translated.py`): `system` becomes the
system message, `tool_use` blocks an assistant's `tool_calls`, `tool_result` blocks `tool` turns,
`tools` / `tool_choice` OpenAI's (auto -> auto, any -> required, tool -> the named function,
none -> none). The reply comes back as content blocks (`thinking` for a reasoning model's
thinking, services/gateway/reasoning.py; `text`, `tool_use`) with Anthropic's stop reasons, or as
its stream events (`thinking_delta`); `thinking` blocks sent back in an assistant's message are
its chat turn's `reasoning` (the chat template decides whether to render them), and the
`thinking` parameter sets the chat template's `enable_thinking`. Errors are `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from services.gateway import protocol as p
from services.gateway.app import JSON, Gateway, chat_to_render
from services.gateway.errors import ApiError, check_range, invalid
from services.gateway.formats import Piece
from services.gateway.jobs import SEED_HEADER, header_seed, plan_chat
from services.gateway.translated import at_origin, named_event, run_translated

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",  # a method the route does not take: the client's error
    408: "timeout_error",  # the body did not arrive within gateway.body_timeout_s
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
TOOL_CHOICES: dict[str, str] = {"auto": "auto", "any": "required", "none": "none"}
# The chat path's names for a tool's fields, in its error messages -> Anthropic's.
_CHAT_TOOL_FIELD = re.compile(r"tools\[(\d+)\]\.function\.(parameters|name|description)?")
_CHAT_FORMAT_FIELD = re.compile(r"response_format(\.json_schema)?")
# Chat's names for the rest of what a Messages request translates into (ipc/validation.py's stop
# checks, jobs.py's forced tool choice), and Anthropic's.
_CHAT_NAMES = [
    (re.compile(r"\bstop\b(?= has | strings )"), "stop_sequences"),
    (re.compile(r"tool_choice \{'type': 'function', 'function': \{'name': ('[^']*'|\"[^\"]*\")\}\}"),
     r"tool_choice {'type': 'tool', 'name': \1}"),
    (re.compile(r"tool_choice 'required'"), "tool_choice {'type': 'any'}"),
]  # fmt: skip


# -- requests ---------------------------------------------------------------------------------


class TextBlock(msgspec.Struct, tag="text", tag_field="type", frozen=True):
    text: str


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type", frozen=True):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type", frozen=True):
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type", frozen=True):
    """An earlier assistant turn's thinking, which clients send back: that chat turn's
    `reasoning`, which a reasoning model's chat template renders or leaves out (most keep only
    the thinking after the last user turn: a tool-calling loop's)."""

    thinking: str = ""
    signature: str = ""


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class MessageIn(msgspec.Struct, frozen=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolIn(msgspec.Struct, frozen=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None


class ToolChoiceIn(msgspec.Struct, frozen=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfigIn(msgspec.Struct, frozen=True):
    """Extended thinking: on or off for a reasoning model whose chat template reads
    `enable_thinking` (Qwen3's); `budget_tokens` is not enforced (max_tokens bounds the whole)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(msgspec.Struct, frozen=True, kw_only=True):
    # Its model (and MessagesRequest's) may name a LoRA adapter (Gateway.check_model).
    takes_adapter: ClassVar[bool] = True
    model: str = ""
    messages: list[MessageIn]
    system: str | list[TextBlock] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingConfigIn | None = None


class MessagesRequest(CountTokensRequest, frozen=True, kw_only=True):
    max_tokens: int  # required, as Anthropic's API has it
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    output_config: dict[str, Any] | None = None  # its `format` (a JSON schema) constrains the text


def _text(blocks: str | list[TextBlock]) -> str:
    return blocks if isinstance(blocks, str) else "".join(b.text for b in blocks)


def _turns(
    i: int, message: MessageIn, tool_use_ids: set[str], last: bool = False
) -> tuple[list[dict[str, Any]], list[str]]:
    """One Anthropic message -> chat messages: a user's tool results become `tool` turns (before
    its text: they answer the calls just made), an assistant's tool uses its `tool_calls`; and the
    field each came from (`messages[i]`, a tool result's `messages[i].content[k]`).
    `tool_use_ids` are the earlier assistant messages' tool_use ids, which a tool result must
    answer; this message's are added to them. `last`: the request's last message, the one an
    assistant's may leave empty (a prefill of nothing), as Anthropic's."""
    if isinstance(message.content, str):
        if not message.content and not (last and message.role == "assistant"):
            # Anthropic's 400: an empty turn renders as nothing the model could answer or continue
            raise invalid(f"messages[{i}].content: must not be empty", f"messages[{i}].content")
        return [{"role": message.role, "content": message.content}], [f"messages[{i}]"]
    if not message.content:
        raise invalid(
            f"messages[{i}].content: at least one content block is required", f"messages[{i}].content"
        )
    texts, thinking, calls, results, result_fields = [], [], [], [], []
    for k, block in enumerate(message.content):
        field = f"messages[{i}].content[{k}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            if message.role != "assistant":  # the model's own thinking; a user has none to send
                raise invalid(f"{field}: thinking blocks belong to assistant messages", f"{field}.type")
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise invalid(f"{field}: tool_use blocks belong to assistant messages", f"{field}.type")
            tool_use_ids.add(block.id)
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
            )
        else:
            if message.role != "user":
                raise invalid(f"{field}: tool_result blocks belong to user messages", f"{field}.type")
            if block.tool_use_id not in tool_use_ids:
                # Anthropic's 400: a result that answers no call would reach the template as a
                # tool turn with nothing to pair it with.
                raise invalid(
                    f"{field}: tool_result's tool_use_id {block.tool_use_id[:80]!r} matches no tool_use "
                    "block of an earlier assistant message",
                    f"{field}.tool_use_id",
                )
            content = _text(block.content)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {content}" if block.is_error else content})  # fmt: skip
            result_fields.append(field)
    text = "".join(texts)
    if message.role == "assistant":
        # A turn that only calls tools has no content (null, as OpenAI's).
        turn = {
            "role": "assistant",
            "content": None if calls and not text else text,
            "tool_calls": calls or None,
        }
        if thinking:
            turn["reasoning"] = "".join(thinking)
        return [turn], [f"messages[{i}]"]
    if text or not results:
        return [*results, {"role": "user", "content": text}], [*result_fields, f"messages[{i}]"]
    return results, result_fields


def _chat_messages(req: CountTokensRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat messages of a request, and the field each came from (`at_origin`)."""
    if not req.messages:
        raise invalid("messages: at least one message is required", "messages")
    system = _text(req.system) if req.system is not None else ""
    messages, origins = ([{"role": "system", "content": system}], ["system"]) if system else ([], [])
    tool_use_ids: set[str] = set()
    for i, message in enumerate(req.messages):
        turns, fields = _turns(i, message, tool_use_ids, last=i == len(req.messages) - 1)
        messages += turns
        origins += fields
    return messages, origins


def _tools(req: CountTokensRequest) -> tuple[list[dict[str, Any]] | None, Any, bool]:
    """OpenAI's tools, tool_choice and parallel_tool_calls for Anthropic's."""
    tools = None
    if req.tools is not None:
        tools = []
        for tool in req.tools:
            function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description is not None:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
    choice = req.tool_choice
    if choice is None:
        return tools, None, True
    if choice.type == "tool":
        if choice.name is None:
            raise invalid("tool_choice: type tool needs the tool's name", "tool_choice.name")
        return (
            tools,
            {"type": "function", "function": {"name": choice.name}},
            not choice.disable_parallel_tool_use,
        )
    return tools, TOOL_CHOICES[choice.type], not choice.disable_parallel_tool_use


def _anthropic_field(text: str) -> str:
    def rename(match: re.Match[str]) -> str:
        field = {"parameters": "input_schema", None: ""}.get(match.group(2), match.group(2))
        return f"tools[{match.group(1)}].{field}" if field else f"tools[{match.group(1)}]"

    text = _CHAT_FORMAT_FIELD.sub("output_config.format", _CHAT_TOOL_FIELD.sub(rename, text))
    for pattern, name in _CHAT_NAMES:
        text = pattern.sub(name, text)
    return text


def _response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
        raise invalid(
            "output_config.format must be {'type': 'json_schema', 'schema': {...}}", "output_config.format"
        )
    # Anthropic's structured outputs have no lenient mode: a keyword that cannot be enforced is a 400.
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def _continues_prefill(req: CountTokensRequest) -> bool:
    """The last message is the assistant's text, for the reply to continue (a turn that calls
    tools is finished)."""
    last = req.messages[-1] if req.messages else None
    if last is None or last.role != "assistant":
        return False
    if isinstance(last.content, str):
        return bool(last.content.strip())
    blocks = last.content
    return not any(isinstance(b, ToolUseBlock) for b in blocks) and bool(
        _text([b for b in blocks if isinstance(b, TextBlock)]).strip()
    )


def chat_request(req: MessagesRequest) -> tuple[p.ChatCompletionRequest, list[str]]:
    """The chat completion a Messages request runs as, and the field each of its messages came
    from (`at_origin`)."""
    check_range("temperature", req.temperature, 0.0, 1.0)  # Anthropic's range
    fields, origins = _prompt_fields(req)
    body = {
        **fields,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        # The stop sequence stays in the engine's output, so that the reply can say which one it
        # was (stop_sequence); AnthropicReply cuts it off.
        "stop": req.stop_sequences,
        "include_stop_str_in_output": bool(req.stop_sequences),
        "response_format": _response_format(req.output_config),
    }
    return msgspec.convert({k: v for k, v in body.items() if v is not None}, p.ChatCompletionRequest), origins


def _prompt_fields(req: CountTokensRequest) -> tuple[dict[str, Any], list[str]]:
    """The chat completion fields that make a Messages request's prompt, and the field each chat
    message came from."""
    tools, tool_choice, parallel = _tools(req)
    messages, origins = _chat_messages(req)
    fields = {
        "messages": messages,
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        # A last message of the assistant's is its prefill: the reply continues it (Anthropic's).
        "continue_final_message": _continues_prefill(req) or None,
        # The chat template's switch (Qwen3's): disabled closes an empty think block in the prompt.
        "chat_template_kwargs": None
        if req.thinking is None
        else {"enable_thinking": req.thinking.type != "disabled"},
    }
    return fields, origins


# -- replies ----------------------------------------------------------------------------------


def error_body(error: ApiError, origins: Sequence[str] = ()) -> bytes:
    """Anthropic's error JSON; `origins`: the field each chat message came from (`at_origin`)."""
    message = _anthropic_field(at_origin(error.message, origins))
    kind = ERROR_TYPES.get(error.status, "api_error")
    return msgspec.json.encode({"type": "error", "error": {"type": kind, "message": message}})


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is ({} for text that is not one, which
    only a model free to write anything, under tool_choice auto, can produce)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(usage: p.UsageOut | None) -> dict[str, int]:
    """Anthropic's usage: its `input_tokens` are the prompt's tokens not read from the cache, which
    `cache_read_input_tokens` counts (the prompt is their sum, as clients that track their context
    add them up); a stream's message_delta carries all three, as the whole reply does."""
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0}
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {
        "input_tokens": usage.prompt_tokens - cached,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": cached,
    }


class AnthropicReply:
    """The Translation (translated.py) of one Messages request."""

    def __init__(self, model: str, stop_sequences: list[str], origins: Sequence[str] = ()) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.origins = origins  # the field each chat message came from, for errors (`at_origin`)
        self.model = model
        self.stop_sequences = stop_sequences
        self.text = ""  # the engine's output so far, stop sequence included
        self.stop_sequence: str | None = None
        self.stop_reason: str | None = None
        self.block: Literal["thinking", "text", "tool_use"] | None = None  # the open content block
        self.num_blocks = 0

    def _stop_hit(self, text: str, finish_reason: str | None) -> str | None:
        if finish_reason != "stop":
            return None
        # Of the sequences the text ends with (one may end another), the engine stopped at the one
        # that starts first, the longest (services/detokenizer/core.py): its start must not stay.
        return max((s for s in self.stop_sequences if text.endswith(s)), key=len, default=None)

    def _stop_reason(self, finish_reason: str | None) -> str:
        if self.stop_sequence is not None:
            return "stop_sequence"
        return STOP_REASONS.get(finish_reason or "", "end_turn")

    def piece(self, piece: Piece) -> Piece:
        self.text += piece.text
        hit = self._stop_hit(self.text, piece.finish_reason)
        if hit is not None:
            self.stop_sequence = hit
            # The detokenizer holds back a possible stop sequence's start, so the whole
            # sequence comes in the last piece.
            piece.text = piece.text[: max(0, len(piece.text) - len(hit))]
        return piece

    def _message(self, content: list[dict[str, Any]], usage: p.UsageOut | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": _usage(usage),
        }

    async def whole(self, completion: p.ChatCompletion) -> bytes:
        choice = completion.choices[0]
        text = choice.message.content or ""
        calls = choice.message.tool_calls or []
        # `piece` has read the engine's output (found and cut a stop sequence) before the chat
        # format parsed it into text and calls, as in a stream; but with tools the text is the
        # tokenizer's parse of the whole output, which still ends with the stop sequence.
        if self.stop_sequence is not None and text.endswith(self.stop_sequence):
            text = text[: -len(self.stop_sequence)]
        content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        if choice.message.reasoning_content:  # a reasoning model's thinking (reasoning.py): first
            content.insert(
                0, {"type": "thinking", "thinking": choice.message.reasoning_content, "signature": ""}
            )
        for call in calls:
            content.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                            "input": _tool_input(call.function.arguments)})  # fmt: skip
        self.stop_reason = self._stop_reason(choice.finish_reason)
        return msgspec.json.encode(self._message(content, completion.usage))

    def opening(self, usage: p.UsageOut | None) -> list[bytes]:
        # Anthropic's message_start counts the prompt (clients track their context with it).
        start = {"type": "message_start", "message": self._message([], usage)}
        return [named_event("message_start", start), named_event("ping", {"type": "ping"})]

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.block = block["type"]
        event = {"type": "content_block_start", "index": self.num_blocks, "content_block": block}
        return [*out, named_event("content_block_start", event)]

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        self.block = None
        self.num_blocks += 1
        return [
            named_event("content_block_stop", {"type": "content_block_stop", "index": self.num_blocks - 1})
        ]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return named_event(
            "content_block_delta", {"type": "content_block_delta", "index": self.num_blocks, "delta": delta}
        )

    def chunk(self, chunk: p.ChatCompletionChunk) -> list[bytes]:
        out: list[bytes] = []
        for choice in chunk.choices:
            delta = choice.delta
            if delta.reasoning_content:
                if self.block != "thinking":
                    out += self._open({"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content}))
            if delta.content:
                if self.block != "text":
                    out += self._open({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta.content}))
            for call in delta.tool_calls or []:
                if "id" in call:  # a call's first delta
                    out += self._open(
                        {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
                    )
                arguments = call["function"].get("arguments")
                if arguments:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
            if choice.finish_reason is not None:
                self.stop_reason = self._stop_reason(choice.finish_reason)
        return out

    async def closing(self, usage: p.UsageOut, timings: p.Timings | None = None) -> list[bytes]:
        # Anthropic's events have no timings (llama-server gives none on this API either).
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
            "usage": _usage(usage),
        }
        return [
            *self._close(),
            named_event("message_delta", delta),
            named_event("message_stop", {"type": "message_stop"}),
        ]

    def error_body(self, error: ApiError) -> bytes:
        return error_body(error, self.origins)

    def error_event(self, error: ApiError) -> bytes:
        return b"event: error\ndata: " + error_body(error, self.origins) + b"\n\n"


# -- the endpoints ----------------------------------------------------------------------------


class MessagesApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def _error(self, request: Request, error: ApiError, origins: Sequence[str] = ()) -> Response:
        body = error_body(error, origins)
        return self.gateway.finish(request, Response(body, error.status, error.headers, JSON))

    async def messages(self, request: Request) -> Response:
        origins: list[str] = []
        try:
            req = await self.gateway.read_body(request, MessagesRequest)
            chat, origins = chat_request(req)
            plan = plan_chat(chat, header_seed(request.headers.get(SEED_HEADER)))
            model = self.gateway.with_adapter(req.model, plan)
            reply = AnthropicReply(model, list(req.stop_sequences or []), origins)
            return run_translated(self.gateway, request, plan, model, reply, req.stream)
        except ApiError as error:
            return self._error(request, error, origins)

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's length in tokens as the tokenizer stage renders it (chat template, tools
        through the template or the tools instruction), without running the model."""
        origins: list[str] = []
        try:
            req = await self.gateway.read_body(request, CountTokensRequest)
            fields, origins = _prompt_fields(req)
            chat = msgspec.convert(
                {k: v for k, v in fields.items() if v is not None}, p.ChatCompletionRequest
            )
            count = (await self.gateway.input_tokens(chat_to_render(chat)))["input_tokens"]
            return self.gateway.finish(
                request, Response(msgspec.json.encode({"input_tokens": count}), 200, media_type=JSON)
            )
        except ApiError as error:
            return self._error(request, error, origins)
