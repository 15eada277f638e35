"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A Responses request is translated into a chat completion (`translated.py`): `instructions`
becomes the system message, `input` (a string, or message, `function_call` and
`function_call_output` items; a message's `input_image` parts become the chat's `image_url`
parts) the conversation, function `tools` / `tool_choice` OpenAI chat's,
`text.format` the chat's `response_format`, `max_output_tokens` its `max_tokens`. The reply comes
back as output items (`message` with `output_text`, `function_call`), or as the Responses event
stream. With `store` (the default, as OpenAI's), the response and its conversation are kept in
the run's `ResponseStore`, so that `previous_response_id` continues it on any replica.

A reasoning model's thinking (services/gateway/reasoning.py) comes back as a `reasoning` item
before the message (`content: [{"type": "reasoning_text", "text"}]`, `summary: []`), streamed as
`response.reasoning_text.delta` / `.done` events. Reasoning items in `input` are accepted and
dropped, as vLLM does: the chat templates of reasoning models leave earlier turns' thinking out
of the prompt, and a stored response's conversation keeps only what was said.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from services.gateway import protocol as p
from services.gateway.app import Gateway, chat_to_render, json_response
from services.gateway.errors import ApiError, check_range, invalid
from services.gateway.formats import Piece
from services.gateway.jobs import SEED_HEADER, header_seed, plan_chat
from services.gateway.response_store import ResponseStore, StoredResponse
from services.gateway.translated import at_origin, named_event, run_translated

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
TOOL_CHOICES = ("none", "auto", "required")
# The chat path's names in its error messages -> the Responses API's.
_RENAMES = [
    (re.compile(r"tools\[(\d+)\]\.function\b"), r"tools[\1]"),
    (re.compile(r"response_format\.json_schema\b"), "text.format"),
    (re.compile(r"response_format\b"), "text.format"),
    (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
    (re.compile(r"^messages\b"), "input"),
]


# -- requests ---------------------------------------------------------------------------------


class ContentPartIn(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None
    image_url: str | None = None  # input_image: a data URL or an http(s) URL
    file_id: str | None = None  # input_image from the Files API, which Brigade does not serve
    detail: str | None = None  # low/high/auto: a model's processor fixes the resolution


class InputItem(msgspec.Struct, frozen=True):
    """One input item; `type` says which fields it needs (message: role, content;
    function_call: call_id, name, arguments; function_call_output: call_id, output)."""

    type: str = "message"
    id: str | None = None  # kept for GET /v1/responses/{id}/input_items, which makes one where none
    role: str | None = None
    content: str | list[ContentPartIn] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPartIn] | None = None


class ToolIn(msgspec.Struct, frozen=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, frozen=True):
    format: dict[str, Any] | None = None


class ReasoningConfig(msgspec.Struct, frozen=True):
    """`reasoning`: its `effort` reaches the chat template as chat's `reasoning_effort` does;
    `summary` is accepted and ignored (the reply carries the model's reasoning itself)."""

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesRequest(msgspec.Struct, frozen=True, kw_only=True):
    takes_adapter: ClassVar[bool] = True  # its model may name a LoRA adapter (Gateway.check_model)
    model: str = ""
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ToolIn] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    # llama-server's: each chunk's last event carries its timings so far, response.completed the
    # request's (a stream only, as llama-server)
    timings_per_token: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None


class InputTokensRequest(ResponsesRequest, frozen=True, kw_only=True):
    """/v1/responses/input_tokens' body: OpenAI's takes a previous response alone, no input."""

    input: str | list[InputItem] = []


def _item_text(field: str, content: str | list[ContentPartIn] | None) -> str:
    if content is None:
        raise invalid(f"{field}: required", field, "missing_required_parameter")
    if isinstance(content, str):
        return content
    return "".join(_part_text(f"{field}[{k}]", part) for k, part in enumerate(content))


def _part_text(field: str, part: ContentPartIn) -> str:
    if part.type not in TEXT_PARTS or part.text is None:
        raise invalid(f"{field}: only text parts ({', '.join(TEXT_PARTS)}) and, in a message, input_image "
                      f"are supported, got type {part.type!r}", f"{field}.type")  # fmt: skip
    return part.text


def _item_content(field: str, content: str | list[ContentPartIn] | None) -> str | list[dict[str, Any]]:
    """A message's content as chat content: its text, or its parts in order when it has images
    (`input_image`, as the chat path's `image_url` parts: the tokenizer reads them)."""
    if not isinstance(content, list) or all(part.type != "input_image" for part in content):
        return _item_text(field, content)
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        if part.type != "input_image":
            parts.append({"type": "text", "text": _part_text(f"{field}[{k}]", part)})
        elif part.image_url is not None:
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            reason = "a file_id (there is no Files API here)" if part.file_id is not None else "no image_url"
            raise invalid(f"{field}[{k}]: input_image needs an image_url (a data: or http(s) URL), got {reason}",
                          f"{field}[{k}].image_url")  # fmt: skip
    return parts


def _required(field: str, value: str | None) -> str:
    if value is None:
        raise invalid(f"{field}: required", field, "missing_required_parameter")
    return value


# An input item's id prefix, by type, where the client gave it none (as OpenAI's ids read).
_ITEM_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def listed_input_items(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """`input` as GET /v1/responses/{id}/input_items lists it: each item with an id (the
    client's, or one made here) and status `completed`, a message's text content as one part."""
    if isinstance(items, str):
        items = [InputItem(role="user", content=items)]
    listed: list[dict[str, Any]] = []
    for item in items:
        fields = {name: value for name, value in msgspec.to_builtins(item).items() if value is not None}
        if item.id is None:
            fields["id"] = f"{_ITEM_ID_PREFIXES.get(item.type, 'item')}_{uuid.uuid4().hex}"
        if isinstance(item.content, str):
            part_type = "output_text" if item.role == "assistant" else "input_text"
            fields["content"] = [{"type": part_type, "text": item.content}]
        for name in ("content", "output"):  # parts as sent: the fields a part has
            if isinstance(fields.get(name), list):
                fields[name] = [{k: v for k, v in part.items() if v is not None} for part in fields[name]]
        listed.append({**fields, "status": "completed"})
    return listed


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """`input` -> chat messages (the SDK's dicts). Consecutive function calls join the assistant
    turn before them, as one chat turn with several tool_calls."""
    return input_turns(items)[0]


def input_turns(items: str | list[InputItem]) -> tuple[list[dict[str, Any]], list[str]]:
    """`input` -> chat messages, and the field each came from (`input[i]`), which names it
    in a refusal of the chat path (`renamed`)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], ["input"]
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    for i, item in enumerate(items):
        field = f"input[{i}]"
        if item.type == "message":
            if item.role not in ROLES:
                raise invalid(
                    f"{field}.role must be one of {list(ROLES)}, got {item.role!r}", f"{field}.role"
                )
            messages.append({"role": item.role, "content": _item_content(f"{field}.content", item.content)})
            origins.append(field)
        elif item.type == "function_call":
            call = {
                "id": _required(f"{field}.call_id", item.call_id),
                "type": "function",
                "function": {"name": _required(f"{field}.name", item.name),
                             "arguments": _required(f"{field}.arguments", item.arguments)},
            }  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                if last.get("tool_calls") is None:
                    last["tool_calls"] = []
                last["tool_calls"].append(call)  # in place: a copy each call is quadratic in them
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(field)
        elif item.type == "reasoning":
            continue  # earlier thinking: not part of the prompt (the module's docstring)
        elif item.type == "function_call_output":
            output = (
                item.output if isinstance(item.output, str) else _item_text(f"{field}.output", item.output)
            )
            messages.append({"role": "tool", "tool_call_id": _required(f"{field}.call_id", item.call_id),
                             "content": output})  # fmt: skip
            origins.append(field)
        else:
            raise invalid(
                f"{field}.type: must be message, reasoning, function_call or function_call_output, got "
                f"{item.type!r}",
                f"{field}.type",
            )
    return messages, origins


def _chat_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.type != "function":
            raise invalid(
                f"tools[{i}].type: only function tools are supported, got {tool.type!r}", f"tools[{i}].type"
            )
        function: dict[str, Any] = {"name": _required(f"tools[{i}].name", tool.name)}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.parameters or {"type": "object", "properties": {}}
        tools.append({"type": "function", "function": function})
    return tools


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice  # the chat path checks the value
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise invalid("tool_choice: a named function is {'type': 'function', 'name': ...}", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return fmt  # json_object, or a type the chat path refuses naming it


def renamed(error: ApiError, origins: Sequence[str] = ()) -> ApiError:
    """A chat-path error, in the Responses API's field names: `messages[i]` is the field that
    chat message came from (`origins`: `input[k]`, `instructions`, a previous response's turn)."""
    message = at_origin(error.message, origins)
    param = at_origin(error.param, origins) if error.param is not None else None
    for pattern, name in _RENAMES:
        message = pattern.sub(name, message)
        param = pattern.sub(name, param) if param is not None else None
    return ApiError(error.status, message, param=param, code=error.code, headers=error.headers)


def chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> p.ChatCompletionRequest:
    # OpenAI's range; top_p's (0, 1] is the engine's own, which refuses it naming top_p.
    check_range("temperature", req.temperature, 0.0, 2.0)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    tools, tool_choice = _chat_tools(req), _chat_tool_choice(req.tool_choice)
    if tool_choice == "auto" and not tools:
        # The Responses API's default (every reply gives it back): with no tools it asks for
        # nothing, where chat's `auto` without tools is a 400.
        tool_choice = None
    body = {
        "messages": system + conversation,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
    }
    return msgspec.convert({k: v for k, v in body.items() if v is not None}, p.ChatCompletionRequest)


# -- replies ----------------------------------------------------------------------------------


def _error_fields(error: ApiError) -> dict[str, Any]:
    return {"code": error.code, "message": error.message, "param": error.param}


class ResponsesReply:
    """The Translation (translated.py) of one Responses request; stores the response when done."""

    def __init__(self, req: ResponsesRequest, model: str, conversation: list[dict[str, Any]],
                 store: ResponseStore, origins: Sequence[str] = ()) -> None:  # fmt: skip
        self.req = req
        self.origins = origins  # where each chat message came from (renamed)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model
        self.conversation = conversation
        self.store = store
        self.output: list[dict[str, Any]] = []
        self.open_item: dict[str, Any] | None = None  # the item the stream is adding to
        self.finish_reason: str | None = None
        self.sequence_number = 0
        self.last_event: tuple[str, dict[str, Any]] = ("", {})  # the kind and body _event made last
        self.opened = False  # response.created is sent: a failure is then response.failed

    def body(
        self, status: str, usage: p.UsageOut | None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        fmt = (req.text.format if req.text is not None else None) or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": None if req.reasoning is None else msgspec.structs.asdict(req.reasoning),
            "store": req.store and self.store.enabled,
            "temperature": req.temperature,
            "text": {"format": fmt},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [msgspec.structs.asdict(t) for t in req.tools or []],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": None if usage is None else {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
                },
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            },
            "user": req.user,
            "metadata": req.metadata or {},
        }  # fmt: skip

    @staticmethod
    def _message_item() -> dict[str, Any]:
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                "role": "assistant", "content": []}  # fmt: skip

    @staticmethod
    def _reasoning_item() -> dict[str, Any]:
        return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "status": "in_progress", "summary": [],
                "content": []}  # fmt: skip

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
                "arguments": arguments, "status": "in_progress"}  # fmt: skip

    async def _finish(self, usage: p.UsageOut | None) -> dict[str, Any]:
        """The final body; stored (before the client hears of it, so that a next request naming
        it finds it on any replica)."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        body = self.body(status, usage)
        if self.req.store and self.store.enabled:
            said = {"role": "assistant", "content": None, "tool_calls": None}
            texts = [
                part["text"] for item in self.output if item["type"] == "message" for part in item["content"]
            ]
            calls = [{"id": item["call_id"], "type": "function",
                      "function": {"name": item["name"], "arguments": item["arguments"]}}
                     for item in self.output if item["type"] == "function_call"]  # fmt: skip
            said["content"] = "".join(texts) if texts or not calls else None
            said["tool_calls"] = calls or None
            conversation = msgspec.convert([*self.conversation, said], list[p.ChatMessageIn])
            entry = StoredResponse(time.time(), body, conversation, listed_input_items(self.req.input))
            await asyncio.to_thread(self.store.put, self.id, entry)
        return body

    def piece(self, piece: Piece) -> Piece:
        return piece

    async def whole(self, completion: p.ChatCompletion) -> bytes:
        choice = completion.choices[0]
        self.finish_reason = choice.finish_reason
        text = choice.message.content or ""
        calls = choice.message.tool_calls or []
        if choice.message.reasoning_content:
            item = self._reasoning_item()
            item["content"] = [{"type": "reasoning_text", "text": choice.message.reasoning_content}]
            self.output.append(item)
        # A message only with text, or when it would be the reply's only item: a reply cut
        # (max_output_tokens) inside its reasoning is that reasoning item alone, as OpenAI's and
        # as the stream (`closing`) has it, not one with an empty message after it.
        if text or (not self.output and not calls):
            item = self._message_item()
            item["content"] = [{"type": "output_text", "text": text, "annotations": []}]
            self.output.append(item)
        for call in calls:
            self.output.append(self._call_item(call.id, call.function.name, call.function.arguments))
        for item in self.output:
            item["status"] = "completed"
        self.output[-1]["status"] = self._last_item_status()
        return msgspec.json.encode(await self._finish(completion.usage))

    def _last_item_status(self) -> str:
        """The status of the item the reply ends with: OpenAI's `incomplete` where max_output_tokens
        cut it off (every item before it is complete)."""
        return "incomplete" if self.finish_reason == "length" else "completed"

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        self.last_event = (kind, body)
        return named_event(kind, body)

    def opening(self, usage: p.UsageOut | None) -> list[bytes]:  # usage comes at the end here
        body = self.body("in_progress", None)
        self.opened = True
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.open_item = item
        self.output.append(item)
        out.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        if item["type"] in ("message", "reasoning"):
            part = {"type": "output_text", "text": "", "annotations": []}
            if item["type"] == "reasoning":
                part = {"type": "reasoning_text", "text": ""}
            item["content"].append(part)
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self.output) - 1, content_index=0, part=part))  # fmt: skip
        return out

    def _close(self) -> list[bytes]:
        item = self.open_item
        if item is None:
            return []
        self.open_item = None
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        item["status"] = self._last_item_status()  # "completed" but at the reply's end
        if item["type"] == "message":
            part = item["content"][0]
            out = [self._event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]),
                   self._event("response.content_part.done", **where, content_index=0, part=part)]  # fmt: skip
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out = [self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"]),
                   self._event("response.content_part.done", **where, content_index=0, part=part)]  # fmt: skip
        else:
            out = [self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])]
        out.append(self._event("response.output_item.done", output_index=where["output_index"], item=item))
        return out

    def chunk(self, chunk: p.ChatCompletionChunk) -> list[bytes]:
        out: list[bytes] = []
        for choice in chunk.choices:
            delta = choice.delta
            if delta.reasoning_content:
                if self.open_item is None or self.open_item["type"] != "reasoning":
                    out += self._open(self._reasoning_item())
                assert self.open_item is not None
                where = {"item_id": self.open_item["id"], "output_index": len(self.output) - 1}
                self.open_item["content"][0]["text"] += delta.reasoning_content
                out.append(self._event("response.reasoning_text.delta", **where, content_index=0,
                                       delta=delta.reasoning_content))  # fmt: skip
            if delta.content:
                if self.open_item is None or self.open_item["type"] != "message":
                    out += self._open(self._message_item())
                assert self.open_item is not None
                where = {"item_id": self.open_item["id"], "output_index": len(self.output) - 1}
                self.open_item["content"][0]["text"] += delta.content
                out.append(self._event("response.output_text.delta", **where, content_index=0,
                                       delta=delta.content, logprobs=[]))  # fmt: skip
            for call in delta.tool_calls or []:
                if "id" in call:  # a call's first delta
                    out += self._open(self._call_item(call["id"], call["function"]["name"], ""))
                arguments = call["function"].get("arguments")
                if arguments and self.open_item is not None:
                    self.open_item["arguments"] += arguments
                    out.append(self._event("response.function_call_arguments.delta", item_id=self.open_item["id"],
                                           output_index=len(self.output) - 1, delta=arguments))  # fmt: skip
            self.finish_reason = choice.finish_reason or self.finish_reason
        if out and chunk.timings is not msgspec.UNSET:  # on the chunk's last event, as llama-server
            kind, body = self.last_event
            out[-1] = named_event(kind, {**body, "timings": msgspec.structs.asdict(chunk.timings)})
        return out

    async def closing(self, usage: p.UsageOut, timings: p.Timings | None = None) -> list[bytes]:
        out = self._close()
        if not self.output:  # an empty reply is still one (empty) message, as the whole reply has it
            out += self._open(self._message_item()) + self._close()
        body = await self._finish(usage)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        timed = {} if timings is None else {"timings": msgspec.structs.asdict(timings)}
        return [*out, self._event(kind, response=body, **timed)]

    def error_body(self, error: ApiError) -> bytes:
        return renamed(error, self.origins).body()

    def error_event(self, error: ApiError) -> bytes:
        """A stream's failure. Once response.created is out, OpenAI's stream ends with the one
        terminal event a client waits for, `response.failed`, its response `failed` with the
        `error`; before it there is no response to fail, so a bare `error` event says why."""
        error = renamed(error, self.origins)
        if not self.opened:
            return self._event("error", **_error_fields(error))
        failed = self.body("failed", None, {"code": error.code or "server_error", "message": error.message})
        return self._event("response.failed", response=failed)


# -- the endpoints ----------------------------------------------------------------------------


# OpenAI's bounds of `metadata`, which is stored with the response and given back with it
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's limits: 16 pairs at most, keys of 64 characters and values of 512 at most."""
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid(
            f"metadata has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed", "metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise invalid(f"metadata: a key of {len(key)} characters; at most {MAX_METADATA_KEY}", "metadata")
        if len(value) > MAX_METADATA_VALUE:
            raise invalid(f"metadata[{key!r}]: a value of {len(value)} characters; at most {MAX_METADATA_VALUE}",
                          "metadata")  # fmt: skip


def _query_int(text: str, name: str, low: int, high: int) -> int:
    """A query parameter that must be an integer in [low, high]: a 400 naming it otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise invalid(f"{name} must be an integer, got {text[:80]!r}", name) from None
    if not low <= value <= high:
        raise invalid(f"{name} must be in [{low}, {high}], got {value}", name)
    return value


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id {response_id[:80]!r} not found.", code="not_found")


class ResponsesApi:
    def __init__(self, gateway: Gateway, store: ResponseStore) -> None:
        self.gateway = gateway
        self.store = store

    async def create(self, request: Request) -> Response:
        req = await self.gateway.read_body(request, ResponsesRequest)
        check_metadata(req.metadata)
        conversation, origins, requested = await self._conversation(req)
        self.gateway.check_translated_chat(request, len(conversation), "input")
        try:
            plan = plan_chat(chat_request(req, conversation), header_seed(request.headers.get(SEED_HEADER)))
        except ApiError as error:
            raise renamed(error, origins) from None
        plan.aliases.update(
            {"max_tokens": "max_output_tokens", "prompt": "input", "structured": "text.format"}
        )
        model = self.gateway.with_adapter(requested, plan)
        reply = ResponsesReply(req, model, conversation, self.store, origins)
        return run_translated(self.gateway, request, plan, model, reply, req.stream, req.timings_per_token)

    async def input_tokens(self, request: Request) -> Response:
        """OpenAI's /v1/responses/input_tokens: the prompt length of a response request (its
        previous responses' turns included), without running the model."""
        req = await self.gateway.read_body(request, InputTokensRequest)
        conversation, origins, _ = await self._conversation(req)
        self.gateway.check_translated_chat(request, len(conversation), "input")
        try:
            chat = chat_to_render(chat_request(req, conversation))
            return self.gateway.finish(request, json_response(await self.gateway.input_tokens(chat)))
        except ApiError as error:
            raise renamed(error, origins) from None

    async def _conversation(self, req: ResponsesRequest) -> tuple[list[dict[str, Any]], list[str], str]:
        """The request's turns after its previous responses'; where each chat message of the
        request (instructions first) comes from, for refusals (`renamed`); and the model it
        names (a chain that names none goes on with its previous response's)."""
        conversation: list[dict[str, Any]] = []
        requested = req.model
        if req.previous_response_id is not None:
            previous = await asyncio.to_thread(self.store.get, req.previous_response_id)
            if previous is None:
                raise ApiError(400, f"Previous response with id {req.previous_response_id[:80]!r} not found.",
                               param="previous_response_id", code="previous_response_not_found")  # fmt: skip
            conversation = msgspec.to_builtins(previous.conversation)
            if not requested:
                # A chain that names no model goes on with its previous response's (a LoRA
                # adapter's stays selected), if that is still served.
                requested = str(previous.response.get("model", ""))
                await self.gateway.check_model(requested, ResponsesRequest.takes_adapter)
        turns, origins = input_turns(req.input)
        earlier = [f"previous_response_id's turn {k}" for k in range(len(conversation))]
        return (
            [*conversation, *turns],
            ["instructions"] * bool(req.instructions) + earlier + origins,
            requested,
        )

    async def stored(self, request: Request) -> Response:
        """GET or DELETE of a stored response: one route, so that a 405 there allows both."""
        return await (self.delete if request.method == "DELETE" else self.retrieve)(request)

    async def input_items(self, request: Request) -> Response:
        """OpenAI's GET /v1/responses/{id}/input_items: a stored response's own input items (not
        its previous responses'), a page at a time: `limit` 1-100 (20), `order` `desc` (OpenAI's
        default) or `asc`, and `after` / `before` an item id of the list in that order."""
        self.gateway.check_key(request)
        query = request.query_params
        limit = _query_int(query.get("limit", "20"), "limit", 1, 100)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid(f"order must be 'asc' or 'desc', got {order[:80]!r}", "order")
        response_id = request.path_params["response_id"]
        entry = await asyncio.to_thread(self.store.get, response_id)
        if entry is None:
            raise _not_found(response_id)
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        ids = [item.get("id") for item in items]
        start, stop = 0, len(items)
        for cursor in ("after", "before"):
            if (item_id := query.get(cursor)) is not None:
                if item_id not in ids:
                    raise invalid(f"{cursor}: no input item {item_id[:80]!r} in this response", cursor)
                if cursor == "after":
                    start = ids.index(item_id) + 1
                else:
                    stop = ids.index(item_id)
        if "before" in query and "after" not in query:  # the page just before the cursor
            first = max(start, stop - limit)
            page, has_more = items[first:stop], first > start
        else:
            page, has_more = items[start : start + limit], start + limit < stop
        body = {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": has_more,
        }
        return self.gateway.finish(request, json_response(body))

    async def cancel(self, request: Request) -> Response:
        """OpenAI's POST /v1/responses/{id}/cancel cancels a `background` response; this gateway
        answers every response before its request ends (a `background` request runs as any
        other), so a stored one is refused as OpenAI refuses a response not in the background."""
        self.gateway.check_key(request)
        response_id = request.path_params["response_id"]
        if await asyncio.to_thread(self.store.get, response_id) is None:
            raise _not_found(response_id)
        raise ApiError(400, "Only responses created with background=true can be cancelled; this server "
                       "runs every response to its end within its request.", code="invalid_request")  # fmt: skip

    async def retrieve(self, request: Request) -> Response:
        self.gateway.check_key(request)
        response_id = request.path_params["response_id"]
        entry = await asyncio.to_thread(self.store.get, response_id)
        if entry is None:
            raise _not_found(response_id)
        return self.gateway.finish(request, json_response(entry.response))

    async def delete(self, request: Request) -> Response:
        self.gateway.check_key(request)
        response_id = request.path_params["response_id"]
        if not await asyncio.to_thread(self.store.delete, response_id):
            raise _not_found(response_id)
        return self.gateway.finish(
            request, json_response({"id": response_id, "object": "response", "deleted": True})
        )
